"""The gated MLP: down(act(gate(x)) * up(x)), SwiGLU (silu, Llama and most families) or GeGLU
with GELU's tanh approximation (Gemma); and gpt-oss's clamped SwiGLU (`clamped_swiglu`), its
experts' activation.

gate and up are one fused [2 * intermediate, hidden] weight (one GEMM instead of two), whose
output is taken as columns [2 * intermediate, T] (`linear_columns`): gate and up are then
contiguous halves, and the elementwise step reads them without strides.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flare.engine import native
from flare.engine.linear import Weight, linear, linear_columns


def gated_activation(gate_up_columns: torch.Tensor, activation: str, *, kernels: bool) -> torch.Tensor:
    """act(gate) * up [T, intermediate] from the gate/up layer's columns [2 * intermediate, T];
    with `kernels` through `native.gated_rows`, of which the torch steps are the counterpart."""
    if kernels:
        return native.gated_rows(gate_up_columns, activation)
    # On the columns, where gate and up are contiguous halves: on the transposed view the
    # elementwise ops would be strided.
    gate, up = gate_up_columns.chunk(2)
    if activation == "gelu_tanh":
        return (F.gelu(gate, approximate="tanh") * up).t()
    return (F.silu(gate) * up).t()


# transformers' GptOssConfig defaults (`swiglu_alpha`, `swiglu_limit`).
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


def clamped_swiglu(
    gate_up_columns: torch.Tensor, alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT, *, kernels: bool
) -> torch.Tensor:
    """gpt-oss's activation as rows [T, intermediate], from the gate/up columns as
    `gated_activation` takes them: g' sigmoid(alpha g') (u' + 1) with g' = min(g, limit) and
    u' = clamp(u, -limit, limit) (transformers' GptOssExperts._apply_gate; its checkpoints
    interleave gate and up, gate at even columns, which the export splits). With `kernels`
    through `native.clamped_swiglu_rows`."""
    if kernels:
        return native.clamped_swiglu_rows(gate_up_columns, alpha, limit)
    gate, up = gate_up_columns.chunk(2)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (gate * torch.sigmoid(gate * alpha) * (up + 1)).t()


def gated_mlp(x: torch.Tensor, gate_up: Weight, down: Weight, activation: str, *, kernels: bool) -> torch.Tensor:
    """down(act(gate(x)) * up(x)) [T, hidden] of rows x [T, hidden]: on a tensor-parallel rank,
    its partial sum (its share of the intermediate columns)."""
    return linear(gated_activation(linear_columns(x, gate_up), activation, kernels=kernels), down)
