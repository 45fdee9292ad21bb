"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a latent KV cache.

With x a token's normalized hidden state, H heads, n = qk_nope_head_dim, r = qk_rope_head_dim,
c = kv_lora_rank, v = v_head_dim (transformers' `DeepseekV3Attention`):

    q          = q_b(RMSNorm(q_a(x)))  (or q_proj(x))      [H, n + r] = [q_nope | q_rope]
    [l | k_r]  = kv_a(x),  l = RMSNorm(l)                 latent [c], rope key [r], one per token
    [k_nope_h | v_h] = kv_b_h l                            per head: W_uk_h [n, c], W_uv_h [v, c]
    score_h(t, s) = scale * (q_nope_h(t) . k_nope_h(s) + RoPE(q_rope_h)(t) . RoPE(k_r)(s))
    out_h(t)   = sum_s softmax_s(score_h(t, s)) v_h(s),   o_proj(concat_h out_h)

The cache keeps, per token per layer, [l | RoPE(k_r)] (c + r numbers, `ModelConfig.kv_layout`)
instead of H keys and values of n + r and v: everything a head needs is a linear function of l.

Absorbed form (decode): q_nope_h . (W_uk_h l) = (W_uk_h^T q_nope_h) . l, so with the query moved
into latent space, q_lat_h = W_uk_h^T q_nope_h [c], the score is scale * ([q_lat_h | q_rope_h] .
[l | k_r]): one-KV-head attention whose key is the cached row as it is, and
out_h = W_uv_h (sum_s p_h(s) l(s)): the values are the keys' latent prefix, up-projected once
after the weighted sum. A decode step then reads c + r numbers per cached token and multiplies
nothing per cached token but the dot products.

Decompressed form (prefill): k_nope and v of every cached token through kv_b (one GEMM), then
ordinary attention with heads of n + r keys and v values. For a chunk of Q queries over L keys
it costs L c H (n + v) for the expansion and Q L H (n + r + v) for attention, against
Q L H (2c + r) absorbed: absorbed wins for short rows, decompressed for prompt chunks
(`absorbed_for`).

RoPE: DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ...; export permutes the rope
rows of q and kv_a into rotate-half order (`preparation/families/deepseek.py`'s
`deinterleave_rope_rows`), which gives the same dot products, so the rotation here is
`rope.apply_rope` as for every family.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flare.engine import native
from flare.engine.batch import SHORT_ROW_MAX_TOKENS, AttentionGroup, ForwardBatch
from flare.engine.layers.rope import apply_rope
from flare.engine.linear import Weight, linear
from flare.package.model_config import ModelConfig


@dataclass(frozen=True)
class LatentWeights:
    """One layer's latent-attention weights (o_proj aside, which `DecoderLayer.o` holds).

    `q_a_kv_a`: q_a and kv_a stacked on their outputs ([q_lora_rank + c + r, hidden]: both read
    x, one GEMM), or kv_a alone where the model has a plain q_proj (`q`). `q`: q_b, or q_proj.
    `kv_b` [H (n + v), c] for the decompressed form; `k_up` [H, n, c] and `v_up` [H, v, c] are
    its per-head key and value blocks for the absorbed one.
    """

    q_a_kv_a: Weight
    q_a_norm: torch.Tensor | None
    q: Weight
    kv_a_norm: torch.Tensor
    kv_b: Weight
    k_up: torch.Tensor
    v_up: torch.Tensor


def absorbed_for(group: AttentionGroup) -> bool:
    """Whether a call runs the absorbed form: for short rows (decode, verify), where the
    expansion of every cached token would cost more than it saves (module docstring)."""
    return group.query_len <= SHORT_ROW_MAX_TOKENS


def latent_attention(
    x: torch.Tensor,
    weights: LatentWeights,
    batch: ForwardBatch,
    config: ModelConfig,
    pool: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    *,
    absorbed: bool | None = None,
    kernels: bool = False,
) -> torch.Tensor:
    """Attention of the round's tokens x [T, hidden] over their requests' cached positions:
    writes each token's [latent | rope key] into its slot of `pool` ([1, blocks, block_size,
    c + r]) and returns the heads' outputs [T, H * v], before o_proj. `rope`: the round's cos and
    sin [T, 1, r / 2]. `absorbed`: force the absorbed (True) or decompressed (False) form; None
    picks per call (`absorbed_for`). `kernels`: the absorbed form attends straight from the pool
    (`native.paged_attention`, one KV head whose values are the keys' latent prefix) instead of
    gathering each row's cached rows."""
    latent = config.latent_attention
    assert latent is not None
    heads, n, r, c = config.num_heads, latent.qk_nope_head_dim, latent.qk_rope_head_dim, latent.kv_lora_rank
    eps = config.rms_norm_eps
    tokens = x.shape[0]
    projected = linear(x, weights.q_a_kv_a)
    if weights.q_a_norm is None:
        q, kv = linear(x, weights.q), projected
    else:
        rank = weights.q_a_norm.shape[0]
        q_a, kv = projected.split([rank, c + r], dim=-1)
        q = linear(F.rms_norm(q_a, (rank,), weights.q_a_norm, eps), weights.q)
    q_nope, q_rope = q.view(tokens, heads, n + r).split([n, r], dim=-1)
    q_rope = apply_rope(q_rope, *rope)
    cached = torch.cat(
        (F.rms_norm(kv[:, :c], (c,), weights.kv_a_norm, eps), apply_rope(kv[:, None, c:], *rope)[:, 0]), dim=-1
    )
    rows_of_pool = pool.view(-1, c + r)
    rows_of_pool.index_copy_(0, batch.slot_mapping, cached.to(pool.dtype))
    blocks = pool.view(-1, pool.shape[2], c + r)
    scale = config.attention_scale or (n + r) ** -0.5
    outputs = []
    for group in batch.groups:
        span = slice(group.start, group.end)
        use_absorbed = absorbed_for(group) if absorbed is None else absorbed
        if use_absorbed and kernels and x.dtype == torch.float32:
            outputs.append(_absorbed_from_pool(q_nope[span], q_rope[span], pool, group, weights, scale, c))
            continue
        # Each row's cached [latent | rope key] rows, its blocks in order: [rows, L, c + r].
        context = blocks.index_select(0, group.block_table.flatten()).view(group.rows, -1, c + r).to(x.dtype)
        if use_absorbed:
            out = _absorbed(q_nope[span], q_rope[span], context, group, weights, scale, c)
        else:
            out = _decompressed(q_nope[span], q_rope[span], context, group, weights, scale, config)
        outputs.append(out)
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _absorbed(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    context: torch.Tensor,
    group: AttentionGroup,
    weights: LatentWeights,
    scale: float,
    c: int,
) -> torch.Tensor:
    """One KV head over the cached rows: query [W_uk_h^T q_nope_h | q_rope_h], keys the rows,
    values their latent prefix, each head's latent output up-projected by W_uv_h."""
    tokens, heads, _ = q_nope.shape
    rows, length = group.rows, group.query_len
    # [H, T, n] @ [H, n, c] -> [H, T, c]: each head's query in latent space.
    q_latent = torch.bmm(q_nope.transpose(0, 1), weights.k_up).transpose(0, 1)
    query = torch.cat((q_latent, q_rope), dim=-1).reshape(rows, length * heads, -1)
    # Query (t, h) of a row attends as its token t does: the heads are folded into the query length.
    mask = group.mask.repeat_interleave(heads, dim=2)[:, 0]
    # Explicit products, not SDPA: with one KV head of 576 and values a strided prefix of the
    # keys, CPU SDPA takes 6x longer than these two batched GEMMs (benchmarks/latent_attention.py).
    scores = torch.bmm(query, context.transpose(1, 2)) * scale
    probabilities = torch.softmax(scores.masked_fill_(~mask, float("-inf")), dim=-1)
    latent_out = torch.bmm(probabilities, context[..., :c])
    # [H, T, c] @ [H, c, v] -> [H, T, v]
    out = torch.bmm(latent_out.reshape(tokens, heads, c).transpose(0, 1), weights.v_up.transpose(1, 2))
    return out.transpose(0, 1).reshape(tokens, -1)


def _absorbed_from_pool(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    pool: torch.Tensor,
    group: AttentionGroup,
    weights: LatentWeights,
    scale: float,
    c: int,
) -> torch.Tensor:
    """`_absorbed` with the C kernel reading the pool's blocks where they lie: the H latent
    queries [W_uk_h^T q_nope_h | q_rope_h] share the pool's one KV head, each value the first c
    numbers of its row (the latent), so no row is gathered."""
    tokens, heads, _ = q_nope.shape
    q_latent = torch.bmm(q_nope.transpose(0, 1), weights.k_up).transpose(0, 1)
    query = torch.cat((q_latent, q_rope), dim=-1).contiguous()
    latent_out = native.paged_attention(
        query, pool, pool, group.block_table, group.start_positions, group.query_len, scale=scale, value_dim=c
    )
    out = torch.bmm(latent_out.transpose(0, 1), weights.v_up.transpose(1, 2))
    return out.transpose(0, 1).reshape(tokens, -1)


def _decompressed(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    context: torch.Tensor,
    group: AttentionGroup,
    weights: LatentWeights,
    scale: float,
    config: ModelConfig,
) -> torch.Tensor:
    """Every cached token's per-head key and value through kv_b, then attention with H heads."""
    latent = config.latent_attention
    assert latent is not None
    heads, n, r, c, v = config.num_heads, latent.qk_nope_head_dim, latent.qk_rope_head_dim, latent.kv_lora_rank, latent.v_head_dim
    rows, length = group.rows, group.query_len
    keys_length = context.shape[1]
    expanded = linear(context[..., :c].reshape(-1, c), weights.kv_b).view(rows, keys_length, heads, n + v)
    k_nope, values = expanded.split([n, v], dim=-1)
    k_rope = context[..., c:].unsqueeze(2).expand(rows, keys_length, heads, r)
    keys = torch.cat((k_nope, k_rope), dim=-1).transpose(1, 2)
    query = torch.cat((q_nope, q_rope), dim=-1).view(rows, length, heads, n + r).transpose(1, 2)
    out = F.scaled_dot_product_attention(query, keys, values.transpose(1, 2), attn_mask=group.mask, scale=scale)
    return out.transpose(1, 2).reshape(rows * length, heads * v)
