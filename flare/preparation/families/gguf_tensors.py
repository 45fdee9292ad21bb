"""What a GGUF file's tensor names mean for each model family flare serves: a plan mapping each
GGUF tensor onto the package's canonical names (Hugging Face Llama's,
`package.expected_weight_shapes`), read after its `ModelConfig` (gguf_config.py):

- Rows of q and k are permuted by the converter for arch `llama` only (LlamaModel.permute: its
  RoPE pairs adjacent dimensions); the NEOX-RoPE families (qwen2, qwen3, gemma2, gemma3, phi3)
  are written in Hugging Face order. Mistral's Hugging Face checkpoints are written as `llama`.
- Phi-3's fused `attn_qkv` (q, then k, then v rows) and `ffn_up` of 2 x feed_forward_length
  rows (gate, then up: Phi3MLP's `chunk(2)`) are split into Llama's tensors.
- Gemma's norms already hold `1 + w` (the converter adds 1 to every `*norm.weight`).
- The RoPE tensors (`ROPE_TENSORS`) are not weights; a bundled vision or audio encoder is not
  part of a text package.
- Mixture-of-experts: a layer with `ffn_gate_inp` (the router) is a MoE layer; its experts are
  3-D tensors, one block set per expert, `ffn_{gate,up,down}_exps` [E, out, in] (or the
  converter's optional fused `ffn_gate_up_exps`), the shared expert `ffn_{gate,up,down}_shexp`
  and its gate `ffn_gate_inp_shexp` (Qwen2-MoE). Gate and up are fused per expert into the
  package's `mlp.experts.gate_up_proj` (moe.py's `fused_expert_names`).
- DeepSeek's latent attention (`attn_q_a` ... `attn_kv_b`, or the split `attn_k_b` /
  `attn_v_b`) and gpt-oss's own names (`GPT_OSS_GGUF_NAMES`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from flare.package.model_config import ModelConfig
from flare.preparation.families.deepseek import LATENT_UP_PROJECTIONS
from flare.preparation.families.gguf_config import GGUF_LAYER_TENSOR, PERMUTED_ARCHITECTURES
from flare.preparation.families.gpt_oss import GPT_OSS_GGUF_NAMES
from flare.preparation.families.moe import GGUF_MOE_NORMALIZED
from flare.preparation.source import SourceError

ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# A multimodal model's vision or audio encoder and projector, bundled in one file by some tools
# (llama.cpp's converter writes them to a separate mmproj file): not part of a text package.
_ENCODER_PREFIXES = ("v.", "mm.", "a.")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# blk.{i}.<name> -> model.layers.{i}.<name>; the suffix (weight or bias) is kept.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_output": "self_attn.o_proj",
    "post_attention_norm": "attention_output_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "mlp_output_norm",
    # DeepSeek's multi-head latent attention (attn_k_b / attn_v_b: `LATENT_UP_PROJECTIONS`).
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    # Mixture-of-experts layers (`gguf_moe_fields`); gate and up of the experts fused afterwards.
    "ffn_gate_inp": "mlp.router",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_up_exps": "mlp.experts.gate_up_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_EXPERT_TENSOR = re.compile(r"blk\.\d+\.(ffn_gate_inp|\w+_exps?|\w+_shexp)\.")


@dataclass(frozen=True)
class TensorPart:
    """Rows [start, stop) of a GGUF tensor that form the package tensor `name`."""

    name: str
    start: int
    stop: int


@dataclass(frozen=True)
class TensorPlan:
    """How one GGUF tensor becomes package tensors: its row ranges, and whether its rows are in
    llama.cpp's permuted RoPE order (`heads`: the head count to unpermute by)."""

    parts: tuple[TensorPart, ...]
    heads: int | None = None
    # Latent attention (deepseek2): the rope rows of every `stride` rows from `start`, `rope` of
    # them, are in interleaved-pair order, reordered to rotate-half's at export
    # (deepseek.py's `deinterleaved_row_order`); which of attn_k_b / attn_v_b the tensor is.
    rope_rows: tuple[int, int, int] | None = None
    latent_part: str | None = None


def tensor_plans(path: Path, config: ModelConfig, shapes: Mapping[str, tuple[int, ...]], gguf_arch: str) -> dict[str, TensorPlan]:
    """The plan of every GGUF tensor but the RoPE ones and a bundled encoder's; SourceError naming
    a tensor the family has not."""
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    permuted = gguf_arch in PERMUTED_ARCHITECTURES
    plans: dict[str, TensorPlan] = {}
    for gguf_name, shape in shapes.items():
        if gguf_name in ROPE_TENSORS or gguf_name.startswith(_ENCODER_PREFIXES):
            continue
        rows = shape[0]
        if gguf_name in _GLOBAL_NAMES:
            plans[gguf_name] = TensorPlan((TensorPart(_GLOBAL_NAMES[gguf_name], 0, rows),))
            continue
        match = GGUF_LAYER_TENSOR.fullmatch(gguf_name)
        if gguf_arch == "gpt-oss" and match is not None and match.group(2) in GPT_OSS_GGUF_NAMES:
            plans[gguf_name] = TensorPlan((TensorPart(f"model.layers.{match.group(1)}.{GPT_OSS_GGUF_NAMES[match.group(2)]}", 0, rows),))
            continue
        if match is None or match.group(2) not in {*_LAYER_NAMES, "attn_qkv", "exp_probs_b", *LATENT_UP_PROJECTIONS}:
            raise SourceError(f"{path} holds the tensor {gguf_name}, which a {config.architecture} model does not have{_why(gguf_name)}")
        layer, kind, suffix = match.groups()
        prefix = f"model.layers.{layer}."
        if kind == "attn_qkv":
            names = [f"{prefix}self_attn.{p}_proj.{suffix}" for p in "qkv"]
            bounds = (0, q, q + kv, q + 2 * kv)
            if rows != bounds[-1]:
                raise SourceError(
                    f"{path}: the fused tensor {gguf_name} has {rows} rows, expected q + k + v = {bounds[-1]}"
                )
            plans[gguf_name] = TensorPlan(tuple(TensorPart(n, bounds[i], bounds[i + 1]) for i, n in enumerate(names)))
            continue
        if kind == "ffn_up" and f"blk.{layer}.ffn_gate.weight" not in shapes and rows == 2 * config.intermediate_size:
            # Phi-3's gate_up_proj: gate rows first, then up (Phi3MLP: gate, up = chunk(2)).
            ff = config.intermediate_size
            plans[gguf_name] = TensorPlan(
                (TensorPart(f"{prefix}mlp.gate_proj.{suffix}", 0, ff), TensorPart(f"{prefix}mlp.up_proj.{suffix}", ff, 2 * ff))
            )
            continue
        if kind == "exp_probs_b":  # DeepSeek-V3's correction bias (e_score_correction.bias)
            plans[gguf_name] = TensorPlan((TensorPart(f"{prefix}mlp.router.score_correction_bias", 0, rows),))
            continue
        latent = config.latent_attention
        if latent is not None and kind in LATENT_UP_PROJECTIONS:
            joined = config.num_heads * (latent.qk_nope_head_dim + latent.v_head_dim)
            plans[gguf_name] = TensorPlan((TensorPart(f"{prefix}self_attn.kv_b_proj.{suffix}", 0, joined),), latent_part=kind)
            continue
        rope_rows = None
        if latent is not None and kind in ("attn_q", "attn_q_b"):
            # llama.cpp's deepseek2 RoPE pairs adjacent dimensions, as the checkpoint's does.
            rope_rows = (latent.qk_nope_head_dim, latent.qk_rope_head_dim, latent.qk_head_dim)
        elif latent is not None and kind == "attn_kv_a_mqa":
            rope_rows = (latent.kv_lora_rank, latent.qk_rope_head_dim, latent.kv_lora_rank + latent.qk_rope_head_dim)
        heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}.get(kind) if permuted else None
        plans[gguf_name] = TensorPlan((TensorPart(f"{prefix}{_LAYER_NAMES[kind]}.{suffix}", 0, rows),), heads, rope_rows)
    sources: dict[str, str] = {}
    for gguf_name, plan in plans.items():
        for part in plan.parts:
            if plan.latent_part == "attn_v_b":
                continue  # joined with its attn_k_b into one kv_b_proj
            if part.name in sources:
                raise SourceError(
                    f"{path}: the tensors {sources[part.name]} and {gguf_name} both give {part.name} "
                    "(a fused tensor beside its parts?)"
                )
            sources[part.name] = gguf_name
    return plans


_PACKAGE_GLOBAL_NAMES = {package: gguf_name for gguf_name, package in _GLOBAL_NAMES.items()}
_PACKAGE_LAYER_NAMES = {package: gguf_name for gguf_name, package in _LAYER_NAMES.items()}
_PACKAGE_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")

# Phi-3's converter writes these package tensors fused (`tensor_plans` splits them).
_PHI3_FUSED = {
    "self_attn.q_proj": "attn_qkv", "self_attn.k_proj": "attn_qkv", "self_attn.v_proj": "attn_qkv",
    "mlp.gate_proj": "ffn_up", "mlp.up_proj": "ffn_up",
}


def gguf_tensor_name(name: str, architecture: str) -> str:
    """The GGUF tensor llama.cpp's converter writes the package tensor `name` of an
    `architecture` model in, for messages."""
    if name in _PACKAGE_GLOBAL_NAMES:
        return _PACKAGE_GLOBAL_NAMES[name]
    if architecture == "gpt_oss":
        for gguf_kind, package in GPT_OSS_GGUF_NAMES.items():
            layer = re.fullmatch(rf"model\.layers\.(\d+)\.{re.escape(package)}", name)
            if layer:
                return f"blk.{layer.group(1)}.{gguf_kind}.weight"
    match = _PACKAGE_LAYER_TENSOR.fullmatch(name)
    if match is None or match.group(2) not in _PACKAGE_LAYER_NAMES:
        return name
    layer, kind, suffix = match.groups()
    fused = _PHI3_FUSED.get(kind) if architecture == "phi3" else None
    return f"blk.{layer}.{fused or _PACKAGE_LAYER_NAMES[kind]}.{suffix}"


def _why(gguf_name: str) -> str:
    if _EXPERT_TENSOR.match(gguf_name):
        return f" (a mixture-of-experts tensor: flare serves experts in {', '.join(GGUF_MOE_NORMALIZED)} files with expert_count)"
    return ""
