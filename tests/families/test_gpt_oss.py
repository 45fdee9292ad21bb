"""gpt-oss packages: what export reads of its config and its GGUF, its MXFP4 experts kept as blocks
(from the Hugging Face checkpoint's own `*_blocks` / `*_scales` and from a GGUF) scoring as
transformers' dequantization of them, and its harmony template chosen as the package's. Its float
package is held to transformers (sinks, router and expert biases, the clamped SwiGLU, alternating
windows, untruncated yarn) by test_transformers_parity.py, which includes the tiny GptOssConfig."""

from __future__ import annotations

import io
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tests.family_checkpoints import Checkpoint, write_checkpoint
from tests.families.test_transformers_parity import PROMPTS, forward_in_pieces, reference_logits
from tests.gguf_writer import LLAMA_CPP_CONVERTER, convert_with_llama_cpp, gguf_vocabulary, write_family_gguf

from flare.engine import native
from flare.engine.model import DecoderModel, load_model
from flare.engine.tokenizer import Tokenizer
from flare.package.directory import open_package
from flare.preparation.default_model import default_gguf_path
from flare.preparation.export import ExportOptions, export_package
from flare.preparation.families.hf_config import model_config_from_hf
from flare.preparation.quantize import quantize_matrix
from flare.preparation.source import ModelSource

pytest.importorskip("transformers")

T = gguf.GGMLQuantizationType
HARMONY_TEMPLATE = (Path(__file__).parents[1] / "fixtures" / "templates" / "gpt-oss.jinja").read_text()
# llama.cpp's gpt-oss graph has the SwiGLU limit as a constant, 7: a checkpoint to write as a GGUF has it.
GGUF_LIMIT = {"swiglu_limit": 7.0}


def hf_config(**changes: object) -> dict:
    from tests.family_checkpoints import family_config

    return {**family_config("gpt_oss").to_dict(), **changes}


def test_its_config_reads_as_every_layer_moe_with_its_router_sinks_biases_and_alternating_windows() -> None:
    config = model_config_from_hf(hf_config(), None)
    assert config.architecture == "gpt_oss" and config.moe_layers == (0, 1, 2)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 2, 32)
    assert config.routing == "topk_softmax" and config.router_bias and config.expert_bias
    assert config.attention_bias and config.attention_output_bias and config.attention_sinks
    assert config.hidden_activation == "clamped_swiglu" and config.swiglu_limit == 1.0
    assert config.sliding_window == 8 and config.sliding_layers == (0, 2)
    assert config.rope_scaling is not None and config.rope_scaling.kind == "yarn" and not config.rope_scaling.truncate
    # Without layer_types the even layers slide, as GptOssConfig's default.
    untyped = model_config_from_hf({**hf_config(), "layer_types": None, "num_hidden_layers": 4}, None)
    assert untyped.sliding_layers == (0, 2)


def openai_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., rows, in] as gpt-oss's checkpoints hold MXFP4: blocks uint8 [..., rows, in / 32,
    16] (byte k: value 2k low nibble, 2k + 1 high) and E8M0 scales [..., rows, in / 32], from
    gguf-py's MXFP4 quantizer (ggml's byte j: value j low, j + 16 high)."""
    *lead, width = weight.shape
    rows = quantize_matrix(np.ascontiguousarray(weight.reshape(-1, width).numpy(), dtype=np.float32), T.MXFP4)
    groups = rows.reshape(*lead, width // 32, 17)
    nibbles = groups[..., 1:]
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)  # value i at i
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return torch.from_numpy(np.ascontiguousarray(blocks)), torch.from_numpy(np.ascontiguousarray(groups[..., 0]))


@pytest.fixture(scope="module")
def gpt_oss(smollm2_source: ModelSource, tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    root = tmp_path_factory.mktemp("gpt_oss")
    return write_checkpoint("gpt_oss", root / "hf", smollm2_source.tokenizer_json, smollm2_source.chat_template)


def max_difference(a: DecoderModel, prompts: list[list[int]], reference: list[torch.Tensor]) -> float:
    pieces = [[len(p) for p in prompts]]
    return max((got - want).abs().max().item() for got, want in zip(forward_in_pieces(a, prompts, pieces), reference))


@pytest.mark.skipif(not native.available(), reason="blocks are multiplied as blocks only by the C kernels")
def test_mxfp4_experts_of_the_hugging_face_checkpoint_are_kept_as_blocks_and_score_as_transformers_dequantization(
    smollm2_source: ModelSource, tmp_path: Path
) -> None:
    """The checkpoint's experts as OpenAI ships them (`*_blocks`, `*_scales`, gate and up rows
    interleaved) export as ggml MXFP4 blocks, served from the mapped file; the logits are those of
    transformers' model with its own dequantization of those tensors (convert_moe_packed_tensors)
    within 1e-4, and of the same checkpoint's float32 export."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    packed = tmp_path / "mxfp4"
    model = write_checkpoint("gpt_oss", packed, smollm2_source.tokenizer_json, smollm2_source.chat_template).model
    tensors = load_file(str(packed / "model.safetensors"))
    for layer in range(3):
        prefix = f"model.layers.{layer}.mlp.experts"
        for projection in ("gate_up_proj", "down_proj"):
            weight = tensors.pop(f"{prefix}.{projection}")  # transformers' [E, in, out]
            blocks, scales = openai_mxfp4(weight.transpose(1, 2))
            tensors[f"{prefix}.{projection}_blocks"], tensors[f"{prefix}.{projection}_scales"] = blocks, scales
            with torch.no_grad():
                getattr(model.model.layers[layer].mlp.experts, projection).copy_(
                    convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
                )
    save_file(tensors, str(packed / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((packed / "config.json").read_text())
    (packed / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    export_package(str(packed), tmp_path / "blocks", ExportOptions(), stderr=io.StringIO())
    export_package(str(packed), tmp_path / "float32", ExportOptions(dtype="float32"), stderr=io.StringIO())
    package = open_package(tmp_path / "blocks")
    for projection in ("gate_up_proj", "down_proj"):
        assert package.manifest.blocks[f"model.layers.0.mlp.experts.{projection}.weight"].type == "MXFP4"
    prompts = [Tokenizer.from_package(package).encode(text) for text in PROMPTS]
    expected = [reference_logits(Checkpoint("gpt_oss", packed, model), p) for p in prompts]
    assert max_difference(load_model(package), prompts, expected) <= 1e-4
    assert max_difference(load_model(open_package(tmp_path / "float32")), prompts, expected) <= 1e-4


def gguf_checkpoint(smollm2_source: ModelSource, path: Path) -> Checkpoint:
    return write_checkpoint("gpt_oss", path, smollm2_source.tokenizer_json, smollm2_source.chat_template, changes=GGUF_LIMIT)


def test_a_gguf_written_as_llama_cpp_writes_gpt_oss_is_the_hugging_face_package(smollm2_source: ModelSource, tmp_path: Path) -> None:
    """gpt-oss as GptOssModel writes it: experts transposed and gate/up split with their biases,
    `post_attention_norm` the norm before the MLP, `attn_sinks`, the router's bias; the even
    layers slide (llama.cpp's pattern 2). Same config and same tensors as the Hugging Face export."""
    checkpoint = gguf_checkpoint(smollm2_source, tmp_path / "hf")
    path = tmp_path / "gpt-oss.gguf"
    vocabulary = gguf_vocabulary(default_gguf_path())
    write_family_gguf(path, checkpoint.model.config, checkpoint.model.state_dict(), vocabulary=vocabulary,
                      chat_template=smollm2_source.chat_template)
    options = ExportOptions(dtype="float32")
    export_package(str(checkpoint.path), tmp_path / "from-hf", options, stderr=io.StringIO())
    export_package(str(path), tmp_path / "from-gguf", options, stderr=io.StringIO())
    hf, converted = open_package(tmp_path / "from-hf"), open_package(tmp_path / "from-gguf")
    assert converted.manifest.model == hf.manifest.model
    ours, theirs = converted.load_state_dict(), hf.load_state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


def test_a_gguf_without_its_sinks_is_refused_naming_the_tensor(smollm2_source: ModelSource, tmp_path: Path) -> None:
    from flare.preparation.export import ExportError

    checkpoint = gguf_checkpoint(smollm2_source, tmp_path / "hf")
    path = tmp_path / "no-sinks.gguf"
    write_family_gguf(path, checkpoint.model.config, checkpoint.model.state_dict(), vocabulary=gguf_vocabulary(default_gguf_path()),
                      chat_template=smollm2_source.chat_template, tensors={"blk.1.attn_sinks.weight": None})
    with pytest.raises(ExportError, match=r"blk\.1\.attn_sinks\.weight"):
        export_package(str(path), tmp_path / "package", ExportOptions(dtype="float32"), stderr=io.StringIO())


@pytest.mark.skipif(not native.available(), reason="blocks are multiplied as blocks only by the C kernels")
def test_a_gguf_with_mxfp4_experts_keeps_them_as_blocks_and_scores_as_its_float32_export(
    smollm2_source: ModelSource, tmp_path: Path
) -> None:
    checkpoint = gguf_checkpoint(smollm2_source, tmp_path / "hf")
    path = tmp_path / "mxfp4.gguf"
    experts = {kind: T.MXFP4 for kind in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}
    write_family_gguf(path, checkpoint.model.config, checkpoint.model.state_dict(), vocabulary=gguf_vocabulary(default_gguf_path()),
                      chat_template=smollm2_source.chat_template, types=experts)
    export_package(str(path), tmp_path / "blocks", ExportOptions(), stderr=io.StringIO())
    export_package(str(path), tmp_path / "float32", ExportOptions(dtype="float32"), stderr=io.StringIO())
    blocks = open_package(tmp_path / "blocks")
    assert blocks.manifest.blocks["model.layers.0.mlp.experts.gate_up_proj.weight"].type == "MXFP4"
    assert blocks.manifest.blocks["model.layers.0.mlp.experts.down_proj.weight"].type == "MXFP4"
    assert "model.layers.0.mlp.experts.gate_up_proj.bias" not in blocks.manifest.blocks
    prompts = [Tokenizer.from_package(blocks).encode(text) for text in PROMPTS]
    reference = load_model(open_package(tmp_path / "float32"))
    pieces = [[len(p) for p in prompts]]
    assert max_difference(load_model(blocks), prompts, forward_in_pieces(reference, prompts, pieces)) <= 1e-4


@pytest.mark.skipif(not LLAMA_CPP_CONVERTER.is_file(), reason="llama.cpp's convert_hf_to_gguf.py is not on this machine")
def test_llama_cpp_converter_output_is_the_hugging_face_package(smollm2_source: ModelSource, tmp_path: Path) -> None:
    checkpoint = gguf_checkpoint(smollm2_source, tmp_path / "hf")
    convert_with_llama_cpp([(checkpoint.path, tmp_path / "gpt-oss.gguf")])
    options = ExportOptions(dtype="float32")
    export_package(str(checkpoint.path), tmp_path / "from-hf", options, stderr=io.StringIO())
    export_package(str(tmp_path / "gpt-oss.gguf"), tmp_path / "from-gguf", options, stderr=io.StringIO())
    hf, converted = open_package(tmp_path / "from-hf"), open_package(tmp_path / "from-gguf")
    assert converted.manifest.model == hf.manifest.model
    ours, theirs = converted.load_state_dict(), hf.load_state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


def test_the_torch_steps_score_as_transformers_too(gpt_oss: Checkpoint, tmp_path: Path) -> None:
    """The layers' torch counterparts of the kernels (sinks in `scores_to_output`, the clamped
    SwiGLU in torch), in one prefill and in chunks through the paged cache."""
    export_package(str(gpt_oss.path), tmp_path / "package", ExportOptions(dtype="float32"), stderr=io.StringIO())
    package = open_package(tmp_path / "package")
    model = DecoderModel(package.manifest.model, package.load_state_dict(), native_kernels=False)
    prompts = [Tokenizer.from_package(package).encode(text) for text in PROMPTS]
    expected = [reference_logits(gpt_oss, p) for p in prompts]
    a, b = (len(p) for p in prompts)
    for pieces in ([[a, b]], [[17, 1], [1, 1], [a - 18, b - 2]]):
        for got, want in zip(forward_in_pieces(model, prompts, pieces), expected):
            assert (got - want).abs().max().item() <= 1e-4, pieces


@pytest.mark.skipif(not native.available(), reason="blocks are multiplied as blocks only by the C kernels")
def test_quantizing_keeps_the_expert_biases_float_and_scores_as_the_dequantized_weights(gpt_oss: Checkpoint, tmp_path: Path) -> None:
    """`--quantize q8_0` makes blocks of the weight matrices only: the 2-D expert biases, the
    sinks and the router stay float."""
    export_package(str(gpt_oss.path), tmp_path / "package", ExportOptions(quantize="q8_0"), stderr=io.StringIO())
    package = open_package(tmp_path / "package")
    blocks = package.manifest.blocks
    assert blocks["model.layers.0.mlp.experts.gate_up_proj.weight"].type == "Q8_0"
    assert not [name for name in blocks if not name.endswith(".weight") or ".router." in name]
    prompts = [Tokenizer.from_package(package).encode(PROMPTS[0])]
    reference = DecoderModel(package.manifest.model, package.load_state_dict(), native_kernels=False)
    pieces = [[len(prompts[0])]]
    assert max_difference(load_model(package), prompts, forward_in_pieces(reference, prompts, pieces)) <= 1e-4


def test_at_tensor_parallel_2_it_answers_as_at_1(gpt_oss: Checkpoint, tmp_path: Path) -> None:
    """Each rank holds its query heads' sinks, its share of every expert's gate/up bias with the
    rows, and rank 0 alone the experts' down bias: the sum over the ranks is the whole model's."""
    import threading

    from tests.parallel.test_moe_tensor_parallel import PairSum, logits

    from flare.parallel.tensor_split import rank_model, rank_state_dict

    export_package(str(gpt_oss.path), tmp_path / "package", ExportOptions(dtype="float32"), stderr=io.StringIO())
    package = open_package(tmp_path / "package")
    config, state = package.manifest.model, package.load_state_dict()
    shares = [rank_state_dict(config, state, rank, 2) for rank in range(2)]
    bias = "model.layers.0.mlp.experts.gate_up_proj.bias"
    assert torch.equal(shares[1][bias][3], torch.cat((state[bias][3][16:32], state[bias][3][48:64])))
    assert torch.equal(shares[1]["model.layers.0.self_attn.sinks"], state["model.layers.0.self_attn.sinks"][2:])
    prompts = [Tokenizer.from_package(package).encode(text) for text in PROMPTS]
    pieces = [[19, 9], [1, 1], [len(prompts[0]) - 20, len(prompts[1]) - 10]]
    whole = logits(DecoderModel(config, state), prompts, pieces)
    exchange = PairSum()
    results: list[list[torch.Tensor]] = [[], []]

    def run(rank: int) -> None:
        results[rank] = logits(rank_model(config, state, rank, 2, exchange.of(rank)), prompts, pieces)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    for expected, shard0, shard1 in zip(whole, *results):
        torch.testing.assert_close(torch.cat((shard0, shard1), dim=1), expected, atol=1e-4, rtol=1e-4)


async def test_a_chat_answer_is_served_through_the_harmony_template_and_reader(smollm2_source: ModelSource, tmp_path: Path) -> None:
    """Smoke test: a tiny gpt-oss whose tokenizer has harmony's control tokens and whose chat
    template is gpt-oss's own. The package reads as harmony (calls and reasoning), the prompt is
    rendered in it, and a served chat answer comes back through the harmony reader: whatever the
    random model writes, no control mark reaches the client."""
    from aiohttp.test_utils import TestClient, TestServer
    from tests.running_scheduler import running
    from tokenizers import Tokenizer as BackendTokenizer

    from flare.daemon.config import DaemonConfig
    from flare.package import reasoning_formats, tool_formats
    from flare.server.metrics import DaemonMetrics
    from flare.server.routes import create_app
    from flare.server.state import ServingState

    backend = BackendTokenizer.from_str(smollm2_source.tokenizer_json)
    backend.add_special_tokens(list(tool_formats.HARMONY_TOKENS))
    ids = {name: backend.token_to_id(name) for name in tool_formats.HARMONY_TOKENS}
    # As gpt-oss's config.json: <|return|> alone declared.
    changes = {"vocab_size": backend.get_vocab_size(), "eos_token_id": ids["<|return|>"]}
    checkpoint = write_checkpoint("gpt_oss", tmp_path / "hf", backend.to_str(), HARMONY_TEMPLATE, changes=changes)
    export_package(str(checkpoint.path), tmp_path / "package", ExportOptions(dtype="float32"), stderr=io.StringIO())
    package = open_package(tmp_path / "package")
    tokenizer = Tokenizer.from_package(package)
    assert tokenizer.tool_format is tool_formats.HARMONY and tokenizer.reasoning_format is reasoning_formats.HARMONY
    # <|call|> ends a call, as its template writes; <|end|> closes the analysis message, not the answer.
    assert set(package.manifest.model.eos_token_ids) == {ids["<|return|>"], ids["<|call|>"]}
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    assistant = tokenizer.encode("assistant", add_special_tokens=False)
    assert prompt[-len(assistant) - 1 :] == [ids["<|start|>"], *assistant]

    async with running(tmp_path / "package", draft_tokens=0) as scheduler:
        state = ServingState()
        state.ready(scheduler, ("gpt-oss",))
        client = TestClient(TestServer(create_app(DaemonConfig(), state, DaemonMetrics.create())))
        await client.start_server()
        try:
            response = await client.post(
                "/v1/chat/completions",
                json={"model": "gpt-oss", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 24, "temperature": 0},
            )
            assert response.status == 200, await response.text()
            message = (await response.json())["choices"][0]["message"]
        finally:
            await client.close()
    assert message["role"] == "assistant"
    for field in ("content", "reasoning_content"):
        assert "<|" not in (message.get(field) or ""), message


@pytest.mark.skipif(not native.available(), reason="the one-call decoder layer is a C kernel")
@pytest.mark.parametrize("experts", ["MXFP4", "Q8_0"])
def test_a_gpt_oss_package_of_blocks_runs_every_layer_in_the_one_call_decoder_layer_with_the_steps_bits(
    experts: str, smollm2_source: ModelSource, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round of short rows on gpt-oss (sinks, the o bias, alternating windows, the router's bias,
    expert biases and the clamped SwiGLU; MXFP4 experts from a GGUF, or all of it Q8_0) runs every
    layer in one `decoder_layers` call and gives the bits of the same model step by step: a prompt
    as a prefill, then decode and verify rounds reaching past the 8-token window."""
    from flare.engine import native_layers

    checkpoint = gguf_checkpoint(smollm2_source, tmp_path / "hf")
    if experts == "MXFP4":
        path = tmp_path / "mxfp4.gguf"
        types = {kind: T.MXFP4 for kind in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}
        types |= {kind: T.Q8_0 for kind in ("attn_q", "attn_k", "attn_v", "attn_output")}
        write_family_gguf(path, checkpoint.model.config, checkpoint.model.state_dict(), vocabulary=gguf_vocabulary(default_gguf_path()),
                          chat_template=smollm2_source.chat_template, types=types)
        export_package(str(path), tmp_path / "package", ExportOptions(), stderr=io.StringIO())
    else:
        export_package(str(checkpoint.path), tmp_path / "package", ExportOptions(quantize="q8_0"), stderr=io.StringIO())
    package = open_package(tmp_path / "package")
    assert package.manifest.blocks["model.layers.0.mlp.experts.gate_up_proj.weight"].type == experts
    fused = load_model(package)
    assert fused.kernel_layers is not None and fused.layer_calls == "one call"
    without = DecoderModel(package.manifest.model, package.load_state_dict(), native_kernels=False)
    assert without.layer_calls == "steps: the C kernels do not run"
    assert all(layer.moe is not None and layer.sinks is not None and layer.o_bias is not None for layer in fused.kernel_layers)
    assert {layer.window for layer in fused.kernel_layers} == {8, None}
    steps = load_model(package)
    steps.kernel_layers = None
    prompts = [Tokenizer.from_package(package).encode(text) for text in PROMPTS[:2]]
    pieces = [[len(p) - 8 for p in prompts], [1, 1], [2, 4], [1, 1], [4, 2]]
    calls: list[str] = []
    with monkeypatch.context() as patch:
        run = native_layers.LayerStack.run
        patch.setattr(native_layers.LayerStack, "run", lambda stack, *args: calls.append("layers") or run(stack, *args))
        got = forward_in_pieces(fused, prompts, pieces)
    assert calls.count("layers") == len(pieces) - 1  # every round of short rows in one call
    for fused_logits, step_logits in zip(got, forward_in_pieces(steps, prompts, pieces), strict=True):
        assert torch.equal(fused_logits, step_logits)
