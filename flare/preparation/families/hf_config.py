"""The families of Hugging Face checkpoints flare serves: `config.json` to `ModelConfig`.

`model_type` -> architecture: llama, mistral, qwen2, qwen3, gemma2, gemma3_text (and gemma3,
whose text model sits under `text_config` and `language_model`), phi3, deepseek_v2 and
deepseek_v3 (and kimi_k2, a DeepSeek-V3 under its own name), gpt_oss, and the mixture-of-experts qwen2_moe, qwen3_moe and mixtral. Both config
layouts are read: transformers 5's `rope_parameters` (for Gemma 3 one per layer type) and
`layer_types`, and the older `rope_theta` / `rope_scaling` / `partial_rotary_factor` /
`rope_local_base_freq` keys with each family's own rule for which layers slide.
docs/packages.md tabulates the keys. The experts' fields are moe.py's (`hf_moe_fields`),
DeepSeek's latent attention deepseek.py's; hf_tensors.py maps the tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from flare.package.family_tensors import FAMILY_TENSORS
from flare.package.manifest import MAX_CONTEXT, MAX_CONTEXT_REASON
from flare.package.model_config import ARCHITECTURES, ManifestError, ModelConfig, RopeScaling
from flare.preparation.families.deepseek import hf_latent_attention, hf_latent_softmax_scale
from flare.preparation.families.moe import hf_moe_fields
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
    "kimi_k2": "deepseek2",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
    "gpt_oss": "gpt_oss",
}
_QWEN = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def served_list() -> str:
    return ", ".join(MODEL_TYPES)


# Model types that are another's decoder under their own name: Kimi K2 (and K2-Thinking) ships
# DeepSeek-V3's modeling code and config class with model_type "kimi_k2".
_SAME_DECODER = {"kimi_k2": "deepseek_v3"}


def text_config(data: dict[str, Any]) -> dict[str, Any]:
    """The config of the decoder: a multimodal Gemma 3's `text_config`, a Kimi K2's as the
    DeepSeek-V3 config it is, otherwise `data` itself."""
    if data.get("model_type") in _SAME_DECODER:
        return {**data, "model_type": _SAME_DECODER[data["model_type"]]}
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
    gemma = architecture in GEMMA_ARCHITECTURES
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
    latent = hf_latent_attention(data, layers, unsupported) if architecture == "deepseek2" else None
    if latent is not None:
        # MLA's heads: queries and keys of nope + rope, RoPE on the rope part only (the
        # checkpoint's head_dim, where written, is transformers' name for qk_rope_head_dim).
        head_dim = latent.qk_head_dim
    rope = _rope(data, architecture, latent.qk_rope_head_dim if latent else head_dim, max_positions, unsupported)
    window, sliding = _sliding_layers(data, architecture, layers, unsupported)
    moe = hf_moe_fields(data, architecture, layers, unsupported)
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
        attention_scale = hf_latent_softmax_scale(data, latent)
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
