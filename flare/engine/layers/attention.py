"""Causal attention of a round's new tokens over the paged KV cache, grouped-query, with each
family's options: q/k/v biases (Qwen2), per-head q/k RMSNorm before RoPE (Qwen3, Gemma 3),
sliding windows (Mistral, Gemma 2/3), the attention scale and soft-cap (Gemma), attention sinks
(gpt-oss: a learned logit per head in the softmax's denominator). Each matches transformers'
eager attention math.

A round's attention is planned once for every layer (`PagedAttention.plan`): one call per
attention group of the batch (batch.py: short rows of one length share a call).

- A call of short rows on a model that runs the kernels reads the pool through the group's block
  table (`native.paged_attention`): nothing is gathered.
- Otherwise keys and values are gathered from the pool a whole block at a time; the pool is
  head-major, so the gathered keys of one row and KV head form one contiguous [positions, head
  dim] matrix (SDPA reads a strided view of it much more slowly once it is out of cache).
  Grouped-query attention folds the query heads of a KV group into the query length, so K/V are
  never repeated (cheaper than SDPA's `enable_gqa`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flare.engine import native
from flare.engine.batch import SHORT_ROW_MAX_TOKENS, AttentionGroup, ForwardBatch
from flare.engine.kv_cache import KVCache
from flare.engine.layers.rope import apply_rope
from flare.package.model_config import ModelConfig


@dataclass(frozen=True)
class AttentionCall:
    """One attention call of a round (an `AttentionGroup`), with everything its layers share.

    A call of short rows on a model that runs the kernels reads the pool through the group's
    block table and start positions (`native.paged_attention`) and has no gather fields.
    Otherwise it gathers: `gather_index` lists the pool rows (head-major) of its block tables;
    `mask` is the causal mask with the query heads of a KV group folded into the query length;
    the key/value buffers (views of the attention's gather workspace) receive the gathered blocks.
    Every layer reuses them, because a fresh multi-megabyte tensor per layer costs more in page
    faults than the gather itself. `window_mask` is `mask` narrowed to the sliding window, for
    the sliding layers of a model that has them.
    """

    group: AttentionGroup
    gather_index: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    window_mask: torch.Tensor | None = None
    key_buffer: torch.Tensor | None = None
    value_buffer: torch.Tensor | None = None

    @property
    def tokens(self) -> slice:
        """The call's flat tokens: `group.rows` x `group.query_len`."""
        return slice(self.group.start, self.group.end)

    @property
    def native(self) -> bool:
        return self.gather_index is None


def window_mask(group: AttentionGroup, window: int) -> torch.Tensor:
    """The group's causal mask narrowed to a sliding window [rows, 1, query_len, keys]: key k is
    visible to the query at position p iff p - window < k <= p (transformers' sliding mask)."""
    positions = group.start_positions.view(-1, 1, 1, 1) + torch.arange(group.query_len, device=group.mask.device).view(1, 1, -1, 1)
    keys = torch.arange(group.mask.shape[-1], device=group.mask.device)
    return group.mask & (keys > positions - window)


def scores_to_output(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    *,
    scale: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(mask(cap(q k^T * scale))) v, with the model's scale (head_dim^-0.5 unless it
    sets one: Gemma's query_pre_attn_scalar^-0.5) and soft-cap. SDPA can neither soft-cap nor
    sink, so a capped model, or one with sinks, takes the explicit form, as transformers' eager
    attention computes it: scores -> cap * tanh(scores / cap) before the mask and a float32
    softmax. `sinks` (gpt-oss): each query row's sink logit z, broadcastable to the scores'
    [..., Q, 1], joins the softmax and is dropped after it,

        p_k = exp(s_k - m) / (exp(z - m) + sum_k' exp(s_k' - m)),   m = max(z, max_k s_k),

    so a head's weights sum to less than one (`native.paged_attention` computes the same)."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scale = scale or q.shape[-1] ** -0.5
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:
        combined = torch.cat([scores, sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)], dim=-1)
        weights = torch.softmax(combined, dim=-1, dtype=torch.float32)[..., :-1]
    return torch.matmul(weights.to(q.dtype), v)


def rope_and_cache(
    qkv_columns: torch.Tensor,
    batch: ForwardBatch,
    config: ModelConfig,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    kernels: bool,
    table: tuple[torch.Tensor, torch.Tensor],
    round_rope: tuple[torch.Tensor, torch.Tensor] | None,
    bias: torch.Tensor | None = None,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
) -> torch.Tensor:
    """From the q/k/v layer's columns [(heads + 2 * kv_heads) * D, T]: add the layer's `bias`,
    normalize q and k per head where it has q/k norms (before RoPE, as Qwen3 and Gemma 3 do),
    rotate them, write k and v into the round's slots of the pools, return q [T, heads, D].

    With `kernels` through `native.rope_and_cache`, reading the layer's cos/sin `table` by
    position; the torch steps are its counterpart and take the round's cos and sin already
    gathered (`round_rope`, `rope.round_tables`)."""
    heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    if kernels:
        return native.rope_and_cache(
            qkv_columns, batch.positions, batch.slot_mapping, *table, keys, values, heads,
            bias=bias, q_norm=q_norm, k_norm=k_norm, norm_eps=config.rms_norm_eps,
        )
    assert round_rope is not None, "the torch path needs the round's cos and sin (`rope.round_tables`)"
    qkv_rows = qkv_columns.t() if bias is None else qkv_columns.t() + bias
    qkv = qkv_rows.contiguous().view(batch.num_tokens, heads + 2 * kv_heads, head_dim)
    qk = qkv[:, : heads + kv_heads]
    if q_norm is not None and k_norm is not None:
        eps = config.rms_norm_eps
        qk = torch.cat(
            (F.rms_norm(qk[:, :heads], (head_dim,), q_norm, eps), F.rms_norm(qk[:, heads:], (head_dim,), k_norm, eps)),
            dim=1,
        )
    # q and k are rotated together: one pass over both.
    qk = apply_rope(qk, *round_rope)
    # The pools are [kv_heads, blocks * block_size, D] viewed flat over positions, in the
    # cache's dtype (a 16-bit pool takes k and v rounded to nearest even).
    k, v = qk[:, heads:].transpose(0, 1), qkv[:, heads + kv_heads :].transpose(0, 1)
    keys.view(kv_heads, -1, head_dim).index_copy_(1, batch.slot_mapping, k.to(keys.dtype))
    values.view(kv_heads, -1, head_dim).index_copy_(1, batch.slot_mapping, v.to(values.dtype))
    return qk[:, :heads]


class PagedAttention:
    """A model's attention over its paged KV cache: the round's plan and each layer's call.

    It owns the grow-only scratch memory the gathered keys and values of a round land in:
    allocating tens of megabytes afresh every round costs page faults on every round. It holds
    one layer's K/V of the running rows (plus padding to each group's longest context), so it
    stays around the size of one layer's share of the KV cache.
    """

    def __init__(
        self, config: ModelConfig, *, kernels: bool, window: int | None, device: torch.device, dtype: torch.dtype
    ) -> None:
        """`kernels`: short rows go to `native.paged_attention`. `window`: the one sliding window
        the model's sliding layers share, where it narrows anything."""
        self.config = config
        self.kernels = kernels
        self.window = window
        self.device = device
        self._gather_workspace = torch.empty(0, dtype=dtype, device=device)

    def plan(self, batch: ForwardBatch, kv_cache: KVCache) -> list[AttentionCall]:
        """The round's attention calls, one per attention group, built once for every layer."""
        config = self.config
        in_kernel = [self.kernels and g.query_len <= SHORT_ROW_MAX_TOKENS for g in batch.groups]
        if all(in_kernel):  # a decode round's: nothing to gather
            return [AttentionCall(group) for group in batch.groups]
        group_size = config.num_heads // config.num_kv_heads
        head_offsets = torch.arange(config.num_kv_heads, device=self.device).view(1, -1, 1) * kv_cache.num_blocks
        block_numel = kv_cache.block_size * config.head_dim
        # Block b of KV head h is row h * num_blocks + b of the pool viewed [heads * blocks, ...].
        gather_indices = [
            None if n else (g.block_table.unsqueeze(1) + head_offsets).flatten() for g, n in zip(batch.groups, in_kernel)
        ]
        needed = 2 * sum(index.numel() for index in gather_indices if index is not None) * block_numel
        if self._gather_workspace.numel() < needed or self._gather_workspace.dtype != kv_cache.dtype:
            self._gather_workspace = torch.empty(needed, dtype=kv_cache.dtype, device=self.device)
        # Two buffers (keys, values) per gathering call, carved one after another out of the workspace.
        sizes = [index.numel() * block_numel for index in gather_indices if index is not None for _ in range(2)]
        buffers = iter(self._gather_workspace[:needed].split(sizes))
        calls = []
        for group, gather_index in zip(batch.groups, gather_indices):
            if gather_index is None:
                calls.append(AttentionCall(group))
                continue
            buffer_shape = (gather_index.numel(), kv_cache.block_size, config.head_dim)
            calls.append(
                AttentionCall(
                    group=group,
                    gather_index=gather_index,
                    # Row j * query_len + q of a folded KV group attends as query q does.
                    mask=group.mask.repeat(1, 1, group_size, 1),
                    window_mask=None if self.window is None else window_mask(group, self.window).repeat(1, 1, group_size, 1),
                    key_buffer=next(buffers).view(buffer_shape),
                    value_buffer=next(buffers).view(buffer_shape),
                )
            )
        return calls

    def attend(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        calls: list[AttentionCall],
        window: int | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention of every new token over its request's cached positions, or over the
        last `window` of them (its own included) in a sliding layer: [T, heads * D]. `sinks`:
        the layer's float32 [heads] attention sinks (gpt-oss), or None.

        Short rows go to `native.paged_attention` where the model runs the kernels. The
        torch path gathers each row's blocks and runs SDPA, with grouped-query attention done
        without repeating K/V: the `group` query heads that share a KV head are folded into the
        query length, q [rows, kv_heads, group * Q, D] against k, v [rows, kv_heads, L, D],
        whose [L, D] matrices the head-major pool gathers contiguous.
        """
        scale, softcap = self.config.attention_scale, self.config.attention_softcap
        kv_heads, _, block_size, head_dim = keys.shape
        heads = q.shape[1]
        group = heads // kv_heads
        key_rows = keys.view(-1, block_size, head_dim)
        value_rows = values.view(-1, block_size, head_dim)
        outputs = []
        for call in calls:
            rows, length = call.group.rows, call.group.query_len
            if call.native:
                out = native.paged_attention(
                    q[call.tokens], keys, values, call.group.block_table, call.group.start_positions, length,
                    scale=scale, window=window, softcap=softcap, sinks=sinks,
                )
                outputs.append(out.view(rows * length, heads * head_dim))
                continue
            q_call = q[call.tokens].view(rows, length, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
            q_call = q_call.reshape(rows, kv_heads, group * length, head_dim)
            torch.index_select(key_rows, 0, call.gather_index, out=call.key_buffer)
            torch.index_select(value_rows, 0, call.gather_index, out=call.value_buffer)
            # A 16-bit pool's keys and values are widened to the queries' dtype for SDPA.
            k = call.key_buffer.view(rows, kv_heads, -1, head_dim).to(q.dtype)
            v = call.value_buffer.view(rows, kv_heads, -1, head_dim).to(q.dtype)
            mask = call.mask if window is None else call.window_mask
            # Folded row j * length + t of KV head g is query head g * group + j: its sink.
            folded = None if sinks is None else sinks.view(kv_heads, group, 1).expand(-1, -1, length).reshape(kv_heads, -1, 1)
            out = scores_to_output(q_call, k, v, mask, scale=scale, softcap=softcap, sinks=folded)
            out = out.view(rows, kv_heads, group, length, head_dim).permute(0, 3, 1, 2, 4)
            outputs.append(out.reshape(rows * length, heads * head_dim))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
