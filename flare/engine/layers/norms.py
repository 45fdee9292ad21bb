"""RMSNorm where the residual stream meets a sublayer: the add + norm every layer runs twice,
and the sandwich norm Gemma 2/3 put on a sublayer's output before it joins the stream.

RMSNorm(x) = x / sqrt(mean(x^2) + eps) * weight (transformers' `LlamaRMSNorm`; Gemma's
1 + weight is folded into the stored weight at export). On a float32 CPU model that runs the
kernels, `native.add_rms_norm` does both the add and the norm in one pass over h.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flare.engine import native


def add_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, *, kernels: bool) -> torch.Tensor:
    """`h += delta` (a sublayer's output, when given), then RMSNorm of h; with `kernels`, through
    `native.add_rms_norm`, of which the torch steps are the counterpart."""
    if kernels:
        return native.add_rms_norm(h, delta, weight, eps)
    if delta is not None:
        h += delta
    return F.rms_norm(h, (h.shape[-1],), weight, eps)


def sublayer_output(delta: torch.Tensor, norm: torch.Tensor | None, eps: float, *, kernels: bool) -> torch.Tensor:
    """A sublayer's output as it joins the residual stream: RMS-normalized first where the
    layer has sandwich norms (Gemma 2/3), as it is otherwise."""
    if norm is None:
        return delta
    if kernels:  # the kernel `native_layers.decoder_layer` normalizes it with
        return native.add_rms_norm(delta.contiguous(), None, norm, eps)
    return F.rms_norm(delta, (delta.shape[-1],), norm, eps)
