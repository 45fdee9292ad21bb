"""A Hugging Face model directory as a source."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from flare.preparation.hf_source import open_hf_directory
from flare.package.model_config import ModelConfig
from flare.preparation.source import SourceError


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
