"""The arithmetic gpt-oss adds to a decoder layer, as torch expressions: attention with sinks
and the clamped SwiGLU. They are the torch counterparts of `native.paged_attention(sinks=...)`
and `native.clamped_swiglu_rows`, and the references the tests hold those kernels to; each
follows transformers' gpt_oss modeling (`eager_attention_forward`, `GptOssExperts._apply_gate`).
"""

from __future__ import annotations

import torch

# transformers' GptOssConfig defaults (`swiglu_alpha`, `swiglu_limit`).
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


def attention_with_sinks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """softmax over the visible keys and one learned sink logit per head, the sink's weight
    dropped: q [..., heads, Q, D], k and v [..., heads, L, D] (or broadcastable to them), mask
    bool [..., Q, L] (True: visible), sinks [heads]. Returns [..., heads, Q, D].

    With s_k = scale q . k_k and z the head's sink, m = max(z, max_k s_k):
        p_k = exp(s_k - m) / (exp(z - m) + sum_k' exp(s_k' - m)),   out = sum_k p_k v_k
    so the weights sum to less than one and a head can attend to nothing."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).view(-1, 1, 1).expand(*scores.shape[:-1], 1)
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    weights = torch.softmax(combined, dim=-1, dtype=torch.float32)[..., :-1]
    return torch.matmul(weights.to(v.dtype), v)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT) -> torch.Tensor:
    """gpt-oss's expert activation: g' sigmoid(alpha g') (u' + 1) with g' = min(gate, limit) and
    u' = clamp(up, -limit, limit). (Its checkpoints interleave gate and up along the fused
    gate_up_proj's last axis, gate at even columns; callers split them first.)"""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(gate * alpha) * (up + 1)
