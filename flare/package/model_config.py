"""A model's architecture as the manifest describes it (`model.config`): `ModelConfig`, the
decoder families' fields and what they are validated against (`ARCHITECTURES`, `ROUTINGS`,
`ROPE_SCALINGS`, ...), RoPE scaling (`RopeScaling`), latent attention's shapes
(`LatentAttention`) and the KV cache's per-token layout (`KVLayout`).

It is the lowest of the manifest's modules: `ManifestError` and the strict JSON readers every
manifest object uses (`_check_keys`, `_fields_of`) live here, so that manifest.py imports them
from here and nothing imports the other way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


class ManifestError(ValueError):
    """A manifest that cannot be read or does not describe a servable package."""


# The decoder families flare serves (`ModelConfig.architecture`): one decoder (engine/model.py)
# driven by the fields below, never a model per family. docs/packages.md lists the fields and
# source keys of each.
ARCHITECTURES = (
    "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss", "deepseek2",
)
# clamped_swiglu: gpt-oss's experts (`layers/mlp.py` `clamped_swiglu`, with `swiglu_limit`).
HIDDEN_ACTIVATIONS = ("silu", "gelu_tanh", "clamped_swiglu")
# How a mixture-of-experts layer's router turns its logits into k experts and their weights
# (`ModelConfig.routing`; flare/engine/layers/routing.py implements each).
ROUTINGS = ("softmax", "softmax_group_max", "sigmoid_group", "topk_softmax")
ROPE_SCALINGS = ("linear", "llama3", "yarn", "longrope", "factors")


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE's frequencies are stretched past the context a model was trained on.

    - linear: positions divided by `factor`.
    - llama3 (Llama 3.1+): wavelengths longer than original / low_freq_factor are divided by
      `factor`, shorter than original / high_freq_factor kept, smoothly blended between.
    - yarn: per-frequency blend of interpolation and extrapolation between beta_fast and
      beta_slow rotations, cos/sin scaled by `attention_factor` (0.1 ln(factor) + 1 unless given);
      the ramp's ends rounded to whole dimensions unless `truncate` is False (gpt-oss).
    - longrope (Phi-3): frequencies divided by `short_factor` (or `long_factor`, per dimension
      pair), cos/sin scaled by `attention_factor` (sqrt(1 + ln(factor) / ln(original)) unless given).
    - factors: each frequency divided by its own factor in `short_factor`, nothing else: a GGUF's
      `rope_freqs.weight`, which is how llama.cpp's converter stores llama3 scaling.
    """

    kind: str
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALINGS:
            raise ManifestError(f"model config: rope_scaling.kind {self.kind!r} is not one of {', '.join(ROPE_SCALINGS)}")
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(float(v) for v in value))

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for name in ("short_factor", "long_factor"):
            if data[name] is not None:
                data[name] = list(data[name])
        return data

    @classmethod
    def from_json(cls, data: Any) -> RopeScaling:
        if isinstance(data, dict):
            data = {"truncate": True, **data}  # written before gpt-oss's untruncated yarn: truncated
        return cls(**_fields_of(cls, data, "model.config.rope_scaling"))


@dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention (DeepSeek-V2/V3, engine/layers/latent_attention.py): the
    shapes of its low-rank projections.

    - q_lora_rank: q = q_b(RMSNorm(q_a(x))) through this rank; None: one plain q_proj (V2-Lite).
    - kv_lora_rank: the compressed latent c = RMSNorm(kv_a(x)[:kv_lora_rank]) every head's key
      and value are up-projected from (kv_b), and what the KV cache keeps per token.
    - qk_nope_head_dim, qk_rope_head_dim: each query/key head is [nope | rope]; the rope part
      of the key is one per token, shared by the heads (the last qk_rope_head_dim of kv_a(x)).
    - v_head_dim: each head's value width.
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "q_lora_rank"):
            value = getattr(self, name)
            if name == "q_lora_rank" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ManifestError(f"model config: latent_attention.{name} must be a positive integer, got {value!r}")
        if self.qk_rope_head_dim % 2:
            raise ManifestError(f"model config: latent_attention.qk_rope_head_dim {self.qk_rope_head_dim} must be even for rotary embeddings")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> LatentAttention:
        return cls(**_fields_of(cls, data, "model.config.latent_attention"))


@dataclass(frozen=True)
class KVLayout:
    """What the KV cache keeps per token per layer: `heads` pools rows of `key_dim` keys and
    `value_dim` values (0: attention reads its values out of the keys, as latent attention does)."""

    heads: int
    key_dim: int
    value_dim: int

    @property
    def elements_per_token(self) -> int:
        """Elements one token takes in one layer."""
        return self.heads * (self.key_dim + self.value_dim)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only model: Llama's fields, and what each other family adds.

    Every field past `eos_token_ids` defaults to Llama's behaviour, so that a Llama config reads
    the same and a format-2/3 manifest (Llama only) reads with those defaults.

    - attention_bias: q/k/v projections carry a bias (Qwen2).
    - qk_norm: per-head RMSNorm of q and k before RoPE, weights [head_dim] (Qwen3, Gemma 3).
    - rotary_dim: the leading dimensions of each head that RoPE rotates (None: all; Phi-4-mini).
    - rope_scaling: see `RopeScaling`; it applies to the global (full-attention) layers.
    - sliding_window, sliding_layers: the layers (indices) whose queries attend only to the last
      `sliding_window` positions, their own included (Mistral: all; Gemma 2: even ones).
    - local_rope_theta: RoPE base of the sliding layers, unscaled (Gemma 3); None: the same
      RoPE as the global layers.
    - attention_scale: the factor on q.k (None: head_dim ** -0.5; Gemma: query_pre_attn_scalar ** -0.5).
    - attention_softcap, final_logit_softcap: scores and logits become cap * tanh(x / cap) (Gemma 2).
    - sandwich_norms: each sublayer's output is RMS-normalized before it joins the residual
      stream (`attention_output_norm`, `mlp_output_norm`; Gemma 2/3).
    - embedding_scale: the token embeddings are multiplied by it (Gemma: sqrt(hidden_size)).
    - hidden_activation: of the gated MLP, silu (SwiGLU), gelu_tanh (GeGLU, Gemma) or
      clamped_swiglu (gpt-oss's experts, clamped at `swiglu_limit`).
    - attention_output_bias: o_proj carries a bias (gpt-oss).
    - attention_sinks: each layer has a learned sink logit per query head,
      `self_attn.sinks` [heads], which joins the softmax's denominator (gpt-oss).
    - latent_attention: multi-head latent attention's shapes (`LatentAttention`, DeepSeek-V2/V3);
      then head_dim is the query/key head (nope + rope), rotary_dim the rope part, num_kv_heads
      num_heads, attention_scale the softmax scale, and the KV cache keeps the latent (`kv_layout`).

    Mixture-of-experts (Qwen2/3-MoE, Mixtral; 0 experts: every layer is dense). The layers
    `moe_layers` replace the gated MLP of width `intermediate_size` by a router over
    `num_experts` gated MLPs of width `moe_intermediate_size`, of which each token runs
    `num_experts_per_tok`, their outputs summed weighted by the router (`layers/moe.py`):

    - routing (`ROUTINGS`): softmax (softmax over the experts, top-k: Qwen, Mixtral, DeepSeek-V2's
      greedy); softmax_group_max (DeepSeek-V2's group_limited_greedy: the top `topk_group` of
      `n_group` groups by their best score); sigmoid_group (DeepSeek-V3: sigmoid scores, the
      choice by scores + `mlp.router.score_correction_bias`, groups scored by their top two);
      topk_softmax (gpt-oss: top-k of the logits, softmax over those k).
    - norm_topk_prob: the k weights are divided by their sum (Mixtral always).
    - routed_scaling_factor: the k weights are multiplied by it (DeepSeek).
    - router_bias: the router has a bias (`mlp.router.bias`, gpt-oss).
    - expert_bias: the experts' gate/up and down carry biases (`mlp.experts.gate_up_proj.bias`
      [E, 2 I], `mlp.experts.down_proj.bias` [E, hidden]; gpt-oss).
    - shared_expert_intermediate_size: width of a gated MLP every token runs beside the routed
      ones (Qwen2-MoE's shared expert; DeepSeek's n_shared_experts x moe_intermediate_size);
      0: none. shared_expert_gate: its output is scaled by sigmoid(`mlp.shared_expert_gate`(x))
      (Qwen2-MoE).

    Norm weights are stored as the factor they multiply by: Gemma's (1 + w) is baked in at
    export, as llama.cpp's converter does. Fused source tensors (Phi-3's qkv_proj and
    gate_up_proj) are split into Llama's names at export.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    architecture: str = "llama"
    attention_bias: bool = False
    qk_norm: bool = False
    rotary_dim: int | None = None
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    local_rope_theta: float | None = None
    attention_scale: float | None = None
    attention_softcap: float | None = None
    final_logit_softcap: float | None = None
    sandwich_norms: bool = False
    embedding_scale: float = 1.0
    hidden_activation: str = "silu"
    swiglu_limit: float | None = None
    attention_output_bias: bool = False
    attention_sinks: bool = False
    latent_attention: LatentAttention | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()
    routing: str = "softmax"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    router_bias: bool = False
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    expert_bias: bool = False

    def __post_init__(self) -> None:
        problems = []
        if self.architecture not in ARCHITECTURES:
            problems.append(f"architecture {self.architecture!r} is not one flare serves ({', '.join(ARCHITECTURES)})")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if not problems and self.num_heads % self.num_kv_heads:
            problems.append(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if not problems and self.head_dim % 2:
            problems.append(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if self.rotary_dim is not None and (
            isinstance(self.rotary_dim, bool)
            or not isinstance(self.rotary_dim, int)
            or not 2 <= self.rotary_dim <= int(self.head_dim)
            or self.rotary_dim % 2
        ):
            problems.append(f"rotary_dim must be an even integer from 2 to head_dim {self.head_dim}, got {self.rotary_dim!r}")
        if self.sliding_window is not None and (
            isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int) or self.sliding_window < 1
        ):
            problems.append(f"sliding_window must be a positive integer, got {self.sliding_window!r}")
        layers = tuple(self.sliding_layers)
        if layers and self.sliding_window is None:
            problems.append("sliding_layers are named but sliding_window is not set")
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < int(self.num_layers) for i in layers):
            problems.append(f"sliding_layers must be layer indices below num_layers {self.num_layers}, got {list(layers)}")
        elif list(layers) != sorted(set(layers)):
            problems.append(f"sliding_layers must be increasing, got {list(layers)}")
        for name in ("attention_scale", "attention_softcap", "final_logit_softcap", "local_rope_theta"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                problems.append(f"{name} must be a positive number, got {value!r}")
        if isinstance(self.embedding_scale, bool) or not isinstance(self.embedding_scale, (int, float)) or not self.embedding_scale > 0:
            problems.append(f"embedding_scale must be a positive number, got {self.embedding_scale!r}")
        if self.hidden_activation not in HIDDEN_ACTIVATIONS:
            problems.append(f"hidden_activation {self.hidden_activation!r} is not one of {', '.join(HIDDEN_ACTIVATIONS)}")
        limit = self.swiglu_limit
        if (self.hidden_activation == "clamped_swiglu") != (limit is not None):
            problems.append("swiglu_limit is set exactly when hidden_activation is clamped_swiglu")
        elif limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0):
            problems.append(f"swiglu_limit must be a positive number, got {limit!r}")
        latent = self.latent_attention
        if latent is not None and (
            self.head_dim != latent.qk_head_dim or self.rotary_dims != latent.qk_rope_head_dim or self.num_kv_heads != self.num_heads
        ):
            problems.append(
                f"with latent attention head_dim must be qk_nope_head_dim + qk_rope_head_dim ({latent.qk_head_dim}), "
                f"rotary_dim qk_rope_head_dim ({latent.qk_rope_head_dim}) and num_kv_heads num_heads ({self.num_heads}); "
                f"got {self.head_dim}, {self.rotary_dims}, {self.num_kv_heads}"
            )
        problems += self._moe_problems()
        if not self.eos_token_ids:
            problems.append("eos_token_ids must name at least one token")
        for token in (*self.eos_token_ids, *(() if self.bos_token_id is None else (self.bos_token_id,))):
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < int(self.vocab_size):
                problems.append(f"special token id {token!r} is outside the vocabulary")
        if problems:
            raise ManifestError("model config: " + "; ".join(problems))
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        object.__setattr__(self, "sliding_layers", layers)
        object.__setattr__(self, "moe_layers", tuple(self.moe_layers))

    def _moe_problems(self) -> list[str]:
        """What is wrong with the mixture-of-experts fields (none of it on a dense model)."""
        problems = []
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size", "n_group", "topk_group"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                problems.append(f"{name} must be a non-negative integer, got {value!r}")
        if problems:
            return problems
        layers = tuple(self.moe_layers)
        if not self.num_experts:
            if layers:
                problems.append("moe_layers are named but num_experts is 0")
            if self.expert_bias:
                problems.append("expert_bias is set but num_experts is 0")
            return problems
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            problems.append(f"num_experts_per_tok must be from 1 to num_experts {self.num_experts}, got {self.num_experts_per_tok}")
        if self.moe_intermediate_size < 1:
            problems.append("moe_intermediate_size must be a positive integer on a mixture-of-experts model")
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < int(self.num_layers) for i in layers):
            problems.append(f"moe_layers must be layer indices below num_layers {self.num_layers}, got {list(layers)}")
        elif list(layers) != sorted(set(layers)):
            problems.append(f"moe_layers must be increasing, got {list(layers)}")
        if self.routing not in ROUTINGS:
            problems.append(f"routing {self.routing!r} is not one of {', '.join(ROUTINGS)}")
        if self.n_group < 1 or self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            problems.append(
                f"n_group {self.n_group} must divide num_experts {self.num_experts} and topk_group {self.topk_group} lie in 1..n_group"
            )
        elif self.routing == "sigmoid_group" and self.num_experts // self.n_group < 2:
            problems.append("sigmoid_group routing scores a group by its top two experts: groups need at least two")
        scale = self.routed_scaling_factor
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
            problems.append(f"routed_scaling_factor must be a positive number, got {scale!r}")
        if self.shared_expert_gate and not self.shared_expert_intermediate_size:
            problems.append("shared_expert_gate is set but there is no shared expert (shared_expert_intermediate_size 0)")
        return problems

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts (else the dense gated MLP)."""
        return layer in self.moe_layers

    @property
    def rotary_dims(self) -> int:
        """How many leading dimensions of each head RoPE rotates."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def kv_layout(self) -> KVLayout:
        """The KV cache's per-token layout, a property of the model so that the pools, the prefix
        cache and preemption need not know the attention: a key and a value per KV head, or with
        latent attention one row of [latent | rope key] and no separate value (the latent is it)."""
        latent = self.latent_attention
        if latent is None:
            return KVLayout(self.num_kv_heads, self.head_dim, self.head_dim)
        return KVLayout(1, latent.kv_lora_rank + latent.qk_rope_head_dim, 0)

    @property
    def kv_elements_per_token(self) -> int:
        """Elements one token takes in the KV cache across all layers (`kv_layout`)."""
        return self.num_layers * self.kv_layout.elements_per_token

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`, or None where it attends to its whole context."""
        return self.sliding_window if layer in self.sliding_layers else None

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["eos_token_ids"] = list(self.eos_token_ids)
        data["sliding_layers"] = list(self.sliding_layers)
        data["moe_layers"] = list(self.moe_layers)
        data["rope_scaling"] = None if self.rope_scaling is None else self.rope_scaling.to_json()
        data["latent_attention"] = None if self.latent_attention is None else self.latent_attention.to_json()
        return data

    @classmethod
    def from_json(cls, data: Any, format_version: int) -> ModelConfig:
        """The config of a manifest of format `format_version` (manifest.py, `READ_FORMATS`)."""
        if format_version < 4 and isinstance(data, dict):
            # Formats 2 and 3 describe Llama models only, without the family fields.
            data = {**_LLAMA_FIELDS, **data}
        elif isinstance(data, dict):
            # The mixture-of-experts fields came within format 4: a manifest written before
            # them describes a dense model.
            data = {**_DENSE_FIELDS, "latent_attention": None, **data}
        values = _fields_of(cls, data, "model.config")
        values["eos_token_ids"] = tuple(values["eos_token_ids"])
        values["sliding_layers"] = tuple(values["sliding_layers"] or ())
        values["moe_layers"] = tuple(values["moe_layers"] or ())
        if values["rope_scaling"] is not None:
            values["rope_scaling"] = RopeScaling.from_json(values["rope_scaling"])
        if values["latent_attention"] is not None:
            values["latent_attention"] = LatentAttention.from_json(values["latent_attention"])
        return cls(**values)


# The family fields' Llama values, what a format-2/3 manifest's config means by leaving them out.
_LLAMA_FIELDS = {
    f.name: (list(f.default) if isinstance(f.default, tuple) else f.default)
    for f in dataclasses.fields(ModelConfig)
    if f.default is not dataclasses.MISSING and f.name != "architecture"
}
_MOE_FIELDS = (
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "moe_layers", "routing", "norm_topk_prob",
    "routed_scaling_factor", "n_group", "topk_group", "router_bias", "shared_expert_intermediate_size", "shared_expert_gate",
    # gpt-oss's, which came after them.
    "expert_bias", "swiglu_limit", "attention_output_bias", "attention_sinks",
)
_DENSE_FIELDS = {name: _LLAMA_FIELDS[name] for name in _MOE_FIELDS}


def _check_keys(data: dict[str, Any], expected: set[str], where: str) -> None:
    unknown = sorted(set(data) - expected)
    missing = sorted(expected - set(data))
    parts = []
    if unknown:
        parts.append(f"unknown key(s) {', '.join(unknown)}")
    if missing:
        parts.append(f"missing key(s) {', '.join(missing)}")
    if parts:
        raise ManifestError(f"{where}: {'; '.join(parts)}")


def _fields_of(cls: type, data: Any, where: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ManifestError(f"{where} must be an object, got {type(data).__name__}")
    # Every field is written, so every field is required when reading: a missing key means the
    # manifest was not written by this format's writer.
    _check_keys(data, {f.name for f in dataclasses.fields(cls)}, where)
    return dict(data)
