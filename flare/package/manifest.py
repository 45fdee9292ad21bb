"""The package manifest (`manifest.json`): what a package holds and how it is to be served.

Layout of the JSON object (format 4):

    {"format": 4,
     "model": {"config": {ModelConfig}, "provenance": {Provenance}},
     "serving": {ServingConfig},
     "sampling": {"defaults": {...}, "ranges": {...}},
     "files": {"model.safetensors": "<sha256>", "tokenizer.json": ..., "chat_template.jinja": ...},
     "draft_head": {DraftHeadInfo},   (only in a package that ships a learned draft head)
     "blocks": {"<tensor name>": {"type": "Q4_1", "offset": 0, "nbytes": 207360}, ...},
                                      (only in a package that keeps quantized tensors as ggml blocks,
                                       in `model.blocks`; package.py and blocks.py)
     "dequantized": {"<tensor name>": "Q2_K", ...}}
                                      (only where export dequantized quantized source tensors: their
                                       source type, for `flare inspect`)

Formats read: 2 (provenance.name), 3 (blocks) and 4 (the model families' config fields). A
format-2 manifest has no blocks, and a format-2/3 config is a Llama one; each reads as before.
flare writes format 4.

Reading is strict: an unknown or missing key is an error naming it, so a manifest written by a
newer flare is refused rather than half understood.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from flare.policy.policy import PolicyError, SamplingPolicy

FORMAT_VERSION = 4  # 2: provenance.name (the model name clients use); 3: blocks; 4: model families
READ_FORMATS = (2, 3, 4)
MANIFEST_NAME = "manifest.json"
DTYPES = ("float32", "bfloat16", "float16")
# What `flare export --dtype` takes besides DTYPES: float16, or bfloat16 for weights beyond
# float16's range (`export.resolve_dtype`); a manifest always names the stored one.
AUTO_DTYPE = "auto"
# What `flare export --quantize` takes (quantize.py): a Hugging Face directory's float weights
# as ggml blocks. Kept here, free of torch, for the command line.
QUANTIZE_TYPES = ("q8_0", "q4_0", "q4_k_m")
# What `flare run --weight-format` takes: auto (the fastest this CPU runs for the stored dtype),
# or a format named as the dtype it multiplies in (flare/engine/precision.py). Kept here, free of
# torch, so that the command line parses without loading it.
WEIGHT_FORMATS = (AUTO_DTYPE, *DTYPES)
# What `flare run --kv-cache-dtype` takes: the KV cache stores keys and values in one of the
# package dtypes (the engine computes in float32 whatever it stores; flare/engine/native.py).
KV_CACHE_DTYPES = DTYPES
# What ggml block weights multiply: the float32 activations themselves (exact), or 8-bit
# activation blocks with integer dot products, two per 32 activations (int8x2: a value and its
# residual, ~15 bits) or one (int8) (flare/engine/quantized.py, docs/benchmarks.md).
ACTIVATIONS = ("float32", "int8x2", "int8")
# What `flare run --activations` takes: one of ACTIVATIONS, or auto (the default), the fastest
# that meets the fidelity bar for the package's block types (`auto_activations`).
ACTIVATION_CHOICES = ("auto", *ACTIVATIONS)
# The K-quant block types: their integer products read 256-value Q8_K activation blocks.
K_QUANT_TYPES = ("Q4_K", "Q5_K", "Q6_K")
# The block types with integer kernels (flare/engine/csrc/integer_linear.c for the 32-value ones,
# integer_kquants.c for the K types): what int8 reaches.
INTEGER_ACTIVATION_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# auto: the package's draft head, with n-gram lookup beside it for rows whose text repeats
# (scheduler/speculation/draft_planner.py, `DraftPlanner`); n-gram lookup alone in a package
# without a head. What a package exported with a head serves by default.
DRAFTERS = ("ngram", "mtp", "auto")
# The longest context flare serves: RoPE's positions are float32 (as transformers computes them),
# and float32 holds every integer only up to 2^24, so past it positions would share angles. It is
# above what any released model declares; a source declaring more is refused at export.
MAX_CONTEXT = 1 << 24
MAX_CONTEXT_REASON = "2^24: RoPE's float32 positions are exact up to there; the longest real models declare about 10^7"
HEAD_DTYPES = ("float32", "bfloat16", "float16")
# What a draft head's first step reads of the target at the previous position: its residual
# stream after the last layer (the heads flare distills), or that stream after the target's final
# norm (the input of the DeepSeek-V3-style MTP layers a checkpoint may ship).
HEAD_TARGET_HIDDEN = ("residual", "final_norm")
# The decoder layer a draft head runs (`draft_head.head_layer_config`): a Llama layer whatever the
# target's family (the heads flare distills, and MTP layers in that layout), or one of the
# target's own layers, its attention (latent for DeepSeek) and its MLP (a mixture of experts where
# the target's last layer is one): a DeepSeek-V3 checkpoint's MTP layer.
HEAD_LAYERS = ("llama", "target")
MAX_DRAFT_TOKENS = 16


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
    def from_json(cls, data: Any, format_version: int = FORMAT_VERSION) -> ModelConfig:
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


@dataclass(frozen=True)
class ServingConfig:
    """How the package is to be served.

    draft_tokens is K, the number of tokens the drafter proposes per speculative round
    (0 disables speculation). vocabulary_parallel_sampling says the package was prepared for the
    vocabulary-sharded sampler, which supports unfiltered distributions only (docs/sampling.md).
    """

    max_context: int
    max_concurrency: int = 32
    dtype: str = "float32"
    vocabulary_parallel_sampling: bool = False
    draft_tokens: int = 4
    drafter: str = "ngram"

    def __post_init__(self) -> None:
        problems = []
        for name in ("max_context", "max_concurrency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if not problems and self.max_context > MAX_CONTEXT:
            problems.append(
                f"max_context {self.max_context} is beyond the longest context flare serves, {MAX_CONTEXT} tokens "
                f"({MAX_CONTEXT_REASON})"
            )
        if self.dtype not in DTYPES:
            problems.append(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.vocabulary_parallel_sampling, bool):
            problems.append("vocabulary_parallel_sampling must be true or false")
        k = self.draft_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_DRAFT_TOKENS:
            problems.append(f"draft_tokens must be an integer from 0 (no speculation) to {MAX_DRAFT_TOKENS}, got {k!r}")
        if self.drafter not in DRAFTERS:
            problems.append(f"drafter must be one of {', '.join(DRAFTERS)}, got {self.drafter!r}")
        if problems:
            raise ManifestError("serving: " + "; ".join(problems))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> ServingConfig:
        return cls(**_fields_of(cls, data, "serving"))


@dataclass(frozen=True)
class Provenance:
    """Where the weights came from and what made the package."""

    name: str  # the model name clients send (`model` in requests) unless --served-model-name says otherwise
    source: str  # what the operator passed to `flare export` (a path, or "default")
    source_format: str  # "gguf" or "huggingface"
    source_sha256: str | None  # of the GGUF file; None for a directory source
    recipe: str  # the sampling/serving recipe used
    flare_version: str
    created: str  # ISO 8601, UTC

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> Provenance:
        return cls(**_fields_of(cls, data, "model.provenance"))


@dataclass(frozen=True)
class HeldOutAcceptance:
    """Measured at export on prompts the head was not trained on, greedy: `per_step[j]` is the
    share of positions where the first j + 1 draft steps all equal the target's argmax, and
    `tokens_per_round` = 1 + sum(per_step), the expected tokens a verification round emits at K."""

    per_step: tuple[float, ...]
    tokens_per_round: float
    positions: int


@dataclass(frozen=True)
class DraftHeadInfo:
    """The manifest's `draft_head` object."""

    draft_tokens: int  # K the head was trained to unroll
    draft_vocab_size: int
    parameters: int
    dtype: str
    prompt_set: str  # name and size of the shipped prompt set it was distilled on
    budget: dict[str, Any] = field(default_factory=dict)  # tokens, seconds, seed as asked
    trained: dict[str, Any] = field(default_factory=dict)  # tokens generated, positions trained, seconds
    held_out: HeldOutAcceptance | None = None
    target_hidden: str = "residual"  # HEAD_TARGET_HIDDEN
    imported_from: str | None = None  # the checkpoint MTP layer the head was read from, if not distilled
    layer: str = "llama"  # HEAD_LAYERS

    def __post_init__(self) -> None:
        problems = []
        if self.layer not in HEAD_LAYERS:
            problems.append(f"layer must be one of {', '.join(HEAD_LAYERS)}, got {self.layer!r}")
        if self.target_hidden not in HEAD_TARGET_HIDDEN:
            problems.append(f"target_hidden must be one of {', '.join(HEAD_TARGET_HIDDEN)}, got {self.target_hidden!r}")
        if self.dtype not in HEAD_DTYPES:
            problems.append(f"dtype must be one of {', '.join(HEAD_DTYPES)}, got {self.dtype!r}")
        for name in ("draft_tokens", "draft_vocab_size", "parameters"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if problems:
            raise ManifestError("draft_head: " + "; ".join(problems))

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if self.held_out is not None:
            data["held_out"]["per_step"] = list(self.held_out.per_step)
        return data

    @classmethod
    def from_json(cls, data: Any) -> DraftHeadInfo:
        if not isinstance(data, dict):
            raise ManifestError(f"draft_head must be an object, got {type(data).__name__}")
        expected = {f.name for f in dataclasses.fields(cls)}
        # Keys added after the first packages with a head may be absent: their defaults hold.
        optional = {"target_hidden", "imported_from", "layer"}
        unknown, missing = sorted(set(data) - expected), sorted(expected - set(data) - optional)
        if unknown or missing:
            raise ManifestError(f"draft_head: unknown key(s) {unknown}, missing key(s) {missing}")
        values = dict(data)
        held = values.get("held_out")
        if held is not None:
            try:
                values["held_out"] = HeldOutAcceptance(
                    per_step=tuple(float(x) for x in held["per_step"]),
                    tokens_per_round=float(held["tokens_per_round"]),
                    positions=int(held["positions"]),
                )
            except (KeyError, TypeError, ValueError) as error:
                raise ManifestError(f"draft_head.held_out: {error}") from None
        return cls(**values)


@dataclass(frozen=True)
class BlockEntry:
    """Where one quantized tensor's ggml blocks lie in `model.blocks`, and their ggml type
    (a `gguf.GGMLQuantizationType` name; blocks.py checks it against the types the engine
    multiplies). The tensor's shape is the model config's (`package.expected_weight_shapes`)."""

    type: str
    offset: int
    nbytes: int

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.type, str) or not self.type:
            problems.append(f"type must be a ggml type name, got {self.type!r}")
        for name in ("offset", "nbytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                problems.append(f"{name} must be a non-negative integer, got {value!r}")
        if problems:
            raise ManifestError("; ".join(problems))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Manifest:
    model: ModelConfig
    serving: ServingConfig
    sampling: SamplingPolicy
    provenance: Provenance
    files: dict[str, str] = field(default_factory=dict)  # file name -> sha256 hex
    format: int = FORMAT_VERSION
    draft_head: DraftHeadInfo | None = None  # the learned draft head the package ships, if any
    # Quantized tensors kept as ggml blocks (`model.blocks`), by tensor name; empty for a package
    # whose every weight is in model.safetensors.
    blocks: dict[str, BlockEntry] = field(default_factory=dict)
    # Tensors the source stored quantized that export dequantized (a --dtype asked for floats, or
    # their type has no kernel), with their source type name.
    dequantized: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.serving.drafter == "mtp" and self.draft_head is None:
            raise ManifestError("serving.drafter is mtp but the package ships no draft head (draft_head)")
        if self.draft_head is not None and self.draft_head.draft_tokens < self.serving.draft_tokens:
            raise ManifestError(
                f"serving.draft_tokens {self.serving.draft_tokens} exceeds the {self.draft_head.draft_tokens} "
                "draft steps the draft head was trained for"
            )
        if self.serving.max_context > self.model.max_position_embeddings:
            raise ManifestError(
                f"serving.max_context {self.serving.max_context} exceeds the model's "
                f"max_position_embeddings {self.model.max_position_embeddings}"
            )
        max_tokens_range = self.sampling.ranges.get("max_tokens")
        if self.sampling.defaults["max_tokens"] > self.serving.max_context or (
            max_tokens_range is not None and max_tokens_range[1] > self.serving.max_context
        ):
            raise ManifestError(
                f"sampling max_tokens (default or range) exceeds serving.max_context {self.serving.max_context}"
            )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "model": {"config": self.model.to_json(), "provenance": self.provenance.to_json()},
            "serving": self.serving.to_json(),
            "sampling": self.sampling.to_json(),
            "files": dict(sorted(self.files.items())),
            **({"draft_head": self.draft_head.to_json()} if self.draft_head is not None else {}),
            **({"blocks": {name: entry.to_json() for name, entry in self.blocks.items()}} if self.blocks else {}),
            **({"dequantized": dict(self.dequantized)} if self.dequantized else {}),
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2) + "\n"

    @classmethod
    def from_json(cls, data: Any) -> Manifest:
        if not isinstance(data, dict):
            raise ManifestError(f"manifest must be a JSON object, got {type(data).__name__}")
        version = data.get("format")
        if version not in READ_FORMATS or isinstance(version, bool):
            raise ManifestError(
                f"manifest format {version!r} is not supported by this flare (it reads formats "
                f"{', '.join(map(str, READ_FORMATS))}); re-export the package with this flare"
            )
        # draft_head and blocks are optional: a package without them reads as before.
        optional = {"draft_head": None, "blocks": None, "dequantized": None}
        if version < 3 and ("blocks" in data or "dequantized" in data):
            raise ManifestError(f"manifest format {version} cannot have blocks (format 3 added them)")
        _check_keys({**optional, **data}, {"format", "model", "serving", "sampling", "files", *optional}, "manifest")
        dequantized = data.get("dequantized") or {}
        if not isinstance(dequantized, dict) or not all(isinstance(v, str) for v in dequantized.values()):
            raise ManifestError("manifest key 'dequantized' must map tensor names to ggml type names")
        model = data["model"]
        if not isinstance(model, dict):
            raise ManifestError("manifest key 'model' must be an object")
        _check_keys(model, {"config", "provenance"}, "model")
        files = data["files"]
        if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
            raise ManifestError("manifest key 'files' must map file names to sha256 strings")
        try:
            sampling = SamplingPolicy.from_json(data["sampling"])
        except PolicyError as error:
            raise ManifestError(f"sampling: {error}") from None
        return cls(
            model=ModelConfig.from_json(model["config"], version),
            serving=ServingConfig.from_json(data["serving"]),
            sampling=sampling,
            provenance=Provenance.from_json(model["provenance"]),
            files=dict(files),
            format=version,
            draft_head=DraftHeadInfo.from_json(data["draft_head"]) if data.get("draft_head") is not None else None,
            blocks=_blocks_from_json(data.get("blocks")),
            dequantized=dict(dequantized),
        )

    @classmethod
    def loads(cls, text: str) -> Manifest:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ManifestError(f"manifest is not valid JSON: {error}") from None
        return cls.from_json(data)


def _blocks_from_json(data: Any) -> dict[str, BlockEntry]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ManifestError(f"blocks must be an object, got {type(data).__name__}")
    entries = {}
    for name, entry in data.items():
        values = _fields_of(BlockEntry, entry, f"blocks.{name}")
        try:
            entries[name] = BlockEntry(**values)
        except ManifestError as error:
            raise ManifestError(f"blocks.{name}: {error}") from None
    return entries


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


def auto_activations(weight_types: Iterable[str]) -> str:
    """What `--activations auto` multiplies a package's blocks by, from its block types (ggml
    names): int8x2 where K-quant blocks are among them (a Q4_K_M file), float32 otherwise. Both
    meet issue 38's fidelity bar; int8x2 is the faster on K types from one row to 64, but on the
    32-value types (the default package's Q4_1 and Q8_0) slower than float32 at the 1-5 rows of
    decode (docs/benchmarks.md, "Integer K-quant products" and "Quantized linear layers")."""
    return "int8x2" if set(K_QUANT_TYPES) & set(weight_types) else "float32"
