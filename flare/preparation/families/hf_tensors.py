"""Each family's Hugging Face tensors under the package's names and in its layout (the contract
of `package.expected_weight_shapes`), read after its `ModelConfig` (hf_config.py).

Gemma's four norms of a layer are renamed to Llama's two plus the sandwich norms, and every
Gemma norm's weight w becomes 1 + w (its RMSNorm multiplies by 1 + w, in float32); Phi-3's fused
`qkv_proj` and `gate_up_proj` are split into q/k/v and gate/up; a multimodal Gemma 3's text model
is read under the plain prefixes and its vision tower left out. Mixture-of-experts tensors are
renamed by moe.py (`moe_tensor_name`; `stack_experts` stacks the experts after the per-tensor
conversion), gpt-oss's experts laid out by gpt_oss.py, DeepSeek's interleaved rope rows
reordered by deepseek.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from flare.package.model_config import ModelConfig
from flare.preparation.families.deepseek import deinterleave_rope_rows
from flare.preparation.families.gpt_oss import gpt_oss_tensor
from flare.preparation.families.hf_config import GEMMA_ARCHITECTURES
from flare.preparation.families.moe import moe_tensor_name

# Gemma's names of a layer's four norms -> the package's (`expected_weight_shapes`).
_GEMMA_NORMS = {
    "post_attention_layernorm": "attention_output_norm",
    "pre_feedforward_layernorm": "post_attention_layernorm",
    "post_feedforward_layernorm": "mlp_output_norm",
}
# A multimodal Gemma 3's text model, under either transformers' old or new prefix; its vision
# tower and projector are not part of a text package.
_LANGUAGE_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.", "language_model.lm_head.": "lm_head."}
# A decoder layer's tensor, under the plain prefix or a multimodal Gemma 3's (the group: its index).
HF_LAYER_TENSOR = re.compile(r"(?:model\.|model\.language_model\.|language_model\.model\.)layers\.(\d+)\.")
_VISION_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.")

_SOURCE_GEMMA_NORMS = {package: source for source, package in _GEMMA_NORMS.items()}
# Phi-3's checkpoints hold these package tensors fused (`tensor_converter` splits them).
_PHI3_FUSED = {
    "q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
}


def hf_tensor_name(name: str, architecture: str) -> str:
    """The checkpoint's tensor that gives the package tensor `name` of an `architecture` model
    (Gemma's norms under their own names, Phi-3's fused tensors), for messages."""
    parts = name.split(".")
    if len(parts) == 5 and parts[0:2] == ["model", "layers"]:
        if architecture in GEMMA_ARCHITECTURES and parts[3] in _SOURCE_GEMMA_NORMS:
            parts[3] = _SOURCE_GEMMA_NORMS[parts[3]]
    elif len(parts) == 6 and parts[0:2] == ["model", "layers"] and architecture == "phi3" and parts[4] in _PHI3_FUSED:
        parts[4] = _PHI3_FUSED[parts[4]]
    return ".".join(parts)


def tensor_converter(
    config: ModelConfig, *, interleaved_rope: bool = False
) -> Callable[[str, torch.Tensor], dict[str, torch.Tensor]]:
    """What one source tensor becomes in the package (module docstring): `convert(name, tensor)`
    gives the package's tensors, none for a multimodal checkpoint's vision parts. Works on meta
    tensors too, which is how the shapes are checked before any weight is read. A fused tensor
    of the wrong size is kept whole, for the shape check to name. `interleaved_rope`: a latent
    attention checkpoint's rope rows are reordered to rotate-half's (`deinterleave_rope_rows`)."""
    gemma = config.architecture in GEMMA_ARCHITECTURES
    fused = config.architecture == "phi3"
    moe = config.num_experts > 0
    oss = config.architecture == "gpt_oss"
    q_rows = config.num_heads * config.head_dim
    kv_rows = config.num_kv_heads * config.head_dim

    def convert(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if name.startswith(_VISION_PREFIXES):
            return {}
        for prefix, replacement in _LANGUAGE_PREFIXES.items():
            if name.startswith(prefix):
                name = replacement + name[len(prefix) :]
        if gemma:
            parts = name.split(".")
            if len(parts) == 5 and parts[3] in _GEMMA_NORMS:
                name = ".".join([*parts[:3], _GEMMA_NORMS[parts[3]], parts[4]])
            if name.endswith("norm.weight"):
                return {name: tensor.to(torch.float32) + 1.0}
        if oss:
            converted = gpt_oss_tensor(name, tensor)
            if converted is not None:
                return converted
        latent = config.latent_attention
        if latent is not None and interleaved_rope:
            n, r = latent.qk_nope_head_dim, latent.qk_rope_head_dim
            if name.endswith((".self_attn.q_proj.weight", ".self_attn.q_b_proj.weight")) and tensor.shape[0] == config.num_heads * (n + r):
                return {name: deinterleave_rope_rows(tensor, n, r, n + r)}
            if name.endswith(".self_attn.kv_a_proj_with_mqa.weight") and tensor.shape[0] == latent.kv_lora_rank + r:
                return {name: deinterleave_rope_rows(tensor, latent.kv_lora_rank, r, latent.kv_lora_rank + r)}
        if moe:
            name = moe_tensor_name(name)
            if name.endswith(".mlp.experts.gate_up_proj") or name.endswith(".mlp.experts.down_proj"):
                return {f"{name}.weight": tensor}  # transformers 5's fused layout: already the package's
        if fused and name.endswith(".self_attn.qkv_proj.weight") and tensor.shape[0] == q_rows + 2 * kv_rows:
            prefix = name.removesuffix("qkv_proj.weight")
            q, k, v = tensor.split([q_rows, kv_rows, kv_rows])
            return {f"{prefix}q_proj.weight": q, f"{prefix}k_proj.weight": k, f"{prefix}v_proj.weight": v}
        if fused and name.endswith(".mlp.gate_up_proj.weight") and tensor.shape[0] == 2 * config.intermediate_size:
            prefix = name.removesuffix("gate_up_proj.weight")
            gate, up = tensor.chunk(2)
            return {f"{prefix}gate_proj.weight": gate, f"{prefix}up_proj.weight": up}
        return {name: tensor}

    return convert
