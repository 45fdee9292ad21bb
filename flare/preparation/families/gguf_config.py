"""What a GGUF file's metadata means for each model family flare serves: its `ModelConfig`.

llama.cpp's converter (convert_hf_to_gguf.py and its `conversion/` modules) writes every family
under `{arch}.*` keys and `blk.{i}.*` tensor names (gguf-py's constants.py, MODEL_TENSORS). This
module reads the keys back as a `ModelConfig` (`model_config`); gguf_tensors.py maps the tensors
onto the package's names.

- Mistral's Hugging Face checkpoints are written as `llama`, and so is Mixtral, with experts.
- Gemma's embedding scale sqrt(hidden), GELU-tanh and sandwich norms are implied by the
  architecture; its attention scale and logit softcaps take llama.cpp's defaults where absent.
- The tensors `rope_freqs` (Llama 3.1's llama3 scaling as per-frequency divisors) and
  `rope_factors_long` / `rope_factors_short` (Phi-3's longrope) are RoPE parameters, not weights.
- The experts' fields are moe.py's (`gguf_moe_fields`), DeepSeek's latent attention
  deepseek.py's (`gguf_latent_attention`, `gguf_latent_scales`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flare.package.directory import layers_held
from flare.package.family_tensors import FAMILY_TENSORS
from flare.package.manifest import MAX_CONTEXT, MAX_CONTEXT_REASON
from flare.package.model_config import ARCHITECTURES, ManifestError, ModelConfig, RopeScaling
from flare.preparation.families.deepseek import gguf_latent_attention, gguf_latent_scales
from flare.preparation.families.gguf_keys import GGUFKeys, Metadata, decimal_of_float32
from flare.preparation.families.gpt_oss import GPT_OSS_SWIGLU_LIMIT
from flare.preparation.families.moe import gguf_moe_fields
from flare.preparation.source import SourceError

# general.architecture -> ModelConfig.architecture. Mistral's converter output is `llama`.
GGUF_ARCHITECTURES = {
    "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3",
    "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "deepseek2": "deepseek2",
}
# The families whose converter permutes q/k rows (and biases) for llama.cpp's adjacent-pair RoPE.
PERMUTED_ARCHITECTURES = frozenset({"llama"})
_GEMMA = frozenset({"gemma2", "gemma3"})
# llama.cpp's default sliding-window pattern per family (llama_model_*::load_arch_hparams): in
# every run of n layers the last attends globally, the rest within the window (gpt-oss: the
# even layers slide, as its Hugging Face config's default layer_types).
_GEMMA_SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6, "gpt-oss": 2}
# The layer count of Gemma 2/3 27B, whose attention scale is 1/sqrt(hidden / heads) rather than
# 1/sqrt(head_dim): llama.cpp infers it from the layer count, as gemma_pytorch's config does;
# Hugging Face names it query_pre_attn_scalar, which a GGUF does not carry.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# A layer's tensor: blk.{i}.<kind>.<weight or bias> (gguf_tensors.py maps the kinds).
GGUF_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


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
    keys = GGUFKeys(path, metadata, gguf_arch)
    moe = gguf_moe_fields(path, keys, gguf_arch, shapes)
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
    latent = gguf_latent_attention(keys) if gguf_arch == "deepseek2" else None
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
    held = layers_held(shapes, GGUF_LAYER_TENSOR)
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
        attention_scale, rope_scaling = gguf_latent_scales(keys, latent, rope_scaling)
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
            swiglu_limit=GPT_OSS_SWIGLU_LIMIT if gpt_oss else None,
            attention_output_bias=gpt_oss and f"{layer0}attn_output.bias" in shapes,
            attention_sinks=gpt_oss,
            latent_attention=latent,
            **moe,
        )
    except ManifestError as error:
        raise SourceError(f"{path}: its metadata does not describe a model flare can serve: {error}") from None


def _sliding_windows(keys: GGUFKeys, arch: str, num_layers: int) -> tuple[int | None, tuple[int, ...]]:
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
    keys: GGUFKeys, context: int, rotary_dims: int, rope_tensors: Mapping[str, Sequence[float]], *, truncate: bool = True
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
