"""What a GGUF file's metadata and tensor names mean for each model family flare serves.

llama.cpp's converter (convert_hf_to_gguf.py and its `conversion/` modules) writes every family
under `{arch}.*` keys and `blk.{i}.*` tensor names (gguf-py's constants.py, MODEL_TENSORS). This
module reads them back as a `ModelConfig` and as a plan mapping each GGUF tensor onto the
package's canonical names (Hugging Face Llama's, `package.expected_weight_shapes`):

- Rows of q and k are permuted by the converter for arch `llama` only (LlamaModel.permute: its
  RoPE pairs adjacent dimensions); the NEOX-RoPE families (qwen2, qwen3, gemma2, gemma3, phi3)
  are written in Hugging Face order. Mistral's Hugging Face checkpoints are written as `llama`.
- Phi-3's fused `attn_qkv` (q, then k, then v rows) and `ffn_up` of 2 x feed_forward_length
  rows (gate, then up: Phi3MLP's `chunk(2)`) are split into Llama's tensors.
- Gemma's norms already hold `1 + w` (the converter adds 1 to every `*norm.weight`); its
  embedding scale sqrt(hidden), GELU-tanh and sandwich norms are implied by the architecture.
- The tensors `rope_freqs` (Llama 3.1's llama3 scaling as per-frequency divisors) and
  `rope_factors_long` / `rope_factors_short` (Phi-3's longrope) are RoPE parameters, not weights.
- Mixture-of-experts (`qwen2moe`, `qwen3moe`, and `llama` with `expert_count`: Mixtral): a layer
  with `ffn_gate_inp` (the router) is a MoE layer; its experts are 3-D tensors, one block set
  per expert, `ffn_{gate,up,down}_exps` [E, out, in] (or the converter's optional fused
  `ffn_gate_up_exps`), the shared expert `ffn_{gate,up,down}_shexp` and its gate
  `ffn_gate_inp_shexp` (Qwen2-MoE). Gate and up are fused per expert into the package's
  `mlp.experts.gate_up_proj` (`fused_expert_names`). llama.cpp renormalizes the top-k weights
  for qwen3moe and llama, not for qwen2moe (`expert_weights_norm` where a file gives it), and
  runs every layer of these files as MoE (the converter refuses Qwen's dense `mlp_only_layers`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from flare.package.directory import layers_held
from flare.package.family_tensors import FAMILY_TENSORS
from flare.package.manifest import MAX_CONTEXT, MAX_CONTEXT_REASON
from flare.package.model_config import ARCHITECTURES, LatentAttention, ManifestError, ModelConfig, RopeScaling
from flare.preparation.source import SourceError

# general.architecture -> ModelConfig.architecture. Mistral's converter output is `llama`.
GGUF_ARCHITECTURES = {
    "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3",
    "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "deepseek2": "deepseek2",
}
# llama.cpp's norm_w of `build_moe_ffn` per architecture (src/models/*.cpp): whether the top-k
# weights are divided by their sum; `{arch}.expert_weights_norm` overrides it where given.
_MOE_NORMALIZED = {"llama": True, "qwen2moe": False, "qwen3moe": True}
# The families whose converter permutes q/k rows (and biases) for llama.cpp's adjacent-pair RoPE.
PERMUTED_ARCHITECTURES = frozenset({"llama"})
_GEMMA = frozenset({"gemma2", "gemma3"})
# llama.cpp's default sliding-window pattern per family (llama_model_*::load_arch_hparams): in
# every run of n layers the last attends globally, the rest within the window (gpt-oss: the
# even layers slide, as its Hugging Face config's default layer_types).
_GEMMA_SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6, "gpt-oss": 2}
# gpt-oss's SwiGLU limit: llama.cpp's constant (LLM_FFN_SWIGLU_OAI_MOE), which no key carries.
_GPT_OSS_SWIGLU_LIMIT = 7.0
# The layer count of Gemma 2/3 27B, whose attention scale is 1/sqrt(hidden / heads) rather than
# 1/sqrt(head_dim): llama.cpp infers it from the layer count, as gemma_pytorch's config does;
# Hugging Face names it query_pre_attn_scalar, which a GGUF does not carry.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}

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
    # Mixture-of-experts layers (`_moe_fields`); gate and up of the experts fused afterwards.
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
# gpt-oss's own: its norm before the MLP is written as `post_attention_norm` (Gemma's sandwich
# norm's name elsewhere), and its sinks, one per head, as a weight.
_GPT_OSS_NAMES = {"post_attention_norm": "post_attention_layernorm.weight", "attn_sinks": "self_attn.sinks"}
# The newer converter writes kv_b_proj as two per-head tensors, for llama.cpp's absorbed MLA:
# attn_k_b [heads, kv_lora_rank, nope] (each head's key block transposed) and attn_v_b [heads,
# v_head_dim, kv_lora_rank]; export joins them back into kv_b_proj (`TensorPlan.latent_part`).
LATENT_UP_PROJECTIONS = ("attn_k_b", "attn_v_b")
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_EXPERT_TENSOR = re.compile(r"blk\.\d+\.(ffn_gate_inp|\w+_exps?|\w+_shexp)\.")


class Metadata(Protocol):
    def get(self, key: str, default: Any = None) -> Any: ...

    def require(self, key: str) -> Any: ...


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
    # (`hf_families.deinterleaved_row_order`); which of attn_k_b / attn_v_b the tensor is.
    rope_rows: tuple[int, int, int] | None = None
    latent_part: str | None = None


def served_architecture(path: Path, architecture: Any) -> str:
    """The ModelConfig architecture of a GGUF `general.architecture`; SourceError for one flare does not serve."""
    if isinstance(architecture, str) and architecture in GGUF_ARCHITECTURES:
        return GGUF_ARCHITECTURES[architecture]
    served = ", ".join(GGUF_ARCHITECTURES)
    raise SourceError(
        f"{path}: GGUF architecture {architecture!r} is not served; flare serves {served} "
        f"(Mistral and Mixtral are written as 'llama'; as a package: {', '.join(ARCHITECTURES)})"
    )


def model_config(
    path: Path,
    metadata: Metadata,
    shapes: Mapping[str, tuple[int, ...]],
    rope_tensors: Mapping[str, Sequence[float]],
) -> ModelConfig:
    """The ModelConfig of a GGUF: its `{arch}.*` metadata, the tensors present (`shapes`, GGUF
    names, [out, in]) and the values of its RoPE tensors (`rope_tensors`)."""
    gguf_arch = metadata.require("general.architecture")
    architecture = served_architecture(path, gguf_arch)
    keys = _Keys(path, metadata, gguf_arch)
    moe = _moe_fields(path, keys, gguf_arch, shapes)
    if gguf_arch == "llama" and moe:
        architecture = "mixtral"  # Mixtral is written as arch `llama` with experts
    hidden = keys.integer("embedding_length")
    heads = keys.integer("attention.head_count")
    head_dim = keys.maybe_integer("attention.key_length")
    if head_dim is None and gguf_arch in PERMUTED_ARCHITECTURES:
        # Older Llama files name the head dimension only as the rotary dimension (always all of it).
        head_dim = keys.maybe_integer("rope.dimension_count")
    if head_dim is None:
        head_dim = hidden // heads
    latent = _latent_attention(keys) if gguf_arch == "deepseek2" else None
    if latent is not None:
        head_dim = latent.qk_head_dim
    value_dim = keys.maybe_integer("attention.value_length")
    if latent is None and value_dim is not None and value_dim != head_dim:
        raise SourceError(
            f"{path}: {gguf_arch}.attention.value_length {value_dim} differs from the key length {head_dim}; "
            "flare's attention needs one head dimension for keys and values"
        )
    rotary = keys.maybe_integer("rope.dimension_count")
    if rotary is not None and (rotary > head_dim or rotary % 2):
        raise SourceError(
            f"{path}: {gguf_arch}.rope.dimension_count {rotary} must be even and at most the head dimension {head_dim}"
        )
    num_layers = keys.integer("block_count")
    # Before anything is built per layer: a claim of millions costs nothing.
    held = layers_held(shapes, _LAYER_TENSOR)
    if num_layers > held:
        raise SourceError(
            f"{path}: the file claims {num_layers} layers ({gguf_arch}.block_count) but holds tensors for {held}"
        )
    context = keys.integer("context_length")
    if context > MAX_CONTEXT:
        raise SourceError(
            f"{path}: the GGUF metadata key {gguf_arch}.context_length is {context}, beyond the longest context "
            f"flare serves, {MAX_CONTEXT} tokens ({MAX_CONTEXT_REASON})"
        )
    rope_theta = keys.number("rope.freq_base", default=10000.0)
    gemma = gguf_arch in _GEMMA
    gpt_oss = gguf_arch == "gpt-oss"
    family = FAMILY_TENSORS[architecture]
    window, sliding_layers = _sliding_windows(keys, gguf_arch, num_layers)
    local_theta = keys.maybe_number("rope.freq_base_swa") if sliding_layers else None
    if gguf_arch == "gemma3" and sliding_layers and local_theta is None:
        local_theta = 10000.0  # llama.cpp's rope_freq_base_train_swa default, Gemma 3's local base
    elif gguf_arch != "gemma3" and local_theta == rope_theta:
        # The same RoPE as the global layers (Gemma 3's local layers differ even then: unscaled).
        local_theta = None
    attention_scale = keys.maybe_number("attention.scale")
    rope_scaling = _rope_scaling(keys, context, rotary or head_dim, rope_tensors, truncate=not gpt_oss)
    if latent is not None:
        attention_scale, rope_scaling = _latent_scales(keys, latent, rope_scaling)
    if attention_scale is None and gemma:
        scalar = hidden // heads if num_layers == _GEMMA_27B_LAYERS[gguf_arch] else head_dim
        attention_scale = scalar**-0.5
    attention_softcap = final_softcap = None
    if gguf_arch == "gemma2":
        # llama.cpp's defaults (llama-hparams.h) where a Gemma 2 file leaves the keys out.
        attention = keys.maybe_number("attn_logit_softcapping", allow_zero=True)
        final = keys.maybe_number("final_logit_softcapping", allow_zero=True)
        attention_softcap = (50.0 if attention is None else attention) or None  # 0: none
        final_softcap = (30.0 if final is None else final) or None
    elif gguf_arch == "gemma3":
        final_softcap = keys.maybe_number("final_logit_softcapping", allow_zero=True) or None
    tokens = metadata.require("tokenizer.ggml.tokens")
    eos_token = keys.token("tokenizer.ggml.eos_token_id")
    if eos_token is None:
        raise keys._missing("tokenizer.ggml.eos_token_id")
    eos = [eos_token]
    # llama.cpp ends generation on eos, eot and eom (Llama 3.1's <|eom_id|>, after a tool call).
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        token = keys.token(key)
        if token is not None and token not in eos:
            eos.append(token)
    layer0 = "blk.0."
    try:
        return ModelConfig(
            vocab_size=keys.maybe_integer("vocab_size") or len(tokens),
            hidden_size=hidden,
            intermediate_size=keys.integer("feed_forward_length"),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=heads if latent is not None else keys.maybe_integer("attention.head_count_kv") or heads,
            head_dim=head_dim,
            rope_theta=rope_theta,
            rms_norm_eps=keys.number("attention.layer_norm_rms_epsilon"),
            max_position_embeddings=context,
            tie_word_embeddings="output.weight" not in shapes,
            bos_token_id=keys.token("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(eos),
            architecture=architecture,
            attention_bias=(
                any(f"{layer0}{n}.bias" in shapes for n in ("attn_q", "attn_qkv"))
                if family.attention_bias is None
                else family.attention_bias
            ),
            qk_norm=family.qk_norm,
            rotary_dim=None if rotary is None or rotary == head_dim else rotary,
            rope_scaling=rope_scaling,
            sliding_window=window,
            sliding_layers=sliding_layers,
            local_rope_theta=local_theta,
            attention_scale=attention_scale,
            attention_softcap=attention_softcap,
            final_logit_softcap=final_softcap,
            sandwich_norms=family.sandwich_norms,
            embedding_scale=math.sqrt(hidden) if gemma else 1.0,
            hidden_activation="gelu_tanh" if gemma else "clamped_swiglu" if gpt_oss else "silu",
            swiglu_limit=_GPT_OSS_SWIGLU_LIMIT if gpt_oss else None,
            attention_output_bias=gpt_oss and f"{layer0}attn_output.bias" in shapes,
            attention_sinks=gpt_oss,
            latent_attention=latent,
            **moe,
        )
    except ManifestError as error:
        raise SourceError(f"{path}: its metadata does not describe a model flare can serve: {error}") from None


def _moe_fields(path: Path, keys: _Keys, gguf_arch: str, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """The mixture-of-experts fields of `ModelConfig` (none without `expert_count`): the layers
    holding a router (`ffn_gate_inp`), llama.cpp's routing of the architecture (softmax, top
    `expert_used_count`, `_MOE_NORMALIZED`), the experts' width (`expert_feed_forward_length`, or
    `feed_forward_length` as Mixtral's files give it) and the shared expert's."""
    experts = keys.metadata.get(keys._key("expert_count"))
    if not experts:  # absent or 0: a dense model
        return {}
    experts = keys.integer("expert_count")
    if gguf_arch == "gpt-oss":
        # llama.cpp's openai-moe graph: every layer MoE, softmax over the top-k logits
        # (SOFTMAX_WEIGHT), the router's and the experts' biases.
        return {
            "num_experts": experts,
            "num_experts_per_tok": keys.integer("expert_used_count"),
            "moe_intermediate_size": keys.maybe_integer("expert_feed_forward_length") or keys.integer("feed_forward_length"),
            "moe_layers": tuple(range(keys.integer("block_count"))),
            "routing": "topk_softmax",
            "router_bias": "blk.0.ffn_gate_inp.bias" in shapes,
            "expert_bias": "blk.0.ffn_down_exps.bias" in shapes,
        }
    if gguf_arch == "deepseek2":
        return _deepseek_moe_fields(keys, experts, shapes)
    if gguf_arch not in _MOE_NORMALIZED:
        raise SourceError(f"{path}: {gguf_arch}.expert_count is {experts}, but flare serves experts only in {', '.join(_MOE_NORMALIZED)} files")
    gating = keys.metadata.get(keys._key("expert_gating_func"))
    if gating not in (None, 1):  # LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise keys._bad(keys._key("expert_gating_func"), gating, "1 (softmax), the gating these families use")
    normalize = keys.metadata.get(keys._key("expert_weights_norm"))
    layers = sorted(int(m.group(1)) for name in shapes if (m := re.fullmatch(r"blk\.(\d+)\.ffn_gate_inp\.weight", name)))
    if not layers:
        raise SourceError(f"{path}: {gguf_arch}.expert_count is {experts} but no layer holds a router (ffn_gate_inp)")
    shared = keys.maybe_integer("expert_shared_feed_forward_length") if "blk.0.ffn_down_shexp.weight" in shapes else None
    return {
        "num_experts": experts,
        "num_experts_per_tok": keys.integer("expert_used_count"),
        "moe_intermediate_size": keys.maybe_integer("expert_feed_forward_length") or keys.integer("feed_forward_length"),
        "moe_layers": tuple(layers),
        "routing": "softmax",
        "norm_topk_prob": _MOE_NORMALIZED[gguf_arch] if normalize is None else bool(normalize),
        "shared_expert_intermediate_size": shared or 0,
        "shared_expert_gate": bool(shared) and "blk.0.ffn_gate_inp_shexp.weight" in shapes,
    }


def _deepseek_moe_fields(keys: _Keys, experts: int, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """deepseek2's experts (llama.cpp's llama_model_deepseek2): the layers with a router (those
    from leading_dense_block_count on); sigmoid gating (V3) is group routing with the correction
    bias `exp_probs_b`; softmax (V2, llama.cpp's default for the arch) is group-limited where the
    file has groups of which fewer are used, greedy otherwise; `expert_weights_scale` and
    `expert_weights_norm` (off unless given); the shared experts one MLP of expert_shared_count
    experts' width."""
    layers = sorted(int(m.group(1)) for name in shapes if (m := re.fullmatch(r"blk\.(\d+)\.ffn_gate_inp\.weight", name)))
    if not layers:
        return {}  # every layer dense: the expert keys describe none
    gating = keys.metadata.get(keys._key("expert_gating_func"))
    if gating not in (None, 1, 2):  # softmax, sigmoid
        raise keys._bad(keys._key("expert_gating_func"), gating, "1 (softmax) or 2 (sigmoid), DeepSeek's gatings")
    groups = keys.maybe_integer("expert_group_count") or 1
    used_groups = keys.maybe_integer("expert_group_used_count") or groups
    width = keys.integer("expert_feed_forward_length")
    sigmoid = gating == 2
    grouped = sigmoid or used_groups < groups
    scale = keys.maybe_number("expert_weights_scale")
    return {
        "num_experts": experts,
        "num_experts_per_tok": keys.integer("expert_used_count"),
        "moe_intermediate_size": width,
        "moe_layers": tuple(layers),
        "routing": "sigmoid_group" if sigmoid else "softmax_group_max" if grouped else "softmax",
        "norm_topk_prob": bool(keys.metadata.get(keys._key("expert_weights_norm"), False)),
        "routed_scaling_factor": 1.0 if scale is None else scale,
        "n_group": groups if grouped else 1,
        "topk_group": used_groups if grouped else 1,
        "shared_expert_intermediate_size": (keys.maybe_integer("expert_shared_count") or 0) * width,
    }


# The package's per-expert gate and up (3-D, as the GGUF holds them), fused per expert into
# `mlp.experts.gate_up_proj.weight` by `fused_expert_names`.
EXPERT_GATE, EXPERT_UP, EXPERT_GATE_UP = "mlp.experts.gate_proj.weight", "mlp.experts.up_proj.weight", "mlp.experts.gate_up_proj.weight"


def fused_expert_names(names: Sequence[str]) -> dict[str, tuple[str, str]]:
    """The package tensor `mlp.experts.gate_up_proj.weight` of each layer among `names` that has
    both `mlp.experts.gate_proj.weight` and `up_proj.weight`: (gate, up), to be joined per expert;
    the same of their biases (`.bias`, gpt-oss's [E, I] each)."""
    present = set(names)
    fused = {}
    for suffix in ("weight", "bias"):
        gate_name, up_name = EXPERT_GATE.replace("weight", suffix), EXPERT_UP.replace("weight", suffix)
        for name in names:
            if name.endswith(f".{gate_name}"):
                prefix = name.removesuffix(gate_name)
                if prefix + up_name in present:
                    fused[prefix + EXPERT_GATE_UP.replace("weight", suffix)] = (name, prefix + up_name)
    return fused


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
        match = _LAYER_TENSOR.fullmatch(gguf_name)
        if gguf_arch == "gpt-oss" and match is not None and match.group(2) in _GPT_OSS_NAMES:
            plans[gguf_name] = TensorPlan((TensorPart(f"model.layers.{match.group(1)}.{_GPT_OSS_NAMES[match.group(2)]}", 0, rows),))
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
        for gguf_kind, package in _GPT_OSS_NAMES.items():
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
        return f" (a mixture-of-experts tensor: flare serves experts in {', '.join(_MOE_NORMALIZED)} files with expert_count)"
    return ""


def _latent_attention(keys: _Keys) -> LatentAttention:
    """deepseek2's MLA shapes: the converter writes the latent as an MQA head (key_length
    kv_lora_rank + rope, value_length kv_lora_rank) and the per-head shapes as key_length_mla
    (nope + rope) and value_length_mla; files before those keys have the per-head ones in
    key_length / value_length. V2-Lite has no q_lora_rank (a plain attn_q)."""
    rope = keys.integer("rope.dimension_count")
    key_mla = keys.maybe_integer("attention.key_length_mla")
    value_mla = keys.maybe_integer("attention.value_length_mla")
    if key_mla is None or value_mla is None:
        key_mla, value_mla = keys.integer("attention.key_length"), keys.integer("attention.value_length")
    if key_mla <= rope:
        raise SourceError(f"{keys.path}: the MLA key length {key_mla} must exceed the rope dimensions {rope}")
    try:
        return LatentAttention(
            q_lora_rank=keys.maybe_integer("attention.q_lora_rank"),
            kv_lora_rank=keys.integer("attention.kv_lora_rank"),
            qk_nope_head_dim=key_mla - rope,
            qk_rope_head_dim=rope,
            v_head_dim=value_mla,
        )
    except ManifestError as error:
        raise SourceError(f"{keys.path}: {error}") from None


def _latent_scales(keys: _Keys, latent: LatentAttention, scaling: RopeScaling | None) -> tuple[float, RopeScaling | None]:
    """MLA's softmax scale and RoPE scaling from a deepseek2 file.

    The converter writes yarn's mscale_all_dim m as `rope.scaling.yarn_log_multiplier` = 0.1 m
    (and not yarn's mscale): the softmax scale is (nope + rope)^-0.5 mscale^2 with mscale =
    1 + 0.1 m ln(factor) (transformers' `yarn_apply_mscale`), and the factor on cos/sin is
    mscale(factor, mscale) / mscale(factor, m), 1 for DeepSeek's releases (mscale = m), which is
    what llama.cpp computes too. Without the key, yarn's own default."""
    scale = latent.qk_head_dim**-0.5
    log_mul = keys.maybe_number("rope.scaling.yarn_log_multiplier", allow_zero=True)
    if scaling is None or scaling.kind != "yarn" or log_mul is None:
        return scale, scaling
    mscale = 1.0 + log_mul * math.log(scaling.factor) if scaling.factor > 1 else 1.0
    attention = keys.maybe_number("rope.scaling.yarn_attn_factor")
    return scale * mscale * mscale, dataclasses.replace(scaling, attention_factor=1.0 if attention is None else attention)


class _Keys:
    """Typed reads of `{arch}.*` keys, each error naming the key."""

    def __init__(self, path: Path, metadata: Metadata, arch: str) -> None:
        self.path, self.metadata, self.arch = path, metadata, arch

    def _key(self, name: str) -> str:
        return name if name.startswith(("tokenizer.", "general.")) else f"{self.arch}.{name}"

    def _missing(self, key: str) -> SourceError:
        return SourceError(f"{self.path} lacks the GGUF metadata key {key}; it cannot be exported")

    def _bad(self, key: str, value: Any, wanted: str) -> SourceError:
        return SourceError(f"{self.path}: the GGUF metadata key {key} must be {wanted}, found {value!r}")

    def integer(self, name: str) -> int:
        """A required positive integer."""
        value = self.maybe_integer(name)
        if value is None:
            raise self._missing(self._key(name))
        return value

    def maybe_integer(self, name: str) -> int | None:
        """A positive integer, or None where the key is absent."""
        key = self._key(name)
        value = self.metadata.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise self._bad(key, value, "one positive integer")
        return value

    def token(self, key: str) -> int | None:
        """A token id, or None where the key is absent."""
        value = self.metadata.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise self._bad(key, value, "a token id")
        return value

    def number(self, name: str, *, default: float | None = None) -> float:
        """A positive number; `default` where the key is absent (required without one)."""
        value = self.maybe_number(name)
        if value is not None:
            return value
        if default is None:
            raise self._missing(self._key(name))
        return default

    def maybe_number(self, name: str, *, allow_zero: bool = False) -> float | None:
        """A positive (or, with allow_zero, non-negative) number, or None where the key is absent."""
        key = self._key(name)
        value = self.metadata.get(key)
        if value is None:
            return None
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value < 0
            or (value == 0 and not allow_zero)
        ):
            raise self._bad(key, value, "a positive number")
        return decimal_of_float32(value)


def decimal_of_float32(value: float) -> float:
    """The shortest decimal that names the float32 `value`: what the converter was given.

    GGUF stores these keys and RoPE factors as float32, so Hugging Face's rms_norm_eps 1e-06 is
    read back as 9.99999997e-07; the shortest decimal that rounds to the same float32 is the
    number written in config.json (1e-06), which the Hugging Face export of the same checkpoint
    holds too. Phi-3's longrope factors are such numbers; Llama 3.1's rope_freqs, computed by the
    converter, are kept as stored."""
    return float(str(np.float32(value)))


def _sliding_windows(keys: _Keys, arch: str, num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """The sliding window and the layers it applies to.

    Gemma 2 always slides (window 4096 unless given, every other layer); Gemma 3 where the file
    gives a window (5 local : 1 global); any other family where the file gives a window, on every
    layer (Hugging Face's Mistral and Phi-3 apply `sliding_window` to all layers; llama.cpp ignores
    Phi-3's). `attention.sliding_window_pattern` overrides the family's pattern: a count n (in
    each n layers the last is global; 0: all slide) or one boolean per layer (true: slides).
    """
    key = keys._key("attention.sliding_window")
    window = keys.metadata.get(key)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise keys._bad(key, window, "a non-negative integer")
    if arch == "gemma2" and window is None:
        window = 4096  # llama.cpp's default for Gemma 2
    if not window:
        return None, ()
    pattern_key = keys._key("attention.sliding_window_pattern")
    pattern = keys.metadata.get(pattern_key)
    if pattern is None:
        pattern = _GEMMA_SLIDING_PATTERN.get(arch, 0)
    if isinstance(pattern, list):
        if len(pattern) != num_layers or not all(isinstance(p, bool) for p in pattern):
            raise keys._bad(pattern_key, pattern, f"a count or {num_layers} booleans (one per layer)")
        return window, tuple(i for i, slides in enumerate(pattern) if slides)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 0:
        raise keys._bad(pattern_key, pattern, f"a count or {num_layers} booleans (one per layer)")
    # llama_hparams::set_swa_pattern: layer i slides when n == 0 or i % n < n - 1.
    layers = tuple(i for i in range(num_layers) if pattern == 0 or i % pattern < pattern - 1)
    return (window, layers) if layers else (None, ())


def _rope_scaling(
    keys: _Keys, context: int, rotary_dims: int, rope_tensors: Mapping[str, Sequence[float]], *, truncate: bool = True
) -> RopeScaling | None:
    """RoPE scaling from `rope.scaling.*` and the RoPE tensors.

    - `rope_freqs` (Llama 3.1+): each frequency's divisor, RopeScaling kind "factors".
    - `rope_factors_long` / `rope_factors_short` (Phi-3): longrope, with factor = context /
      `rope.scaling.original_context_length` as transformers computes it; the converter writes
      `rope.scaling.attn_factor` always, as sqrt(1 + ln(factor) / ln(original)) in float32: that
      default is left implicit (None), a different value kept.
    - `rope.scaling.type` linear (`rope.scaling.factor`) or yarn (factor, original context,
      `yarn_beta_fast`, `yarn_beta_slow`, `yarn_attn_factor`, with their common defaults);
      `truncate` False for gpt-oss, whose model (transformers' config, OpenAI's reference) keeps
      the ramp's ends unrounded where llama.cpp's ggml_rope_yarn_corr_dims rounds them.
    """
    pairs = rotary_dims // 2
    for name, values in rope_tensors.items():
        if len(values) != pairs or not all(math.isfinite(v) and v > 0 for v in values):
            raise SourceError(
                f"{keys.path}: the tensor {name} must hold {pairs} positive factors (one per rotary frequency), "
                f"it holds {len(values)}"
                + ("" if len(values) != pairs else " with a zero, negative or non-finite one")
            )
    if "rope_freqs.weight" in rope_tensors:
        return RopeScaling(kind="factors", short_factor=tuple(rope_tensors["rope_freqs.weight"]))
    kind_key = keys._key("rope.scaling.type")
    kind = keys.metadata.get(kind_key)
    has_longrope = "rope_factors_long.weight" in rope_tensors or "rope_factors_short.weight" in rope_tensors
    if has_longrope or kind == "longrope":
        missing = [n for n in ("rope_factors_long.weight", "rope_factors_short.weight") if n not in rope_tensors]
        if missing:
            raise SourceError(f"{keys.path}: longrope RoPE scaling needs the tensors rope_factors_long and rope_factors_short; {missing[0]} is missing")
        original = keys.integer("rope.scaling.original_context_length")
        factor = context / original
        attention = keys.maybe_number("rope.scaling.attn_factor")
        implied = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        if attention is not None and abs(attention - implied) <= 1e-6 * implied:
            attention = None
        return RopeScaling(
            kind="longrope",
            factor=factor,
            original_max_position_embeddings=original,
            attention_factor=attention,
            short_factor=tuple(decimal_of_float32(v) for v in rope_tensors["rope_factors_short.weight"]),
            long_factor=tuple(decimal_of_float32(v) for v in rope_tensors["rope_factors_long.weight"]),
        )
    linear = keys.maybe_number("rope.scale_linear")  # the key before rope.scaling.*
    if kind in (None, "none"):
        return None if linear in (None, 1.0) else RopeScaling(kind="linear", factor=linear)
    if kind == "linear":
        return RopeScaling(kind="linear", factor=keys.number("rope.scaling.factor"))
    if kind == "yarn":
        # Absent keys take the values llama.cpp and transformers both default to: beta_fast 32,
        # beta_slow 1, attention factor 0.1 ln(factor) + 1 (the converter copies a given one).
        factor = keys.number("rope.scaling.factor")
        attention = keys.maybe_number("rope.scaling.yarn_attn_factor")
        return RopeScaling(
            kind="yarn",
            factor=factor,
            original_max_position_embeddings=keys.integer("rope.scaling.original_context_length"),
            beta_fast=keys.number("rope.scaling.yarn_beta_fast", default=32.0),
            beta_slow=keys.number("rope.scaling.yarn_beta_slow", default=1.0),
            attention_factor=attention if attention is not None else (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0),
            truncate=truncate,
        )
    raise keys._bad(kind_key, kind, "none, linear, yarn or longrope (the RoPE scalings flare implements)")
