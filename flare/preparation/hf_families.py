"""The families of Hugging Face checkpoints flare serves: `config.json` to `ModelConfig`, and each
family's tensors to the package's names and layout.

`model_type` -> architecture: llama, mistral, qwen2, qwen3, gemma2, gemma3_text (and gemma3,
whose text model sits under `text_config` and `language_model`), phi3, and the mixture-of-experts
qwen2_moe, qwen3_moe and mixtral. Both config layouts are
read: transformers 5's `rope_parameters` (for Gemma 3 one per layer type) and `layer_types`,
and the older `rope_theta` / `rope_scaling` / `partial_rotary_factor` / `rope_local_base_freq`
keys with each family's own rule for which layers slide. docs/packages.md tabulates the keys.

Tensors (the contract of `package.expected_weight_shapes`): Gemma's four norms of a layer are
renamed to Llama's two plus the sandwich norms, and every Gemma norm's weight w becomes 1 + w
(its RMSNorm multiplies by 1 + w, in float32); Phi-3's fused `qkv_proj` and `gate_up_proj` are
split into q/k/v and gate/up.

Mixture-of-experts layers (`package.moe_weight_shapes`): the router (`mlp.gate`, Mixtral's
`block_sparse_moe.gate`) becomes `mlp.router`; the experts, saved one by one
(`experts.N.{gate,up,down}_proj`, Mixtral's `experts.N.w1/w3/w2`) or fused as transformers 5
keeps them in memory (`experts.gate_up_proj` [E, 2 I, hidden], `experts.down_proj` [E, hidden,
I]), become the stacked `mlp.experts.gate_up_proj.weight` and `mlp.experts.down_proj.weight`
(`stack_experts`, after the per-tensor conversion).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flare.package.blocks import BlockTensor, GGMLType, mxfp4_from_openai
from flare.package.family_tensors import FAMILY_TENSORS
from flare.package.manifest import MAX_CONTEXT, MAX_CONTEXT_REASON
from flare.package.model_config import ARCHITECTURES, LatentAttention, ManifestError, ModelConfig, RopeScaling
from flare.preparation.source import SourceError

# model_type -> ModelConfig.architecture
MODEL_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
    "phi3": "phi3",
    "deepseek_v2": "deepseek2",
    "deepseek_v3": "deepseek2",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
    "gpt_oss": "gpt_oss",
}
_QWEN = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
_GEMMA = ("gemma2", "gemma3")
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
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


def served_list() -> str:
    return ", ".join(MODEL_TYPES)


def text_config(data: dict[str, Any]) -> dict[str, Any]:
    """The config of the decoder: a multimodal Gemma 3's `text_config`, otherwise `data` itself."""
    if data.get("model_type") == "gemma3":
        text = data.get("text_config")
        if not isinstance(text, dict):
            raise SourceError("config.json: a 'gemma3' model needs a text_config object")
        return {**text, "model_type": "gemma3_text", "eos_token_id": text.get("eos_token_id", data.get("eos_token_id"))}
    return data


def served_model_type(data: dict[str, Any]) -> str:
    """The config's `model_type`; SourceError for one flare does not serve."""
    model_type = data.get("model_type")
    if model_type not in MODEL_TYPES:
        raise SourceError(f"config.json describes a {model_type!r} model; flare serves model types {served_list()}")
    return model_type


def model_config_from_hf(
    data: dict[str, Any], generation: dict[str, Any] | None, *, layers_held: int | None = None
) -> ModelConfig:
    """ModelConfig from a Hugging Face config.json; SourceError for anything flare cannot run.
    `layers_held`: how many layers the checkpoint's tensors hold (`layers_held`), which the
    layer count it claims must not exceed (None: the config alone is read)."""
    model_type = served_model_type(data)
    data = text_config(data)
    architecture = MODEL_TYPES[model_type]
    assert architecture in ARCHITECTURES
    gemma = architecture in _GEMMA
    family = FAMILY_TENSORS[architecture]
    unsupported = []
    # Llama, Mistral and Qwen3 put attention_bias on o_proj too, which only gpt-oss's decoder has.
    if architecture not in ("qwen2", "qwen2_moe", "gpt_oss") and data.get("attention_bias"):
        unsupported.append("bias terms on the attention projections (o_proj included)")
    if data.get("mlp_bias"):
        unsupported.append("bias terms in the MLP")
    activation = data.get("hidden_activation") or data.get("hidden_act") or "silu"
    gpt_oss = architecture == "gpt_oss"
    if gpt_oss and float(data.get("swiglu_alpha", 1.702)) != 1.702:
        unsupported.append(f"swiglu_alpha {data.get('swiglu_alpha')!r} (the kernels' is 1.702)")
    if activation not in _ACTIVATIONS:
        unsupported.append(f"activation {activation!r}")
    try:
        heads = int(data["num_attention_heads"])
        hidden = int(data["hidden_size"])
        head_dim = int(data.get("head_dim") or hidden // heads)
        layers = int(data["num_hidden_layers"])
        max_positions = int(data["max_position_embeddings"])
    except KeyError as error:
        raise SourceError(f"config.json lacks {error.args[0]!r}") from None
    # Before anything is built per layer: a claim of millions costs nothing.
    if layers_held is not None and layers > layers_held:
        raise SourceError(
            f"config.json claims {layers} layers (num_hidden_layers) but the weights hold tensors for {layers_held}"
        )
    if max_positions > MAX_CONTEXT:
        raise SourceError(
            f"config.json: max_position_embeddings {max_positions} is beyond the longest context flare serves, "
            f"{MAX_CONTEXT} tokens ({MAX_CONTEXT_REASON})"
        )
    latent = _latent_attention(data, layers, unsupported) if architecture == "deepseek2" else None
    if latent is not None:
        # MLA's heads: queries and keys of nope + rope, RoPE on the rope part only (the
        # checkpoint's head_dim, where written, is transformers' name for qk_rope_head_dim).
        head_dim = latent.qk_head_dim
    rope = _rope(data, architecture, latent.qk_rope_head_dim if latent else head_dim, max_positions, unsupported)
    window, sliding = _sliding_layers(data, architecture, layers, unsupported)
    moe = _moe_fields(data, architecture, layers, unsupported)
    if unsupported:
        raise SourceError(f"config.json asks for {', '.join(unsupported)}, which flare's decoder does not implement")
    eos: list[int] = []
    for source in (data, generation or {}):
        value = source.get("eos_token_id")
        for token in value if isinstance(value, list) else [] if value is None else [value]:
            if token not in eos:
                eos.append(int(token))
    scalar = data.get("query_pre_attn_scalar")
    attention_scale = float(scalar) ** -0.5 if gemma and scalar else None
    if latent is not None:
        attention_scale = _latent_softmax_scale(data, latent)
    try:
        return ModelConfig(
            vocab_size=int(data["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(data["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=heads if latent is not None else int(data.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rope_theta=rope.theta,
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(data.get("tie_word_embeddings", gemma)),
            bos_token_id=data.get("bos_token_id"),
            eos_token_ids=tuple(eos),
            architecture=architecture,
            # A Llama's own attention_bias was refused above (it puts one on o_proj too).
            # A Qwen2-MoE's are its `qkv_bias` (transformers' default: on).
            attention_bias=_attention_bias(data, family.attention_bias, architecture),
            qk_norm=family.qk_norm,
            rotary_dim=latent.qk_rope_head_dim if latent is not None else rope.rotary_dim,
            rope_scaling=rope.scaling,
            sliding_window=window,
            sliding_layers=sliding,
            local_rope_theta=rope.local_theta,
            attention_scale=attention_scale,
            attention_softcap=_positive_or_none(data.get("attn_logit_softcapping")) if gemma else None,
            final_logit_softcap=_positive_or_none(data.get("final_logit_softcapping")) if gemma else None,
            sandwich_norms=family.sandwich_norms,
            embedding_scale=math.sqrt(hidden) if gemma else 1.0,
            hidden_activation="clamped_swiglu" if gpt_oss else _ACTIVATIONS[activation],
            swiglu_limit=float(data.get("swiglu_limit", 7.0)) if gpt_oss else None,
            attention_output_bias=gpt_oss and bool(data.get("attention_bias", True)),
            attention_sinks=gpt_oss,
            latent_attention=latent,
            **moe,
        )
    except KeyError as error:
        raise SourceError(f"config.json lacks {error.args[0]!r}") from None
    except (ManifestError, TypeError, ValueError) as error:
        raise SourceError(f"config.json: {error}") from None


def _attention_bias(data: dict[str, Any], family: bool | None, architecture: str) -> bool:
    """Whether q/k/v carry biases: a Qwen2-MoE's `qkv_bias` (transformers' default: on),
    gpt-oss's `attention_bias` (default on; o_proj's too), otherwise the family's."""
    if architecture == "gpt_oss":
        return bool(data.get("attention_bias", True))
    return bool(data.get("qkv_bias", True)) if architecture == "qwen2_moe" else bool(family)
def _deepseek_moe_fields(data: dict[str, Any], layers: int) -> dict[str, Any]:
    """DeepSeek-V2/V3's experts (transformers' DeepseekV2Moe / DeepseekV3MoE): every layer from
    `first_k_dense_replace` on, `n_shared_experts` x moe_intermediate_size of shared expert (no
    gate), weights times `routed_scaling_factor`. V3 routes by sigmoid scores with the correction
    bias, groups scored by their top two (sigmoid_group, `norm_topk_prob`); V2 by softmax, greedy
    or group_limited_greedy (its weights never renormalized)."""
    experts = int(data.get("n_routed_experts") or 0)
    first_moe = int(data.get("first_k_dense_replace") or 0)
    if not experts or first_moe >= layers:
        return {}  # every layer dense: the expert keys describe none
    width = int(data["moe_intermediate_size"])
    v3 = data.get("model_type") == "deepseek_v3"
    method = data.get("topk_method") or "greedy"
    grouped = v3 or method == "group_limited_greedy"
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(data.get("num_experts_per_tok") or 0),
        "moe_intermediate_size": width,
        "moe_layers": tuple(range(first_moe, layers)),
        "routing": "sigmoid_group" if v3 else "softmax_group_max" if grouped else "softmax",
        "norm_topk_prob": bool(data.get("norm_topk_prob")) if v3 else False,
        "routed_scaling_factor": float(data.get("routed_scaling_factor") or 1.0),
        "n_group": int(data.get("n_group") or 1) if grouped else 1,
        "topk_group": int(data.get("topk_group") or 1) if grouped else 1,
        "shared_expert_intermediate_size": int(data.get("n_shared_experts") or 0) * width,
    }


def _latent_attention(data: dict[str, Any], layers: int, unsupported: list[str]) -> LatentAttention | None:
    """DeepSeek-V2/V3's MLA shapes."""
    try:
        q_rank = data.get("q_lora_rank")
        return LatentAttention(
            q_lora_rank=None if q_rank is None else int(q_rank),
            kv_lora_rank=int(data["kv_lora_rank"]),
            qk_nope_head_dim=int(data["qk_nope_head_dim"]),
            qk_rope_head_dim=int(data["qk_rope_head_dim"]),
            v_head_dim=int(data["v_head_dim"]),
        )
    except KeyError as error:
        raise SourceError(f"config.json lacks {error.args[0]!r}") from None
    except (ManifestError, TypeError, ValueError) as error:
        raise SourceError(f"config.json: {error}") from None


def _latent_softmax_scale(data: dict[str, Any], latent: LatentAttention) -> float:
    """MLA's softmax scale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under yarn
    (DeepSeek's reference and transformers' `yarn_apply_mscale`: the yarn factor on the rotary
    dims' cos/sin does not reach the nope dims, this does)."""
    scale = latent.qk_head_dim**-0.5
    parameters = data.get("rope_parameters") or data.get("rope_scaling") or {}
    kind = parameters.get("rope_type", parameters.get("type")) or "default"
    m_all = parameters.get("mscale_all_dim")
    factor = parameters.get("factor")
    if kind != "default" and m_all and factor and float(factor) > 1:
        mscale = 0.1 * float(m_all) * math.log(float(factor)) + 1.0
        scale *= mscale * mscale
    return scale


def rope_interleaved(data: dict[str, Any]) -> bool:
    """Whether a checkpoint rotates interleaved pairs (x0, x1), (x2, x3), ... rather than halves:
    DeepSeek-V2 always, V3 unless `rope_interleave` is false (transformers' classes)."""
    model_type = data.get("model_type")
    return model_type == "deepseek_v2" or (model_type == "deepseek_v3" and data.get("rope_interleave", True) is not False)


def deinterleaved_row_order(rows: int, start: int, rope: int, stride: int) -> torch.Tensor:
    """The row order that takes the `rope` rows at `start` of every `stride` rows (a head's rope
    part) from interleaved pairs to halves: rows 0, 2, 4, ... then 1, 3, 5, .... Rotate-half RoPE
    on the reordered rows computes exactly what pairwise RoPE does on the original ones, and a
    query and key reordered alike have the same dot products (layers/latent_attention.py)."""
    pairs = torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2)))
    order = torch.arange(rows).view(-1, stride)
    order[:, start : start + rope] = order[:, start : start + rope][:, pairs]
    return order.flatten()


def deinterleave_rope_rows(weight: torch.Tensor, start: int, rope: int, stride: int) -> torch.Tensor:
    """`weight` with its rope rows in rotate-half order (`deinterleaved_row_order`)."""
    if weight.device.type == "meta":
        return weight
    return weight[deinterleaved_row_order(weight.shape[0], start, rope, stride)]


def _moe_fields(data: dict[str, Any], architecture: str, layers: int, unsupported: list[str]) -> dict[str, Any]:
    """The mixture-of-experts fields of `ModelConfig` (none for a dense family): which layers
    are MoE (Qwen: not in `mlp_only_layers` and every `decoder_sparse_step`-th; Mixtral: all),
    the experts and their width (Mixtral's `intermediate_size` is each expert's), the shared
    expert and its sigmoid gate (Qwen2-MoE), softmax routing with `norm_topk_prob` (Mixtral:
    always)."""
    if architecture == "deepseek2":
        return _deepseek_moe_fields(data, layers)
    if architecture not in ("qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss"):
        return {}
    if architecture == "gpt_oss":
        # Every layer: a router with a bias, top-k of its logits then softmax over those k, and
        # experts of width `intermediate_size` with biases (transformers' GptOssMLP).
        experts = int(data.get("num_local_experts") or 0)
        return {
            "num_experts": experts,
            "num_experts_per_tok": int(data.get("num_experts_per_tok") or 0),
            "moe_intermediate_size": int(data["intermediate_size"]),
            "moe_layers": tuple(range(layers)) if experts else (),
            "routing": "topk_softmax",
            "router_bias": True,
            "expert_bias": True,
        }
    if architecture == "mixtral":
        experts = int(data.get("num_local_experts") or 0)
        moe_layers = tuple(range(layers))
        width = int(data["intermediate_size"])
        normalize = True
    else:
        # Qwen's own key; transformers 5 saves it under its alias, Mixtral's name.
        experts = int(data.get("num_experts") or data.get("num_local_experts") or 0)
        step = int(data.get("decoder_sparse_step") or 1)
        dense = set(data.get("mlp_only_layers") or ())
        moe_layers = tuple(i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
        width = int(data["moe_intermediate_size"])
        normalize = bool(data.get("norm_topk_prob", architecture == "qwen3_moe"))
    fields: dict[str, Any] = {
        "num_experts": experts,
        "num_experts_per_tok": int(data.get("num_experts_per_tok") or 0),
        "moe_intermediate_size": width,
        "moe_layers": moe_layers if experts else (),
        "routing": "softmax",
        "norm_topk_prob": normalize,
    }
    if architecture == "qwen2_moe":
        shared = int(data.get("shared_expert_intermediate_size") or 0)
        fields["shared_expert_intermediate_size"] = shared
        fields["shared_expert_gate"] = shared > 0
    return fields


def _positive_or_none(value: Any) -> float | None:
    return float(value) if value else None


@dataclass(frozen=True)
class _Rope:
    """What a config says of RoPE: the global base and scaling, the rotary dimensions (None: the
    whole head) and the sliding layers' own base (Gemma 3)."""

    theta: float
    scaling: RopeScaling | None
    rotary_dim: int | None
    local_theta: float | None


def _rope(data: dict[str, Any], architecture: str, head_dim: int, max_positions: int, unsupported: list[str]) -> _Rope:
    """RoPE base, scaling, rotary dimensions and the sliding layers' base, from either layout."""
    parameters = data.get("rope_parameters") or {}
    nested = isinstance(parameters.get("full_attention"), dict) or isinstance(parameters.get("sliding_attention"), dict)
    default_theta = 1_000_000.0 if architecture == "gemma3" else 10_000.0
    if nested:
        full = dict(parameters.get("full_attention") or {})
        local = dict(parameters.get("sliding_attention") or {})
    else:
        full = dict(parameters or data.get("rope_scaling") or {})
        local = {}
    theta = float(full.get("rope_theta") or data.get("rope_theta") or default_theta)
    local_theta = None
    if architecture == "gemma3":
        local_theta = float(local.get("rope_theta") or data.get("rope_local_base_freq") or 10_000.0)
        if local.get("rope_type", local.get("type", "default")) != "default":
            unsupported.append(f"RoPE scaling {local.get('rope_type', local.get('type'))!r} on the sliding layers")
    factor = full.get("partial_rotary_factor", data.get("partial_rotary_factor", 1.0)) or 1.0
    rotary_dim = None if float(factor) == 1.0 else int(head_dim * float(factor))
    kind = full.get("rope_type", full.get("type")) or "default"
    if architecture == "phi3" and kind in ("su", "yarn"):
        kind = "longrope"  # what transformers reads Phi-3's older names as
    if kind == "default":
        return _Rope(theta, None, rotary_dim, local_theta)
    # transformers (standardize_rope_params): Phi-3's top-level original context wins.
    original = int(
        data.get("original_max_position_embeddings")
        or full.get("original_max_position_embeddings")
        or max_positions
    ) if architecture == "phi3" else int(full.get("original_max_position_embeddings") or max_positions)
    given = full.get("factor")
    try:
        if kind == "linear":
            scaling = RopeScaling("linear", factor=float(given))
        elif kind == "llama3":
            scaling = RopeScaling(
                "llama3",
                factor=float(given),
                original_max_position_embeddings=original,
                low_freq_factor=float(full["low_freq_factor"]),
                high_freq_factor=float(full["high_freq_factor"]),
            )
        elif kind == "yarn":
            yarn_factor = float(given) if given is not None else max_positions / original
            scaling = RopeScaling(
                "yarn",
                factor=yarn_factor,
                original_max_position_embeddings=original,
                beta_fast=float(full.get("beta_fast") or 32.0),
                beta_slow=float(full.get("beta_slow") or 1.0),
                attention_factor=_yarn_attention_factor(full, yarn_factor),
                truncate=full.get("truncate", True) is not False,
            )
        elif kind == "longrope":
            scaling = RopeScaling(
                "longrope",
                factor=float(given) if given is not None else max_positions / original,
                original_max_position_embeddings=original,
                attention_factor=full.get("attention_factor"),
                short_factor=tuple(full["short_factor"]),
                long_factor=tuple(full["long_factor"]),
            )
        else:
            unsupported.append(f"RoPE scaling {kind!r}")
            return _Rope(theta, None, rotary_dim, local_theta)
    except (KeyError, TypeError) as error:
        raise SourceError(f"config.json: RoPE scaling {kind!r} lacks or garbles {error}") from None
    return _Rope(theta, scaling, rotary_dim, local_theta)


def _yarn_attention_factor(parameters: dict[str, Any], factor: float) -> float:
    """transformers' yarn attention factor: given, or from mscale / mscale_all_dim, or 0.1 ln(factor) + 1."""
    if parameters.get("attention_factor") is not None:
        return float(parameters["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = parameters.get("mscale"), parameters.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(factor, m) / mscale(factor, m_all))
    return mscale(factor)


def _sliding_layers(data: dict[str, Any], architecture: str, layers: int, unsupported: list[str]) -> tuple[int | None, tuple[int, ...]]:
    """The sliding window and the layers it applies to: `layer_types` where the config lists
    them, otherwise the family's rule (transformers' config classes)."""
    window = data.get("sliding_window")
    if architecture in _QWEN and not data.get("use_sliding_window", False):
        window = None
    if window is None or architecture == "llama":
        return None, ()
    types = data.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        other = sorted({t for t in types if t not in ("sliding_attention", "full_attention")})
        if other:
            unsupported.append(f"layer types {', '.join(map(repr, other))}")
        sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    elif architecture in ("mistral", "phi3", "mixtral"):
        sliding = tuple(range(layers))
    elif architecture in ("qwen2", "qwen3"):
        sliding = tuple(range(int(data.get("max_window_layers", layers)), layers))
    elif architecture in _QWEN:
        unsupported.append("sliding windows without layer_types")
        return None, ()
    elif architecture in ("gemma2", "gpt_oss"):
        sliding = tuple(i for i in range(layers) if i % 2 == 0)
    else:
        pattern = int(data.get("sliding_window_pattern", 6))
        sliding = tuple(i for i in range(layers) if (i + 1) % pattern)
    return (int(window), sliding) if sliding else (None, ())


_SOURCE_GEMMA_NORMS = {package: source for source, package in _GEMMA_NORMS.items()}
# Phi-3's checkpoints hold these package tensors fused (`tensor_converter` splits them).
_PHI3_FUSED = {
    "q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
}


# Mixtral's saved names of a layer's MoE tensors -> Qwen's (and transformers 5's), which
# `_moe_tensor_name` then maps to the package's.
_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT_TENSOR = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _moe_tensor_name(name: str) -> str:
    """A source's MoE tensor under the package's name (the router) or Qwen's per-expert name
    (`stack_experts` stacks those); any other name unchanged."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    parts = name.split(".")
    if len(parts) == 8 and parts[4] == "experts" and parts[6] in _MIXTRAL_EXPERT:
        parts[6] = _MIXTRAL_EXPERT[parts[6]]
        name = ".".join(parts)
    if name.endswith(".mlp.gate.weight"):
        return name.removesuffix("gate.weight") + "router.weight"
    # DeepSeek's: the router's correction bias, and its shared experts as one gated MLP.
    if name.endswith(".mlp.gate.e_score_correction_bias"):
        return name.removesuffix("gate.e_score_correction_bias") + "router.score_correction_bias"
    return name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")


def stack_experts(tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """`tensors` with each MoE layer's per-expert gate/up/down (`mlp.experts.N.*_proj.weight`)
    stacked into the package's `mlp.experts.gate_up_proj.weight` [E, 2 I, hidden] and
    `mlp.experts.down_proj.weight` [E, hidden, I]. A layer whose experts are not all there, or
    not all of one shape, is left as it is, for the shape check to name what is wrong. Works on
    meta tensors too."""
    if not config.num_experts:
        return tensors
    found: dict[str, dict[tuple[int, str], str]] = {}
    for name in tensors:
        match = _EXPERT_TENSOR.match(name)
        if match:
            found.setdefault(match.group(1), {})[(int(match.group(2)), match.group(3))] = name
    stacked = dict(tensors)
    for prefix, parts in found.items():
        names = [[parts.get((e, p)) for p in ("gate_proj", "up_proj", "down_proj")] for e in range(config.num_experts)]
        if len(parts) != 3 * config.num_experts or any(n is None for each in names for n in each):
            continue
        gate, up, down = ([tensors[each[i]] for each in names] for i in range(3))  # type: ignore[index]
        if len({t.shape for t in gate + up}) != 1 or len({t.shape for t in down}) != 1:
            continue
        for each in names:
            for n in each:
                del stacked[n]  # type: ignore[arg-type]
        stacked[f"{prefix}.gate_up_proj.weight"] = torch.stack([torch.cat(pair) for pair in zip(gate, up)])
        stacked[f"{prefix}.down_proj.weight"] = torch.stack(down)
    return stacked


_GPT_OSS_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")


def _gpt_oss_tensor(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """A gpt-oss expert tensor in the package's layout, or None for any other tensor. transformers
    keeps them transposed, [E, in, out], with gate and up interleaved (gate at even columns,
    `GptOssExperts._apply_gate`): the package's are [E, out, in], gate rows then up rows."""
    match = _GPT_OSS_EXPERTS.match(name)
    if match is None:
        return None
    prefix, projection, kind = match.groups()
    if kind == "_scales":
        return {}  # read with its blocks (`gpt_oss_mxfp4_experts`)
    if kind == "_blocks":
        # The shape of what `gpt_oss_mxfp4_experts` makes of it (this runs on meta tensors only).
        experts, rows, groups, _ = tensor.shape
        return {f"{prefix}.{projection}.weight": torch.empty((experts, rows, groups * 32), device="meta")}
    if kind == "_bias":
        bias = torch.cat([tensor[..., 0::2], tensor[..., 1::2]], dim=-1) if projection == "gate_up_proj" else tensor
        return {f"{prefix}.{projection}.bias": bias}
    if tensor.dim() != 3:
        return {f"{prefix}.{projection}.weight": tensor}  # for the shape check to name
    if projection == "gate_up_proj":
        tensor = torch.cat([tensor[..., 0::2], tensor[..., 1::2]], dim=-1)
    return {f"{prefix}.{projection}.weight": tensor.transpose(1, 2)}


def gpt_oss_mxfp4_experts(name: str, blocks: torch.Tensor, scales: torch.Tensor) -> tuple[str, BlockTensor]:
    """gpt-oss's MXFP4 experts, `*_blocks` uint8 [E, rows, groups, 16] and `*_scales` [E, rows,
    groups] ([out, in] per expert, gate_up's rows interleaved gate/up), as the package's stacked
    projection in ggml MXFP4 rows (`blocks.mxfp4_from_openai`), gate rows then up rows: whole
    rows move, so the values are exactly the checkpoint's."""
    match = _GPT_OSS_EXPERTS.match(name)
    assert match is not None and match.group(3) == "_blocks", name
    prefix, projection, _ = match.groups()
    b, s = blocks.numpy(), scales.numpy()
    if b.ndim != 4 or s.shape != b.shape[:3]:
        raise SourceError(f"{name}: MXFP4 blocks [E, rows, groups, 16] with scales [E, rows, groups], got {list(b.shape)} and {list(s.shape)}")
    if projection == "gate_up_proj":
        b = np.concatenate([b[:, 0::2], b[:, 1::2]], axis=1)
        s = np.concatenate([s[:, 0::2], s[:, 1::2]], axis=1)
    rows = mxfp4_from_openai(np.ascontiguousarray(b), np.ascontiguousarray(s))
    experts, out = rows.shape[:2]
    data = torch.from_numpy(np.ascontiguousarray(rows.reshape(experts * out, -1)))
    return f"{prefix}.{projection}.weight", BlockTensor(GGMLType.MXFP4, data, (experts, out, b.shape[2] * 32))


def hf_tensor_name(name: str, architecture: str) -> str:
    """The checkpoint's tensor that gives the package tensor `name` of an `architecture` model
    (Gemma's norms under their own names, Phi-3's fused tensors), for messages."""
    parts = name.split(".")
    if len(parts) == 5 and parts[0:2] == ["model", "layers"]:
        if architecture in _GEMMA and parts[3] in _SOURCE_GEMMA_NORMS:
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
    gemma = config.architecture in _GEMMA
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
            converted = _gpt_oss_tensor(name, tensor)
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
            name = _moe_tensor_name(name)
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
