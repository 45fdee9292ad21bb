"""Every family's required tensors, from its definition (issue 40, item 8): a source without one
of them (a Qwen3 without its q/k norms, a Qwen2 without its biases, a Gemma without a sandwich
norm, any family without a core tensor) is refused naming the tensor, GGUF and Hugging Face
alike, as llama.cpp refuses such a file; never exported as a different computation. A tensor the
family has not is refused too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tests import family_checkpoints as families
from tests.gguf_writer import tiny_vocabulary, write_family_gguf

from flare.package.model_config import ARCHITECTURES
from flare.package.family_tensors import FAMILY_TENSORS
from flare.preparation.gguf_source import open_gguf
from flare.preparation.hf_source import open_hf_directory
from flare.preparation.source import SourceError

# (family, the tensors taken out of every layer: as the package, a GGUF and a checkpoint name each)
Q_NORM = ("self_attn.q_norm.weight", "attn_q_norm.weight", "self_attn.q_norm.weight")
K_NORM = ("self_attn.k_norm.weight", "attn_k_norm.weight", "self_attn.k_norm.weight")
BIASES = tuple((f"self_attn.{p}_proj.bias", f"attn_{p}.bias", f"self_attn.{p}_proj.bias") for p in "qkv")
MLP_OUTPUT_NORM = ("mlp_output_norm.weight", "post_ffw_norm.weight", "post_feedforward_layernorm.weight")
ATTENTION_OUTPUT_NORM = ("attention_output_norm.weight", "post_attention_norm.weight", "post_attention_layernorm.weight")
REMOVED = {
    "llama-gate": ("llama", (("mlp.gate_proj.weight", "ffn_gate.weight", "mlp.gate_proj.weight"),)),
    "mistral-attention-norm": ("mistral", (("input_layernorm.weight", "attn_norm.weight", "input_layernorm.weight"),)),
    "qwen2-biases": ("qwen2", BIASES),
    "qwen2-v-bias": ("qwen2", BIASES[2:]),
    "qwen3-qk-norms": ("qwen3", (Q_NORM, K_NORM)),
    "qwen3-q-norm": ("qwen3", (Q_NORM,)),
    "gemma2-sandwich-norms": ("gemma2", (ATTENTION_OUTPUT_NORM, MLP_OUTPUT_NORM)),
    "gemma3-qk-norms": ("gemma3", (Q_NORM, K_NORM)),
    "gemma3-mlp-output-norm": ("gemma3", (MLP_OUTPUT_NORM,)),
    "phi3-qkv": ("phi3", (("self_attn.q_proj.weight", "attn_qkv.weight", "self_attn.qkv_proj.weight"),)),
    "phi3-down": ("phi3", (("mlp.down_proj.weight", "ffn_down.weight", "mlp.down_proj.weight"),)),
}


def checkpoint(family: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """The family's tiny checkpoint (tests/family_checkpoints.py) with the tiny vocabulary."""
    from transformers import AutoModelForCausalLM

    config = families.family_config(family)
    config.vocab_size = len(tiny_vocabulary()[0])
    torch.manual_seed(0)
    return config, AutoModelForCausalLM.from_config(config).state_dict()


def named(package: str, source: str) -> str:
    """How a refusal names a tensor: the package's name, and the source's where it differs."""
    return package if package == source else f"{package} ({source})"


def test_every_family_has_a_definition_of_its_tensors() -> None:
    assert set(FAMILY_TENSORS) == set(ARCHITECTURES)


@pytest.mark.parametrize("case", list(REMOVED))
def test_a_gguf_without_a_required_tensor_is_refused_naming_it(case: str, tmp_path: Path) -> None:
    family, removed = REMOVED[case]
    config, state = checkpoint(family)
    layers = range(config.num_hidden_layers)
    source = tmp_path / f"{family}.gguf"
    write_family_gguf(source, config, state, tensors={f"blk.{i}.{gguf}": None for i in layers for _, gguf, _ in removed})
    with pytest.raises(SourceError) as refusal:
        open_gguf(source)
    for i in layers:
        for package, gguf, _ in removed:
            assert f"weight {named(f'model.layers.{i}.{package}', f'blk.{i}.{gguf}')} is missing" in str(refusal.value)


@pytest.mark.parametrize("case", list(REMOVED))
def test_a_hugging_face_checkpoint_without_a_required_tensor_is_refused_naming_it(case: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    family, removed = REMOVED[case]
    config, _ = checkpoint(family)
    directory = tmp_path / family
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    weights = load_file(str(directory / "model.safetensors"))
    kept = {name: tensor for name, tensor in weights.items() if not name.endswith(tuple(f".{hf}" for _, _, hf in removed))}
    assert len(kept) == len(weights) - config.num_hidden_layers * len({hf for _, _, hf in removed})
    save_file(kept, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(SourceError) as refusal:
        open_hf_directory(directory)
    for i in range(config.num_hidden_layers):
        for package, _, hf in removed:
            expected = named(f"model.layers.{i}.{package}", f"model.layers.{i}.{hf}")
            assert f"weight {expected} is missing" in str(refusal.value)


@pytest.mark.parametrize(
    ("family", "gguf_name", "package"),
    [
        ("llama", "attn_q_norm.weight", "self_attn.q_norm.weight"),
        ("qwen3", "attn_q.bias", "self_attn.q_proj.bias"),
        ("phi3", "post_ffw_norm.weight", "mlp_output_norm.weight"),
    ],
)
def test_a_gguf_holding_a_tensor_its_family_has_not_is_refused_naming_it(
    family: str, gguf_name: str, package: str, tmp_path: Path
) -> None:
    config, state = checkpoint(family)
    source = tmp_path / f"{family}.gguf"
    added = {f"blk.{i}.{gguf_name}": np.ones(config.hidden_size, dtype=np.float32) for i in range(config.num_hidden_layers)}
    write_family_gguf(source, config, state, tensors=added)
    with pytest.raises(SourceError, match=rf"model.layers.0.{package} \(blk.0.{gguf_name}\) is not part of a {family} model"):
        open_gguf(source)
