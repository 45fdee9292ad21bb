"""A Hugging Face model directory as a source."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tests.deepseek_mtp import write_mtp_checkpoint
from tests.families.test_transformers_parity import LOGIT_TOLERANCE, PROMPTS, forward_in_pieces, reference_logits
from tests.family_checkpoints import Checkpoint, write_as_fp8, write_checkpoint

from flare.engine.model import load_model
from flare.engine.tokenizer import Tokenizer
from flare.package.directory import open_package
from flare.preparation.export import ExportOptions, export_package
from flare.preparation.hf_source import open_hf_directory
from flare.preparation.inspect import inspect_package, render_text
from flare.package.model_config import ModelConfig
from flare.preparation.source import ModelSource, SourceError


def test_directory_reads_back_config_tokenizer_template_and_weights(tmp_path: Path, package_parts: dict[str, Any], make_hf_directory: Any) -> None:
    directory = make_hf_directory(tmp_path / "model", package_parts, shards=2)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    source = open_hf_directory(directory)
    config = package_parts["config"]
    assert source.config == ModelConfig(**{**config.to_json(), "eos_token_ids": (2, 0)})
    assert source.source_format == "huggingface" and source.source_sha256 is None
    assert source.chat_template == package_parts["chat_template"]
    assert source.tokenizer_json == package_parts["tokenizer_json"]
    weights = source.read_weights(lambda done, total: None)
    assert weights.keys() == package_parts["state_dict"].keys()
    for name, tensor in package_parts["state_dict"].items():
        assert weights[name].dtype == torch.float32
        assert torch.equal(weights[name], tensor.to(torch.bfloat16).float())


def test_tied_model_saved_with_an_lm_head_copy_drops_it(tmp_path: Path, package_parts: dict[str, Any], make_hf_directory: Any) -> None:
    state = dict(package_parts["state_dict"])
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    directory = make_hf_directory(tmp_path / "model", {**package_parts, "state_dict": state})
    weights = open_hf_directory(directory).read_weights(lambda done, total: None)
    assert "lm_head.weight" not in weights


def test_chat_template_from_chat_template_jinja(tmp_path: Path, package_parts: dict[str, Any], make_hf_directory: Any) -> None:
    directory = make_hf_directory(tmp_path / "model", package_parts)
    (directory / "tokenizer_config.json").write_text("{}")
    (directory / "chat_template.jinja").write_text("{{ messages }}")
    assert open_hf_directory(directory).chat_template == "{{ messages }}"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "falcon"}, "describes a 'falcon' model; flare serves model types llama, mistral, qwen2, qwen3, gemma2"),
        ({"model_type": "deepseek_v3"}, "lacks 'kv_lora_rank'"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 8.0}}, "RoPE scaling 'dynamic'"),
        ({"attention_bias": True}, "bias terms"),
        ({"hidden_act": "relu"}, "activation 'relu'"),
        ({"num_hidden_layers": 3}, r"config.json claims 3 layers \(num_hidden_layers\) but the weights hold tensors for 2"),
    ],
)
def test_unsupported_config_is_refused_with_the_reason(
    tmp_path: Path, package_parts: dict[str, Any], make_hf_directory: Any, change: dict[str, Any], message: str
) -> None:
    directory = make_hf_directory(tmp_path / "model", package_parts, config_changes=change)
    with pytest.raises(SourceError, match=message):
        open_hf_directory(directory)


def test_missing_files_are_named(tmp_path: Path, package_parts: dict[str, Any], make_hf_directory: Any) -> None:
    directory = make_hf_directory(tmp_path / "model", package_parts)
    (directory / "tokenizer_config.json").unlink()
    with pytest.raises(SourceError, match="has no chat template"):
        open_hf_directory(directory)
    (directory / "tokenizer.json").unlink()
    with pytest.raises(SourceError, match="has no tokenizer.json"):
        open_hf_directory(directory)
    for weights in directory.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(SourceError, match=r"holds no \*.safetensors weights"):
        open_hf_directory(directory)
    (directory / "config.json").unlink()
    with pytest.raises(SourceError, match="has no config.json"):
        open_hf_directory(directory)


@pytest.mark.parametrize(
    ("content", "why"),
    [(b"{not json", "key must be a string"), (b'{"model": {"type": "BPE"}}', "Missing vocab/merges"),
     (b"[]", "expected struct Tokenizer"), (b"\xff\xfe", "utf-8")],
    ids=["not-json", "no-vocabulary", "not-an-object", "not-utf-8"],
)
def test_a_tokenizer_json_the_tokenizers_library_cannot_read_is_refused_naming_it(
    tmp_path: Path, package_parts: dict[str, Any], make_hf_directory: Any, content: bytes, why: str
) -> None:
    directory = make_hf_directory(tmp_path / "model", package_parts)
    (directory / "tokenizer.json").write_bytes(content)
    with pytest.raises(SourceError, match=rf"tokenizer.json is not a tokenizer the tokenizers library reads: .*{why}"):
        open_hf_directory(directory)


# Blocks of 16: the tiny widths (24, 40, 48, 112, ...) have several, partial ones at their edges.
FP8_BLOCK = (16, 16)


@pytest.fixture(scope="module")
def fp8_llama(
    tmp_path_factory: pytest.TempPathFactory, package_parts: dict[str, Any], make_hf_directory: Any
) -> tuple[Path, Path]:
    """The tiny Llama directory with its weights as DeepSeek-V3's are released, and its copy in
    the float32 values they stand for (`write_as_fp8`)."""
    directory = make_hf_directory(tmp_path_factory.mktemp("fp8") / "model", package_parts)
    return directory, write_as_fp8(directory, FP8_BLOCK)


def test_fp8_weights_are_read_as_the_values_they_stand_for_wherever_their_scales_are_stored(
    fp8_llama: tuple[Path, Path], tmp_path: Path
) -> None:
    """Every projection dequantized with its scale, which a shard of its own holds here; the
    scales are no tensors of the model."""
    fp8, dequantized = fp8_llama
    directory = tmp_path / "model"
    shutil.copytree(fp8, directory)
    shard = next(directory.glob("*.safetensors"))
    tensors = load_file(str(shard))
    scales = {name: tensors.pop(name) for name in list(tensors) if name.endswith("_scale_inv")}
    assert len(scales) == 14 and tensors["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    save_file(tensors, str(shard))
    save_file(scales, str(directory / "scales.safetensors"))
    weights = open_hf_directory(directory).read_weights(lambda done, total: None)
    expected = open_hf_directory(dequantized).read_weights(lambda done, total: None)
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert weights[name].dtype == torch.float32 and torch.equal(weights[name], tensor), name


def test_an_fp8_deepseek_v3_exports_to_transformers_logits_on_its_dequantized_weights(
    smollm2_source: ModelSource, tmp_path: Path
) -> None:
    """Latent attention, dense and MoE layers (routed and shared experts) in FP8 blocks; the
    router, norms, embedding and LM head in floats."""
    import transformers

    checkpoint = write_checkpoint("deepseek_v3_moe", tmp_path / "hf", smollm2_source.tokenizer_json, smollm2_source.chat_template)
    dequantized = write_as_fp8(checkpoint.path, FP8_BLOCK)
    with safe_open(str(checkpoint.path / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("model.layers.1.mlp.experts.7.up_proj.weight").get_dtype() == "F8_E4M3"
        assert f.get_slice("model.layers.1.mlp.gate.weight").get_dtype() == "F32"
        assert f.get_slice("model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv").get_shape() == [3, 4]  # 40 rows
    export_package(str(checkpoint.path), tmp_path / "package", ExportOptions(dtype="float32"), stderr=io.StringIO())
    package = open_package(tmp_path / "package")
    # The manifest records which tensors came from FP8 (`flare inspect` counts them), under the
    # package's names: the experts stacked, the router and norms not among them.
    record = package.manifest.dequantized
    assert set(record.values()) == {"F8_E4M3"}
    assert {"model.layers.1.mlp.experts.gate_up_proj.weight", "model.layers.1.mlp.experts.down_proj.weight",
            "model.layers.0.self_attn.o_proj.weight"} <= record.keys()
    assert not any(name.endswith(("norm.weight", "mlp.gate.weight", "embed_tokens.weight")) for name in record)
    text = render_text(inspect_package(tmp_path / "package"), tmp_path / "package")
    assert f"dequantized         {len(record)} F8_E4M3 tensors at export (no kernel for the type; flare export --quantize" in text
    model = transformers.AutoModelForCausalLM.from_pretrained(dequantized, attn_implementation="eager", dtype=torch.float32)
    reference = Checkpoint(checkpoint.family, dequantized, model.eval())
    prompts = [Tokenizer.from_package(package).encode(text) for text in PROMPTS]
    got = forward_in_pieces(load_model(package), prompts, [[len(p) for p in prompts]])
    for prompt, logits in zip(prompts, got):
        difference = (logits - reference_logits(reference, prompt)).abs().max().item()
        assert difference <= LOGIT_TOLERANCE, f"max |logit difference| {difference:.2e}"


def test_an_fp8_mtp_layer_is_read_as_its_dequantized_values(smollm2_source: ModelSource, tmp_path: Path) -> None:
    """DeepSeek-V3's MTP layer (its eh_proj, latent attention and experts in FP8 blocks) becomes
    the draft head the same checkpoint in floats gives."""
    checkpoint = write_mtp_checkpoint(tmp_path / "hf", smollm2_source.tokenizer_json, smollm2_source.chat_template)
    dequantized = write_as_fp8(checkpoint.path, FP8_BLOCK)
    p = f"model.layers.{checkpoint.layer_index}."
    with safe_open(str(checkpoint.path / "model.safetensors"), framework="pt") as f:
        for name in ("eh_proj.weight", "self_attn.q_b_proj.weight", "mlp.experts.0.down_proj.weight"):
            assert f.get_slice(p + name).get_dtype() == "F8_E4M3", name
    head = open_hf_directory(checkpoint.path).read_draft_head
    expected = open_hf_directory(dequantized).read_draft_head
    assert head is not None and expected is not None
    tensors, expected_tensors = head().tensors, expected().tensors
    assert tensors.keys() == expected_tensors.keys()
    for name, tensor in expected_tensors.items():
        assert torch.equal(tensors[name], tensor), name


def _fp8_refusal(directory: Path) -> str:
    """The sentence that introduces the FP8 tensors of `directory` that flare refuses."""
    return f"the fp8 weights in {directory} cannot be dequantized"


@pytest.mark.parametrize(
    ("quantization", "tensors", "message"),
    [
        (
            {"quant_method": "gptq", "bits": 4}, {},
            "config.json: quantization_config's quant_method 'gptq' is not one flare reads; it reads 'fp8' (FP8 weights "
            "with block scales, as DeepSeek-V3 ships them) and gpt-oss's 'mxfp4': export the model's float (bf16 or "
            "float32) weights instead",
        ),
        ({"fmt": "e5m2"}, {}, "config.json: quantization_config's fmt 'e5m2' is not one flare reads; it reads fp8 weights in e4m3"),
        *[
            (
                {"weight_block_size": block}, {},
                f"config.json: quantization_config's weight_block_size must be two positive integers (DeepSeek-V3's "
                f"[128, 128]), got {block!r}; flare reads fp8 weights with block scales only",
            )
            for block in (None, [128], [16, 0], [16.0, 16])
        ],
        (
            {}, {"model.layers.1.mlp.down_proj.weight_scale_inv": None},
            "model.layers.1.mlp.down_proj.weight is stored as F8_E4M3 but has no "
            "model.layers.1.mlp.down_proj.weight_scale_inv beside it",
        ),
        (
            {}, {"model.layers.0.self_attn.k_proj.weight_scale_inv": torch.ones(4, 4)},
            "model.layers.0.self_attn.k_proj.weight_scale_inv has shape [4, 4], expected [2, 4]: one scale per 16x16 "
            "block (weight_block_size) of model.layers.0.self_attn.k_proj.weight [32, 64]",
        ),
        (
            {}, {"model.layers.0.mlp.up_proj.weight": torch.zeros(128, 64, dtype=torch.float8_e5m2)},
            "model.layers.0.mlp.up_proj.weight is stored as F8_E5M2; flare reads fp8 weights in e4m3 (F8_E4M3)",
        ),
        (
            {}, {"model.norm.weight": torch.ones(64, dtype=torch.float8_e4m3fn)},
            "model.norm.weight is stored as F8_E4M3 with shape [64]; flare reads fp8 weights [out, in]",
        ),
    ],
    ids=["quant-method", "fmt", "no-block-size", "one-block-size", "zero-block-size", "float-block-size",
         "scale-missing", "scale-shape", "e5m2-tensor", "fp8-vector"],
)
def test_fp8_checkpoints_flare_cannot_dequantize_are_refused_naming_why(
    fp8_llama: tuple[Path, Path], tmp_path: Path, quantization: dict[str, Any], tensors: dict[str, torch.Tensor | None],
    message: str,
) -> None:
    directory = tmp_path / "model"
    shutil.copytree(fp8_llama[0], directory)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"].update(quantization)
    (directory / "config.json").write_text(json.dumps(config))
    shard = next(directory.glob("*.safetensors"))
    stored = load_file(str(shard))
    for name, tensor in tensors.items():
        if tensor is None:
            del stored[name]
        else:
            stored[name] = tensor
    save_file(stored, str(shard))
    with pytest.raises(SourceError) as refusal:
        open_hf_directory(directory)
    assert str(refusal.value) == (message if message.startswith("config.json") else f"{_fp8_refusal(directory)}: {message}")


def test_fp8_weights_without_an_fp8_quantization_config_are_refused_by_name(fp8_llama: tuple[Path, Path], tmp_path: Path) -> None:
    directory = tmp_path / "model"
    shutil.copytree(fp8_llama[0], directory)
    config = json.loads((directory / "config.json").read_text())
    del config["quantization_config"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(SourceError) as refusal:
        open_hf_directory(directory)
    message = str(refusal.value)
    assert message.startswith(f"{_fp8_refusal(directory)}:\n")
    unscaled = "model.layers.0.mlp.down_proj.weight is stored as F8_E4M3, but config.json declares no fp8 quantization_config"
    assert f"  - {unscaled}\n" in message
