"""Gumbel-max sampling candidates in Triton: one program per (row, vocabulary shard).

Same arguments and results as gumbel_max.gumbel_candidates; the noise comes from
random_stream_triton, bit-identical to the twin's stream.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flare.sampler.gumbel_max import GumbelCandidates
from flare.sampler.triton.random_stream import gumbel, stream_bits
from flare.sampler.triton.launch import FP_FUSION, block_size


@triton.jit
def gumbel_candidates_kernel(
    scaled_ptr,
    position_ptr,
    key_ptr,
    row_max_ptr,
    sumexp_ptr,
    threshold_ptr,
    exclude_ptr,
    draft_q_ptr,
    index_ptr,
    value_ptr,
    residual_index_ptr,
    residual_value_ptr,
    residual_mass_ptr,
    vocab_size,
    shard_size,
    num_shards,
    first_index,
    HAS_Q: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    shard = tl.program_id(1)
    start = shard * shard_size
    end = tl.minimum(start + shard_size, vocab_size)
    position = tl.load(position_ptr + row)
    key = tl.load(key_ptr + row)
    row_max = tl.load(row_max_ptr + row)
    sumexp = tl.load(sumexp_ptr + row)
    threshold = tl.load(threshold_ptr + row)
    exclude = tl.load(exclude_ptr + row)
    logits_ptr = scaled_ptr + position * vocab_size

    best = tl.full([], float("-inf"), tl.float32)
    best_index = start.to(tl.int64)
    residual_best = tl.full([], float("-inf"), tl.float32)
    residual_best_index = start.to(tl.int64)
    residual_mass = tl.zeros([BLOCK], dtype=tl.float32)
    for block_start in range(start, end, BLOCK):
        offsets = block_start + tl.arange(0, BLOCK)
        in_shard = offsets < end
        x = tl.load(logits_ptr + offsets, mask=in_shard, other=float("-inf"))
        # The stream at vocabulary indices: column c of a rank's shard is token first_index + c.
        noise = gumbel(stream_bits(key, offsets + first_index))
        kept = (x >= threshold) & in_shard
        value = tl.where(kept & (offsets != exclude), x + noise, float("-inf"))
        block_best = tl.max(value, 0)
        block_index = tl.min(tl.where(value == block_best, offsets, end), 0).to(tl.int64)
        best_index = tl.where(block_best > best, block_index, best_index)
        best = tl.maximum(best, block_best)
        if HAS_Q:
            q = tl.load(draft_q_ptr + row.to(tl.int64) * vocab_size + offsets, mask=in_shard, other=0.0)
            p = tl.where(kept, tl.exp(x - row_max), 0.0) / sumexp
            residual = tl.maximum(p - q, 0.0)
            residual_mass += residual
            positive = residual > 0
            residual_value = tl.where(positive, tl.log(tl.where(positive, residual, 1.0)) + noise, float("-inf"))
            block_best = tl.max(residual_value, 0)
            block_index = tl.min(tl.where(residual_value == block_best, offsets, end), 0).to(tl.int64)
            residual_best_index = tl.where(block_best > residual_best, block_index, residual_best_index)
            residual_best = tl.maximum(residual_best, block_best)
    out = row * num_shards + shard
    tl.store(index_ptr + out, best_index + first_index)
    tl.store(value_ptr + out, best)
    if HAS_Q:
        tl.store(residual_index_ptr + out, residual_best_index + first_index)
        tl.store(residual_value_ptr + out, residual_best)
        tl.store(residual_mass_ptr + out, tl.sum(residual_mass, 0))


def gumbel_candidates(
    scaled: torch.Tensor,
    position: torch.Tensor,
    key: torch.Tensor,
    row_max: torch.Tensor,
    sumexp: torch.Tensor,
    threshold: torch.Tensor,
    exclude: torch.Tensor,
    draft_q: torch.Tensor | None,
    num_shards: int,
    first_index: int = 0,
) -> GumbelCandidates:
    """Triton version of gumbel_max.gumbel_candidates (``first_index``: the vocabulary index of
    column 0, for a rank's shard)."""
    vocab_size = scaled.shape[1]
    num_rows = position.shape[0]
    device = scaled.device
    shard_size = -(-vocab_size // num_shards)

    def empty(dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(num_rows, num_shards, dtype=dtype, device=device)

    index, value = empty(torch.int64), empty(torch.float32)
    has_q = draft_q is not None
    residual_index, residual_value, residual_mass = (
        (empty(torch.int64), empty(torch.float32), empty(torch.float32)) if has_q else (index, value, value)
    )
    gumbel_candidates_kernel[(num_rows, num_shards)](
        scaled.contiguous(),
        position.contiguous(),
        key.to(torch.int32).contiguous(),
        row_max.float().contiguous(),
        sumexp.float().contiguous(),
        threshold.float().contiguous(),
        exclude.contiguous(),
        draft_q.float().contiguous() if has_q else scaled,
        index,
        value,
        residual_index,
        residual_value,
        residual_mass,
        vocab_size,
        shard_size,
        num_shards,
        first_index,
        HAS_Q=has_q,
        BLOCK=block_size(shard_size, device),
        enable_fp_fusion=FP_FUSION,
    )
    if not has_q:
        return GumbelCandidates(index, value, None, None, None)
    return GumbelCandidates(index, value, residual_index, residual_value, residual_mass)
