"""Each served family read from a GGUF as llama.cpp's converter writes it (tests/gguf_writer.py):
the config its metadata gives, and weights equal to the checkpoint's under the package contract.

The checkpoints are tiny random ones that transformers builds from its own config classes. What
a GGUF cannot carry, and so differs from the Hugging Face export by design: Mistral is written as
arch `llama` and without its sliding window (the converter writes neither); Llama 3.1's llama3
scaling arrives as per-frequency divisors (kind "factors", the same frequencies: checked against
transformers below); Gemma's query_pre_attn_scalar is not written (llama.cpp takes head_dim, or
hidden / heads for the 27B models, and so does flare); eos ids come from the tokenizer metadata.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from tests.gguf_writer import (
    LLAMA_CPP_CONVERTER,
    canonical_state,
    convert_with_llama_cpp,
    llama3_rope_freqs,
    quantized_values,
    save_tiny_checkpoint,
    tiny_vocabulary,
    write_family_gguf,
)

from flare.package.blocks import dequantized
from flare.preparation.gguf_source import open_gguf
from flare.package.model_config import ModelConfig, RopeScaling
from flare.preparation.source import SourceError

VOCAB = len(tiny_vocabulary()[0])
F32 = gguf.GGUFValueType.FLOAT32
U32 = gguf.GGUFValueType.UINT32
I32 = gguf.GGUFValueType.INT32
STRING = gguf.GGUFValueType.STRING


SHAPE = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": VOCAB, "max_position_embeddings": 512}
LLAMA_SHAPE = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_heads": 4, "num_kv_heads": 2,
               "head_dim": 16, "max_position_embeddings": 512}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@dataclass(frozen=True)
class Family:
    name: str
    hf_config: Callable[[], Any]
    expected: Callable[[], ModelConfig]


def _llama() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=2, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                       rope_parameters=dict(LLAMA3_ROPE), **SHAPE)


def _mistral() -> Any:
    from transformers import MistralConfig

    return MistralConfig(num_hidden_layers=2, sliding_window=16, bos_token_id=1, eos_token_id=2, **SHAPE)


def _qwen2() -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(num_hidden_layers=2, tie_word_embeddings=True, eos_token_id=2,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **SHAPE)


def _qwen3() -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(num_hidden_layers=2, head_dim=32, eos_token_id=2, **SHAPE)


def _gemma2() -> Any:
    from transformers import Gemma2Config

    return Gemma2Config(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0, **SHAPE)


def _gemma3() -> Any:
    from transformers import Gemma3TextConfig

    # Seven layers: llama.cpp's default pattern (5 local : 1 global) gives layer 5 global.
    return Gemma3TextConfig(
        num_hidden_layers=7, head_dim=16, query_pre_attn_scalar=16, sliding_window=8, bos_token_id=1,
        eos_token_id=2, pad_token_id=0,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        **SHAPE,
    )


PHI3_SHORT, PHI3_LONG = [1.0, 1.1, 1.3, 1.7], [2.0, 3.1, 4.2, 5.3]


def _phi3() -> Any:
    from transformers import Phi3Config

    return Phi3Config(
        num_hidden_layers=2, original_max_position_embeddings=64, sliding_window=16, bos_token_id=1,
        eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "short_factor": list(PHI3_SHORT), "long_factor": list(PHI3_LONG)},
        **SHAPE,
    )


FAMILIES = [
    Family("llama", _llama, lambda: ModelConfig(
        **LLAMA_SHAPE, num_layers=2, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=1, eos_token_ids=(2,),
        rope_scaling=RopeScaling(kind="factors", short_factor=tuple(llama3_rope_freqs(LLAMA3_ROPE, 16).tolist())),
    )),
    Family("mistral", _mistral, lambda: ModelConfig(
        **LLAMA_SHAPE, num_layers=2, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=1, eos_token_ids=(2,),
    )),
    Family("qwen2", _qwen2, lambda: ModelConfig(
        **LLAMA_SHAPE, num_layers=2, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=None, eos_token_ids=(2,), architecture="qwen2", attention_bias=True,
    )),
    Family("qwen3", _qwen3, lambda: ModelConfig(
        **{**LLAMA_SHAPE, "head_dim": 32}, num_layers=2, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=None, eos_token_ids=(2,), architecture="qwen3", qk_norm=True,
    )),
    Family("gemma2", _gemma2, lambda: ModelConfig(
        **LLAMA_SHAPE, num_layers=3, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=1, eos_token_ids=(2,), architecture="gemma2", sliding_window=8, sliding_layers=(0, 2),
        attention_scale=0.25, attention_softcap=50.0, final_logit_softcap=30.0, sandwich_norms=True,
        embedding_scale=8.0, hidden_activation="gelu_tanh",
    )),
    Family("gemma3", _gemma3, lambda: ModelConfig(
        **LLAMA_SHAPE, num_layers=7, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=1, eos_token_ids=(2,), architecture="gemma3", qk_norm=True,
        rope_scaling=RopeScaling(kind="linear", factor=4.0), sliding_window=8, sliding_layers=(0, 1, 2, 3, 4, 6),
        local_rope_theta=1e4, attention_scale=0.25, sandwich_norms=True, embedding_scale=8.0,
        hidden_activation="gelu_tanh",
    )),
    Family("phi3", _phi3, lambda: ModelConfig(
        **LLAMA_SHAPE, num_layers=2, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=1, eos_token_ids=(2,), architecture="phi3", rotary_dim=8,
        rope_scaling=RopeScaling(kind="longrope", factor=8.0, original_max_position_embeddings=64,
                                 short_factor=tuple(PHI3_SHORT), long_factor=tuple(PHI3_LONG)),
        sliding_window=16, sliding_layers=(0, 1),
    )),
]
BY_NAME = {family.name: family for family in FAMILIES}


def checkpoint(family: Family, seed: int = 0) -> tuple[Any, dict[str, torch.Tensor]]:
    """A tiny random checkpoint of `family`: transformers' own model from its config, every
    parameter (norms included) random so that a misplaced or unshifted tensor shows."""
    from transformers import AutoModelForCausalLM

    config = family.hf_config()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.2)
    return config, {name: tensor.clone() for name, tensor in model.state_dict().items()}


@pytest.fixture(scope="module", params=[f.name for f in FAMILIES])
def family_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Family, Any, dict[str, torch.Tensor], Path]:
    family = BY_NAME[request.param]
    config, state = checkpoint(family)
    path = tmp_path_factory.mktemp(family.name) / f"{family.name}.gguf"
    write_family_gguf(path, config, state)
    return family, config, state, path


def test_family_gguf_config_is_the_checkpoints(family_gguf: tuple[Family, Any, dict[str, torch.Tensor], Path]) -> None:
    family, _, _, path = family_gguf
    assert open_gguf(path).config == family.expected()


def test_family_gguf_weights_are_the_checkpoints_under_the_package_contract(
    family_gguf: tuple[Family, Any, dict[str, torch.Tensor], Path],
) -> None:
    _, config, state, path = family_gguf
    expected = canonical_state(config, state)
    weights = open_gguf(path).read_weights(lambda done, total: None)
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma3", "phi3"])
def test_family_q8_0_gguf_keeps_split_and_unpermuted_blocks_equal_to_its_dequantized_weights(
    tmp_path: Path, name: str
) -> None:
    """Q8_0 matrices stay blocks (Phi-3's fused ones split at block rows, Llama's q/k block rows
    unpermuted); each dequantizes to what the float reading of the same file gives, which is the
    checkpoint's tensor through Q8_0."""
    config, state = checkpoint(BY_NAME[name], seed=1)
    write_family_gguf(tmp_path / "q8.gguf", config, state, quantize=gguf.GGMLQuantizationType.Q8_0)
    source = open_gguf(tmp_path / "q8.gguf")
    expected = {n: quantized_values(t.numpy(), gguf.GGMLQuantizationType.Q8_0) for n, t in canonical_state(config, state).items()}
    floats = source.read_dequantized(lambda done, total: None)
    kept = source.read_blocks(lambda done, total: None)
    assert floats.floats.keys() == expected.keys()
    assert kept.blocks and kept.blocks.keys() | kept.floats.keys() == expected.keys()
    for tensor_name, values in expected.items():
        assert np.array_equal(floats.floats[tensor_name].numpy(), values), tensor_name
        if tensor_name in kept.blocks:
            assert np.array_equal(dequantized(kept.blocks[tensor_name]).numpy(), values), tensor_name
    fused = "model.layers.0.self_attn.k_proj.weight"
    assert fused in kept.blocks and kept.blocks[fused].shape == (32, 64)


def test_eos_eot_and_eom_ids_all_stop_in_that_order(tmp_path: Path) -> None:
    config, state = checkpoint(BY_NAME["llama"])
    ids = {"tokenizer.ggml.eot_token_id": (0, U32), "tokenizer.ggml.eom_token_id": (1, U32)}
    write_family_gguf(tmp_path / "stops.gguf", config, state, metadata=ids)
    assert open_gguf(tmp_path / "stops.gguf").config.eos_token_ids == (2, 0, 1)


def test_a_bundled_vision_encoder_is_left_out_of_the_text_model(tmp_path: Path) -> None:
    config, state = checkpoint(BY_NAME["gemma3"])
    encoder = {"v.blk.0.attn_q.weight": np.ones((32, 32)), "mm.input_projection.weight": np.ones((64, 32))}
    write_family_gguf(tmp_path / "bundled.gguf", config, state, tensors=encoder)
    weights = open_gguf(tmp_path / "bundled.gguf").read_weights(lambda done, total: None)
    assert weights.keys() == canonical_state(config, state).keys()


def test_yarn_scaling_reads_with_the_defaults_transformers_and_llama_cpp_share(tmp_path: Path) -> None:
    from transformers import Qwen3Config

    config = Qwen3Config(num_hidden_layers=2, head_dim=32, eos_token_id=2, **SHAPE,
                         rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                          "original_max_position_embeddings": 128})
    state = {n: t for n, t in checkpoint(BY_NAME["qwen3"])[1].items()}
    write_family_gguf(tmp_path / "yarn.gguf", config, state)
    assert open_gguf(tmp_path / "yarn.gguf").config.rope_scaling == RopeScaling(
        kind="yarn", factor=4.0, original_max_position_embeddings=128, beta_fast=32.0, beta_slow=1.0,
        attention_factor=0.1 * math.log(4.0) + 1.0,
    )


def test_llama3_rope_freqs_give_transformers_llama3_frequencies() -> None:
    """rope_freqs (kind "factors") divides the plain frequencies into transformers' llama3 ones."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _llama()
    llama3, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / (LLAMA3_ROPE["rope_theta"] ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    factors = torch.tensor(BY_NAME["llama"].expected().rope_scaling.short_factor)  # type: ignore[union-attr]
    assert torch.allclose(plain / factors, llama3.float(), rtol=1e-6)
    assert not torch.allclose(plain, llama3.float(), rtol=1e-3)  # the scaling does change them


@pytest.mark.parametrize(
    ("family", "edit", "message"),
    [
        ("qwen3", {"architecture": "grok"}, "architecture 'grok' is not served; flare serves llama, qwen2.*qwen3moe.*deepseek2"),
        # A router without expert_count: not a MoE file, so the tensor is not part of the model.
        ("llama", {"tensors": {"blk.0.ffn_gate_inp.weight": np.zeros((4, 64))}}, r"blk.0.ffn_gate_inp.weight\) is not part of a llama model"),
        ("llama", {"metadata": {"llama.expert_count": (8, U32)}}, r"llama.expert_count is 8 but no layer holds a router \(ffn_gate_inp\)"),
        ("gemma2", {"metadata": {"gemma2.attention.sliding_window": (-4, I32)}}, "gemma2.attention.sliding_window must be a non-negative integer, found -4"),
        ("gemma3", {"metadata": {"gemma3.attention.sliding_window_pattern": ([True, False], gguf.GGUFValueType.ARRAY)}},
         "gemma3.attention.sliding_window_pattern must be a count or 7 booleans"),
        ("qwen3", {"metadata": {"qwen3.attention.key_length": (0, U32)}}, "qwen3.attention.key_length must be one positive integer, found 0"),
        ("qwen3", {"metadata": {"qwen3.attention.value_length": (16, U32)}}, "value_length 16 differs from the key length 32"),
        ("qwen2", {"metadata": {"qwen2.attention.head_count": ([4, 4], gguf.GGUFValueType.ARRAY)}}, "qwen2.attention.head_count must be one positive integer"),
        ("qwen2", {"metadata": {"qwen2.rope.freq_base": ("fast", STRING)}}, "qwen2.rope.freq_base must be a positive number, found 'fast'"),
        ("qwen2", {"metadata": {"qwen2.attention.layer_norm_rms_epsilon": None}}, "lacks the GGUF metadata key qwen2.attention.layer_norm_rms_epsilon"),
        ("qwen2", {"metadata": {"qwen2.rope.scaling.type": ("dynamic", STRING)}}, "qwen2.rope.scaling.type must be none, linear, yarn or longrope"),
        ("qwen2", {"metadata": {"qwen2.rope.scaling.type": ("yarn", STRING)}}, "lacks the GGUF metadata key qwen2.rope.scaling.factor"),
        ("phi3", {"metadata": {"phi3.rope.dimension_count": (9, U32)}}, "phi3.rope.dimension_count 9 must be even"),
        ("phi3", {"tensors": {"rope_factors_short.weight": None}}, "rope_factors_short.weight is missing"),
        ("phi3", {"tensors": {"rope_factors_long.weight": np.ones(3)}}, "rope_factors_long.weight must hold 4 positive factors"),
        ("llama", {"tensors": {"rope_freqs.weight": np.zeros(8)}}, "rope_freqs.weight must hold 8 positive factors.*zero"),
        ("phi3", {"tensors": {"blk.1.attn_qkv.weight": np.zeros((60, 64))}}, "fused tensor blk.1.attn_qkv.weight has 60 rows, expected q \\+ k \\+ v = 128"),
        ("qwen3", {"tensors": {"blk.1.attn_k_norm.weight": None}}, "model.layers.1.self_attn.k_norm.weight \\(blk.1.attn_k_norm.weight\\) is missing"),
        ("gemma2", {"tensors": {"blk.0.post_ffw_norm.weight": None}}, "model.layers.0.mlp_output_norm.weight \\(blk.0.post_ffw_norm.weight\\) is missing"),
        ("qwen2", {"tensors": {"blk.0.attn_qkv.weight": np.zeros((128, 64))}}, "both give model.layers.0.self_attn.q_proj.weight"),
    ],
)
def test_malformed_family_gguf_is_refused_naming_the_key_or_tensor(
    tmp_path: Path, family: str, edit: dict[str, Any], message: str
) -> None:
    config, state = checkpoint(BY_NAME[family])
    write_family_gguf(tmp_path / "bad.gguf", config, state, **edit)
    with pytest.raises(SourceError, match=message):
        open_gguf(tmp_path / "bad.gguf")


@pytest.fixture(scope="module")
def converted_by_llama_cpp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each family's checkpoint as llama.cpp's converter writes it (one converter process for all)."""
    root = tmp_path_factory.mktemp("converted")
    for family in FAMILIES:
        save_tiny_checkpoint(root / family.name, *checkpoint(family))
    convert_with_llama_cpp([(root / family.name, root / f"{family.name}.gguf") for family in FAMILIES])
    return {family.name: root / f"{family.name}.gguf" for family in FAMILIES}


@pytest.mark.skipif(not LLAMA_CPP_CONVERTER.is_file(), reason="llama.cpp's convert_hf_to_gguf.py is not on this machine")
@pytest.mark.parametrize("name", [f.name for f in FAMILIES])
def test_llama_cpp_converter_output_reads_as_the_test_writers(
    tmp_path: Path, name: str, converted_by_llama_cpp: dict[str, Path]
) -> None:
    """The real converter's GGUF of the same checkpoint gives the same config and weights as
    tests/gguf_writer.py's, so the helper's facts are the converter's."""
    config, state = checkpoint(BY_NAME[name])
    write_family_gguf(tmp_path / "written.gguf", config, state)
    converted, written = open_gguf(converted_by_llama_cpp[name]), open_gguf(tmp_path / "written.gguf")
    # bos and eos: the converter takes them from the tokenizer's files, the helper from config.json.
    assert replace(converted.config, bos_token_id=None, eos_token_ids=(0,)) == replace(
        written.config, bos_token_id=None, eos_token_ids=(0,)
    )
    assert written.config == BY_NAME[name].expected()
    ours, theirs = written.read_weights(lambda d, t: None), converted.read_weights(lambda d, t: None)
    assert theirs.keys() == ours.keys()
    for tensor_name, tensor in ours.items():
        assert torch.equal(theirs[tensor_name], tensor), tensor_name


def test_family_gguf_exports_to_a_package_holding_its_config_and_weights(
    family_gguf: tuple[Family, Any, dict[str, torch.Tensor], Path], tmp_path: Path
) -> None:
    """`flare export --dtype float32` of each family's GGUF: the manifest keeps every family field
    (RoPE factors included) and the package's weights are the checkpoint's under the contract."""
    from flare.preparation.export import ExportOptions, export_package
    from flare.package.directory import open_package

    family, config, state, path = family_gguf
    export_package(str(path), tmp_path / "pkg", ExportOptions(dtype="float32"), stderr=None)
    package = open_package(tmp_path / "pkg")
    assert package.manifest.model == family.expected()
    expected = canonical_state(config, state)
    weights = package.load_state_dict()
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name


def test_phi3_q8_0_gguf_exports_its_split_fused_blocks(tmp_path: Path) -> None:
    """`flare export` (--dtype auto) keeps a Q8_0 Phi-3's fused matrices as blocks, split."""
    from flare.preparation.export import ExportOptions, export_package
    from flare.package.directory import open_package

    config, state = checkpoint(BY_NAME["phi3"], seed=2)
    write_family_gguf(tmp_path / "q8.gguf", config, state, quantize=gguf.GGMLQuantizationType.Q8_0)
    export_package(str(tmp_path / "q8.gguf"), tmp_path / "pkg", ExportOptions(), stderr=None)
    package = open_package(tmp_path / "pkg")
    assert {"model.layers.1.self_attn.v_proj.weight", "model.layers.1.mlp.gate_proj.weight"} <= package.manifest.blocks.keys()
    weights = package.load_state_dict()
    for name, tensor in canonical_state(config, state).items():
        assert np.array_equal(weights[name].numpy(), quantized_values(tensor.numpy(), gguf.GGMLQuantizationType.Q8_0)), name
