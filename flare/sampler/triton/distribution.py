"""Per-position distribution statistics in Triton: one program per (position, shard).

Same arguments and results as distribution.distribution_statistics. The top-k and top-p
thresholds are found without sorting (FlashInfer's idea): each is the largest logit t meeting a
monotone condition (at least k logits >= t; the kept tokens with logit >= t carry at least
top_p of the mass), found by bisection over the order-preserving int32 image of the float bits,
so the search lands exactly on an element of the row in 32 passes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flare.sampler.distribution import DistributionStatistics
from flare.sampler.triton.launch import FP_FUSION, block_size

ORDER_OF_MINUS_INF = tl.constexpr(-2139095041)
"""The order key of -inf: its bits (0xFF800000) with the magnitude bits flipped (a constexpr,
as compiled Triton reads only constexpr globals; the interpreter would not notice)."""


@triton.jit
def _float_of_order(order):
    """Inverse of the order-preserving map key = bits if bits >= 0 else bits ^ 0x7FFFFFFF."""
    order = order.to(tl.int32)
    bits = tl.where(order >= 0, order, order ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _order_of_float(x):
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _count_at_least(row_ptr, start, end, t, BLOCK: tl.constexpr):
    count = tl.zeros([BLOCK], dtype=tl.int32)
    for block_start in range(start, end, BLOCK):
        offsets = block_start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offsets, mask=offsets < end, other=float("-inf"))
        count += (x >= t).to(tl.int32)
    return tl.sum(count, 0)


@triton.jit
def _mass_at_least(row_ptr, start, end, t, row_max, BLOCK: tl.constexpr):
    mass = tl.zeros([BLOCK], dtype=tl.float32)
    # -inf logits (masked tokens) carry no mass, also in a shard a mask empties (max -inf, where
    # x - max would be -inf + inf = NaN): such a shard is shifted by 0 instead.
    shift = tl.where(row_max > float("-inf"), row_max, 0.0)
    for block_start in range(start, end, BLOCK):
        offsets = block_start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offsets, mask=offsets < end, other=float("-inf"))
        mass += tl.where(x >= t, tl.exp(x - shift), 0.0)
    return tl.sum(mass, 0)


@triton.jit
def distribution_statistics_kernel(
    scaled_ptr,
    row_of_position_ptr,
    top_k_ptr,
    top_p_ptr,
    log_min_p_ptr,
    max_ptr,
    sumexp_ptr,
    argmax_ptr,
    threshold_ptr,
    vocab_size,
    shard_size,
    num_shards,
    FILTER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    position = tl.program_id(0)
    shard = tl.program_id(1)
    start = shard * shard_size
    end = tl.minimum(start + shard_size, vocab_size)
    row_ptr = scaled_ptr + position.to(tl.int64) * vocab_size

    # Max and argmax (lowest index on ties: a later block wins only if strictly larger).
    best = tl.full([], float("-inf"), tl.float32)
    best_index = start.to(tl.int64)
    for block_start in range(start, end, BLOCK):
        offsets = block_start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offsets, mask=offsets < end, other=float("-inf"))
        block_best = tl.max(x, 0)
        block_index = tl.min(tl.where(x == block_best, offsets, end), 0).to(tl.int64)
        best_index = tl.where(block_best > best, block_index, best_index)
        best = tl.maximum(best, block_best)

    threshold = tl.full([], float("-inf"), tl.float32)
    if FILTER:
        row = tl.load(row_of_position_ptr + position)
        top_k = tl.load(top_k_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        threshold_k = tl.full([], float("-inf"), tl.float32)
        if top_k > 0:
            # Largest t with count(logit >= t) >= k: invariant cond(low) true, cond(high) false.
            low = tl.full([], ORDER_OF_MINUS_INF, tl.int64)
            high = _order_of_float(best) + 1
            for _ in range(33):
                if high - low > 1:
                    middle = low + (high - low) // 2
                    if _count_at_least(row_ptr, start, end, _float_of_order(middle), BLOCK) >= top_k:
                        low = middle
                    else:
                        high = middle
            threshold_k = _float_of_order(low)
        threshold_p = tl.full([], float("-inf"), tl.float32)
        if top_p < 1.0:
            target = top_p * _mass_at_least(row_ptr, start, end, threshold_k, best, BLOCK)
            low = tl.full([], ORDER_OF_MINUS_INF, tl.int64)
            high = _order_of_float(best) + 1
            for _ in range(33):
                if high - low > 1:
                    middle = low + (high - low) // 2
                    t = tl.maximum(_float_of_order(middle), threshold_k)
                    if _mass_at_least(row_ptr, start, end, t, best, BLOCK) >= target:
                        low = middle
                    else:
                        high = middle
            threshold_p = _float_of_order(low)
        threshold = best + tl.load(log_min_p_ptr + row)
        threshold = tl.maximum(threshold, threshold_k)
        threshold = tl.maximum(threshold, threshold_p)

    sumexp = _mass_at_least(row_ptr, start, end, threshold, best, BLOCK)
    out = position * num_shards + shard
    tl.store(max_ptr + out, best)
    tl.store(sumexp_ptr + out, sumexp)
    tl.store(argmax_ptr + out, best_index)
    tl.store(threshold_ptr + position, threshold, mask=shard == 0)


def distribution_statistics(
    scaled: torch.Tensor,
    row_of_position: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    log_min_p: torch.Tensor,
    num_shards: int,
    *,
    filtered: bool,
    max_top_k: int,
    any_top_p: bool,
    need_sumexp: bool = True,
    need_argmax: bool = True,
) -> DistributionStatistics:
    """Triton version of distribution.distribution_statistics (it always computes every output)."""
    num_positions, vocab_size = scaled.shape
    device = scaled.device
    shard_size = -(-vocab_size // num_shards)
    shard_max = torch.empty(num_positions, num_shards, dtype=torch.float32, device=device)
    sumexp = torch.empty(num_positions, num_shards, dtype=torch.float32, device=device)
    argmax = torch.empty(num_positions, num_shards, dtype=torch.int64, device=device)
    threshold = torch.empty(num_positions, dtype=torch.float32, device=device)
    distribution_statistics_kernel[(num_positions, num_shards)](
        scaled.contiguous(),
        row_of_position.contiguous(),
        top_k.contiguous(),
        top_p.float().contiguous(),
        log_min_p.float().contiguous(),
        shard_max,
        sumexp,
        argmax,
        threshold,
        vocab_size,
        shard_size,
        num_shards,
        FILTER=filtered and num_shards == 1,
        BLOCK=block_size(shard_size, device),
        enable_fp_fusion=FP_FUSION,
    )
    return DistributionStatistics(max=shard_max, sumexp=sumexp, argmax=argmax, threshold=threshold)
