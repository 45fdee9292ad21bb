"""The k largest logits of every position and shard in Triton: one program per (position,
shard), k passes of a max over the shard.

Pass j finds the largest logit strictly after the previous pass's (value, id) in the order
"larger logit first, lower id first among ties", so no sort and no scratch row is needed; k is
at most 20 (OpenAI's bound on top_logprobs). Same results as top_tokens.shard_top_tokens, merged
by the same torch code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flare.sampler.top_tokens import TopTokens, ordered_top
from flare.sampler.triton.launch import FP_FUSION, block_size


@triton.jit
def shard_top_tokens_kernel(
    scaled_ptr,
    values_ptr,
    ids_ptr,
    vocab_size,
    shard_size,
    num_shards,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    position = tl.program_id(0)
    shard = tl.program_id(1)
    start = shard * shard_size
    end = tl.minimum(start + shard_size, vocab_size)
    row_ptr = scaled_ptr + position.to(tl.int64) * vocab_size
    out = (position * num_shards + shard) * K
    previous = tl.full([], float("inf"), tl.float32)
    previous_id = tl.full([], -1, tl.int64)
    for j in tl.static_range(K):
        best = tl.full([], float("-inf"), tl.float32)
        best_id = tl.full([], -1, tl.int64)
        for block_start in range(start, end, BLOCK):
            offsets = block_start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + offsets, mask=offsets < end, other=float("-inf"))
            after = (x < previous) | ((x == previous) & (offsets > previous_id))
            candidate = (offsets < end) & after
            block_best = tl.max(tl.where(candidate, x, float("-inf")), 0)
            block_id = tl.min(tl.where(candidate & (x == block_best), offsets, end), 0).to(tl.int64)
            # A later block wins only with a strictly larger logit (ids rise with blocks), or when
            # nothing was found yet (a shard of -inf logits still yields its ids in order).
            found = block_id < end
            take = found & ((block_best > best) | (best_id < 0))
            best_id = tl.where(take, block_id, best_id)
            best = tl.where(take, block_best, best)
        tl.store(values_ptr + out + j, best)
        tl.store(ids_ptr + out + j, best_id)
        # A shard shorter than k is exhausted: later passes find nothing past (-inf, end).
        exhausted = best_id < 0
        previous = tl.where(exhausted, float("-inf"), best)
        previous_id = tl.where(exhausted, end.to(tl.int64), best_id)


def shard_top_tokens(scaled: torch.Tensor, k: int, num_shards: int) -> TopTokens:
    """Triton version of top_tokens.shard_top_tokens."""
    num_positions, vocab_size = scaled.shape
    shard_size = -(-vocab_size // num_shards)
    values = torch.empty(num_positions, num_shards, k, dtype=torch.float32, device=scaled.device)
    ids = torch.empty(num_positions, num_shards, k, dtype=torch.int64, device=scaled.device)
    if k > 0 and num_positions > 0:
        shard_top_tokens_kernel[(num_positions, num_shards)](
            scaled.float().contiguous(),
            values,
            ids,
            vocab_size,
            shard_size,
            num_shards,
            K=k,
            BLOCK=block_size(shard_size, scaled.device),
            enable_fp_fusion=FP_FUSION,
        )
    return TopTokens(values.view(num_positions, num_shards * k), ids.view(num_positions, num_shards * k))


def top_tokens(scaled: torch.Tensor, k: int, num_shards: int) -> TopTokens:
    candidates = shard_top_tokens(scaled, k, num_shards)
    return ordered_top(candidates.values, candidates.ids, k)
