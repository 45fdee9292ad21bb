"""GGUF as a source: names, dequantization, llama.cpp's q/k row order, config and tokenizer."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from tests.gguf_writer import tiny_vocabulary
from tokenizers import Tokenizer

from flare.preparation.default_model import default_gguf_path
from flare.preparation.gguf_source import open_gguf, unpermute_rope_rows
from flare.package.model_config import ModelConfig
from flare.package.directory import open_package
from flare.preparation.source import ModelSource, SourceError

GGUF_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
QUANTIZED = {  # tensors stored quantized in the tiny file, as in the real one
    "model.embed_tokens.weight": gguf.GGMLQuantizationType.Q8_0,
    "model.layers.0.mlp.up_proj.weight": gguf.GGMLQuantizationType.Q4_1,
    "model.layers.1.self_attn.q_proj.weight": gguf.GGMLQuantizationType.Q4_1,
    "model.layers.1.mlp.down_proj.weight": gguf.GGMLQuantizationType.F16,
}


def gguf_name(hf: str) -> str:
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
    if hf in globals_:
        return globals_[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{GGUF_NAMES[rest.removesuffix('.weight')]}.weight"


def permute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's permutation of q/k rows (convert_hf_to_gguf.py, LlamaModel.permute)."""
    rows, columns = weight.shape
    return weight.reshape(num_heads, 2, rows // num_heads // 2, columns).swapaxes(1, 2).reshape(rows, columns)


def write_tiny_gguf(
    path: Path,
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    *,
    tensor_types: dict[str, gguf.GGMLQuantizationType] | None = None,
    blocks: dict[str, tuple[gguf.GGMLQuantizationType, np.ndarray]] | None = None,
    **metadata: Any,
) -> None:
    """A GGUF as llama.cpp's converter writes it: q/k rows permuted, some tensors quantized
    (`tensor_types`, QUANTIZED by default). `blocks` gives tensors as raw ggml blocks [out, row_bytes],
    written as they are (in llama.cpp's row order already), in place of `state`'s. `kv` adds
    metadata keys (an int as uint32, a float as float32, a string as string)."""
    tensor_types = QUANTIZED if tensor_types is None else tensor_types
    blocks = blocks or {}
    tokens, types, merges = tiny_vocabulary()
    writer = gguf.GGUFWriter(str(path), metadata.get("architecture", "llama"))
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_tokenizer_model(metadata.get("tokenizer_model", "gpt2"))
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for key, value in metadata.get("kv", {}).items():
        add = writer.add_uint32 if isinstance(value, int) else writer.add_float32 if isinstance(value, float) else writer.add_string
        add(key, value)
    if metadata.get("chat_template", True):
        writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    for name, tensor in state.items():
        if name in blocks:
            kind, data = blocks[name]
            writer.add_tensor(gguf_name(name), data, raw_dtype=kind)
            continue
        array = tensor.numpy()
        if name.endswith("q_proj.weight"):
            array = permute_rope_rows(array, config.num_heads)
        elif name.endswith("k_proj.weight"):
            array = permute_rope_rows(array, config.num_kv_heads)
        qtype = tensor_types.get(name)
        if qtype is None:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(array))
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(array.astype(np.float16)))
        else:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantized(array: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    if qtype == gguf.GGMLQuantizationType.F16:
        return array.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype)


@pytest.fixture(scope="module")
def tiny_gguf_config(tiny_config: ModelConfig) -> ModelConfig:
    from dataclasses import replace

    tokens, _, _ = tiny_vocabulary()
    return replace(tiny_config, vocab_size=len(tokens))


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    weight = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    assert np.array_equal(unpermute_rope_rows(permute_rope_rows(weight, 3), 3), weight)
    assert not np.array_equal(permute_rope_rows(weight, 3), weight)


def rope_rotate_half(x: np.ndarray, position: int, theta: float) -> np.ndarray:
    """Hugging Face Llama: dimension i pairs with i + d/2."""
    d = x.shape[-1]
    angles = position * theta ** (-np.arange(0, d, 2) / d)
    cos, sin = np.concatenate([np.cos(angles)] * 2), np.concatenate([np.sin(angles)] * 2)
    rotated = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], axis=-1)
    return x * cos + rotated * sin


def rope_adjacent_pairs(x: np.ndarray, position: int, theta: float) -> np.ndarray:
    """llama.cpp's rope for llama (GGML_ROPE_TYPE_NORM): dimension 2i pairs with 2i + 1."""
    d = x.shape[-1]
    angles = position * theta ** (-np.arange(0, d, 2) / d)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * np.cos(angles) - odd * np.sin(angles)
    out[..., 1::2] = even * np.sin(angles) + odd * np.cos(angles)
    return out


def test_unpermuted_weights_give_llama_cpp_attention_scores_under_rotate_half_rope() -> None:
    """The point of the unpermutation: HF's RoPE on unpermuted rows scores as llama.cpp's on the file's rows."""
    rng = np.random.default_rng(1)
    heads, head_dim, hidden, theta = 2, 8, 12, 10000.0
    file_q = rng.standard_normal((heads * head_dim, hidden))
    file_k = rng.standard_normal((heads * head_dim, hidden))
    x_m, x_n = rng.standard_normal(hidden), rng.standard_normal(hidden)
    for position_m, position_n in [(0, 0), (5, 2), (17, 30)]:
        llama_cpp = [
            rope_adjacent_pairs((file_q @ x_m).reshape(heads, head_dim)[h], position_m, theta)
            @ rope_adjacent_pairs((file_k @ x_n).reshape(heads, head_dim)[h], position_n, theta)
            for h in range(heads)
        ]
        hf_q, hf_k = unpermute_rope_rows(file_q, heads), unpermute_rope_rows(file_k, heads)
        hugging_face = [
            rope_rotate_half((hf_q @ x_m).reshape(heads, head_dim)[h], position_m, theta)
            @ rope_rotate_half((hf_k @ x_n).reshape(heads, head_dim)[h], position_n, theta)
            for h in range(heads)
        ]
        assert np.allclose(llama_cpp, hugging_face)


def test_tiny_gguf_reads_back_as_the_hugging_face_model(
    tmp_path: Path, tiny_gguf_config: ModelConfig, make_state_dict: Any
) -> None:
    state = make_state_dict(tiny_gguf_config, seed=3)
    write_tiny_gguf(tmp_path / "tiny.gguf", tiny_gguf_config, state)
    source = open_gguf(tmp_path / "tiny.gguf")
    assert source.config == tiny_gguf_config
    assert source.source_format == "gguf" and len(source.source_sha256 or "") == 64
    calls: list[tuple[int, int]] = []
    weights = source.read_weights(lambda done, total: calls.append((done, total)))
    assert calls[-1] == (len(state), len(state))
    assert weights.keys() == state.keys()
    for name, expected in state.items():
        qtype = QUANTIZED.get(name)
        want = expected.numpy() if qtype is None else quantized(expected.numpy(), qtype)
        assert weights[name].dtype == torch.float32
        assert np.array_equal(weights[name].numpy(), want), name


def test_tiny_gguf_tokenizer_keeps_specials_whole_and_applies_merges(
    tmp_path: Path, tiny_gguf_config: ModelConfig, make_state_dict: Any
) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf", tiny_gguf_config, make_state_dict(tiny_gguf_config))
    source = open_gguf(tmp_path / "tiny.gguf")
    tokenizer = Tokenizer.from_str(source.tokenizer_json)
    tokens, _, _ = tiny_vocabulary()
    ids = tokenizer.encode("<|im_start|> the 42<|im_end|>").ids
    assert [tokens[i] for i in ids] == ["<|im_start|>", "Ġthe", "Ġ", "4", "2", "<|im_end|>"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == " the 42"
    assert "<|im_start|>" in source.chat_template


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ({"architecture": "gemma"}, "architecture 'gemma' is not served; flare serves llama, qwen2, qwen3, gemma2"),
        ({"tokenizer_model": "bert"}, "tokenizer model 'bert' is not supported.*Hugging Face model directory"),
        ({"chat_template": False}, "has no chat template"),
    ],
)
def test_unsupported_gguf_is_refused_with_the_reason(
    tmp_path: Path, tiny_gguf_config: ModelConfig, make_state_dict: Any, metadata: dict, message: str
) -> None:
    write_tiny_gguf(tmp_path / "bad.gguf", tiny_gguf_config, make_state_dict(tiny_gguf_config), **metadata)
    with pytest.raises(SourceError, match=message):
        open_gguf(tmp_path / "bad.gguf")


def test_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model.gguf").write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(SourceError, match="is not a readable GGUF file"):
        open_gguf(tmp_path / "model.gguf")


def test_default_model_config_is_smollm2_135m(smollm2_source: ModelSource) -> None:
    assert smollm2_source.config == ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=smollm2_source.config.rms_norm_eps,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
    )
    assert math.isclose(smollm2_source.config.rms_norm_eps, 1e-5, rel_tol=1e-6)


@pytest.mark.real_model
def test_default_package_q_and_k_match_transformers_gguf_loader(default_float32_package: Path) -> None:
    """transformers' own GGUF conversion (LlamaTensorProcessor) gives the q/k rows the package holds."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    reader = gguf.GGUFReader(default_gguf_path())
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    ours = open_package(default_float32_package).load_state_dict()
    checked = 0
    for tensor in reader.tensors:
        if tensor.name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.29.attn_k.weight"):
            dequantized = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            theirs = processor.process(weights=dequantized, name=tensor.name).weights
            layer, kind = tensor.name.split(".")[1], tensor.name.split(".")[2][-1]
            assert np.array_equal(ours[f"model.layers.{layer}.self_attn.{kind}_proj.weight"].numpy(), theirs)
            checked += 1
    assert checked == 3


TOKENIZER_SAMPLES = [
    "Hello 12345 world",
    "The year 2024 had 366 days; 3.14159 and 1,000,000.",
    "héllo wörld – 日本語 тест 🤖🎉 👩‍👩‍👧",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
    "  leading  spaces\n\n\ttabs and don't I'll we've",
    "def f(x):\n    return x**2  # comment",
    "x<|endoftext|>y<repo_name>z",
]


@pytest.mark.real_model
def test_default_model_tokenizer_matches_transformers_gguf_tokenizer(smollm2_source: ModelSource) -> None:
    from transformers import AutoTokenizer

    path = default_gguf_path()
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = Tokenizer.from_str(smollm2_source.tokenizer_json)
    for text in TOKENIZER_SAMPLES:
        ids = ours.encode(text).ids
        assert ids == theirs.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.token_to_id("<|im_start|>") == 1 and ours.token_to_id("<|im_end|>") == 2
    # Control tokens are special (skipped when decoding for users).
    added = {token["content"]: token["special"] for token in json.loads(smollm2_source.tokenizer_json)["added_tokens"]}
    assert added["<|im_end|>"] is True and len(added) == 17
