"""Rotary position embeddings: the cos/sin tables of every RoPE scaling a family uses, and the rotation.

A table holds cos and sin of position * inv_freq[i] for every position the model serves,
[context, rotary_dims / 2], computed in float32 as Hugging Face's rotary embeddings do
(transformers' `modeling_rope_utils.py`), so that positions match it bit for bit. A scaling
changes only inv_freq, and for yarn and longrope the factor that cos and sin are multiplied by:

- default: inv_freq[i] = theta^(-2i/d), d = the rotary dimensions;
- linear: inv_freq / factor;
- llama3: wavelengths 2 pi / inv_freq above original / low_freq_factor are divided by factor,
  those below original / high_freq_factor kept, and those between blended by
  s = (original / wavelength - low) / (high - low): (1 - s) inv_freq / factor + s inv_freq;
- yarn: a blend of inv_freq (extrapolation) and inv_freq / factor (interpolation), whose weight
  ramps linearly over the dimensions between the corrections for beta_fast and beta_slow
  rotations (its ends rounded out to whole dimensions unless `truncate` is off); cos and sin
  scaled by attention_factor;
- longrope (Phi-3): inv_freq / short_factor[i] (or long_factor), cos and sin scaled by
  attention_factor. Transformers switches to the long factors for a whole forward once its
  positions pass original_max_position_embeddings (recomputing the cache's keys is what that
  would take here); flare picks once per model, as llama.cpp does by its context size: the long
  factors where the context served exceeds the original one, the short ones otherwise;
- factors: inv_freq / factors[i] (a GGUF's `rope_freqs.weight`, llama.cpp's form of llama3).
"""

from __future__ import annotations

import math

import torch

from flare.package.model_config import ModelConfig, RopeScaling


def inverse_frequencies(theta: float, dims: int) -> torch.Tensor:
    """theta^(-2i/dims) for i < dims / 2, float32 (Hugging Face's default RoPE)."""
    return 1.0 / (theta ** (torch.arange(0, dims, 2, dtype=torch.int64).float() / dims))


def scaled_frequencies(
    scaling: RopeScaling, theta: float, dims: int, context: int
) -> tuple[torch.Tensor, float]:
    """inv_freq [dims / 2] and the cos/sin factor of one scaling (the module docstring)."""
    inv_freq = inverse_frequencies(theta, dims)
    original = scaling.original_max_position_embeddings
    if scaling.kind == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.kind == "factors":
        return inv_freq / _per_frequency(scaling.short_factor, dims, "short_factor"), 1.0
    if scaling.kind == "longrope":
        assert original is not None, "longrope needs original_max_position_embeddings"
        long = context > original
        factors = _per_frequency(scaling.long_factor if long else scaling.short_factor, dims, "long_factor" if long else "short_factor")
        shape = torch.arange(0, dims, 2, dtype=torch.int64).float() / dims
        attention = scaling.attention_factor
        if attention is None:
            attention = 1.0 if scaling.factor <= 1.0 else math.sqrt(1 + math.log(scaling.factor) / math.log(original))
        return 1.0 / (factors * theta**shape), attention
    if scaling.kind == "llama3":
        assert original is not None and scaling.low_freq_factor is not None and scaling.high_freq_factor is not None
        low, high = scaling.low_freq_factor, scaling.high_freq_factor
        wavelength = 2 * math.pi / inv_freq
        scaled = torch.where(wavelength > original / low, inv_freq / scaling.factor, inv_freq)
        smooth = (original / wavelength - low) / (high - low)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = ~(wavelength < original / high) * ~(wavelength > original / low)
        return torch.where(medium, smoothed, scaled), 1.0
    assert scaling.kind == "yarn" and original is not None, f"RoPE scaling {scaling.kind}"
    beta_fast, beta_slow = scaling.beta_fast or 32.0, scaling.beta_slow or 1.0

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength makes `rotations` turns over the original context.
        return (dims * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.truncate:  # rounded out to whole dimensions (all but gpt-oss, which keeps them exact)
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dims // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    positions = theta ** (torch.arange(0, dims, 2).float() / dims)
    blended = (1.0 / (scaling.factor * positions)) * (1 - extrapolation) + (1.0 / positions) * extrapolation
    attention = scaling.attention_factor
    if attention is None:
        attention = 1.0 if scaling.factor <= 1 else 0.1 * math.log(scaling.factor) + 1.0
    return blended, attention


def _per_frequency(values: tuple[float, ...] | None, dims: int, name: str) -> torch.Tensor:
    if values is None or len(values) != dims // 2:
        raise ValueError(f"RoPE scaling needs {dims // 2} values in {name}, got {None if values is None else len(values)}")
    return torch.tensor(values, dtype=torch.float32)


def rope_tables(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    local: bool = False,
    context: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [context, rotary_dims / 2] of the global layers, or with `local` of the
    sliding layers of a model with their own base (`local_rope_theta`, unscaled). `context`: the
    longest context served (the model's own by default), which sizes the tables, so that what a
    model declares costs nothing beyond what is served, and picks longrope's factors."""
    dims = config.rotary_dims
    served = config.max_position_embeddings if context is None else context
    if local:
        assert config.local_rope_theta is not None, "only a model with local_rope_theta has a local table"
        inv_freq, attention = inverse_frequencies(config.local_rope_theta, dims), 1.0
    elif config.rope_scaling is None:
        inv_freq, attention = inverse_frequencies(config.rope_theta, dims), 1.0
    else:
        inv_freq, attention = scaled_frequencies(config.rope_scaling, config.rope_theta, dims, served)
    positions = torch.arange(served, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    return (angles.cos() * attention).to(device, dtype), (angles.sin() * attention).to(device, dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (the Hugging Face layout): x [T, heads, D], cos/sin [T, 1, R/2].

    The leading R = 2 * cos.shape[-1] dimensions of each head are rotated, the rest pass through
    (partial rotary). With those R split in halves x1, x2: (x1 cos - x2 sin, x2 cos + x1 sin).
    """
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    rotated = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
    if 2 * half == x.shape[-1]:
        return torch.cat(rotated, dim=-1)
    return torch.cat((*rotated, x[..., 2 * half :]), dim=-1)


def round_tables(
    tables: list[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """cos and sin [T, 1, R/2] of a round's positions from each of `tables` (the global one, then
    the sliding layers' own where a model has one), gathered once for every layer of the round:
    what `apply_rope` takes."""
    return [(cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)) for cos, sin in tables]
