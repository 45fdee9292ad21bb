"""Per-position distribution statistics (torch twin of distribution_triton.py).

For every position and vocabulary shard: the max logit m, the sum of exp(logit - m) over the
kept tokens, and the argmax (lowest index on ties). With one shard the filters are applied.
The kept set of a position is ``{i : logit_i >= threshold}``, one threshold in logit space, the
largest of

- top-k: the k-th largest logit (every token tied with it is kept);
- top-p, on the top-k-truncated distribution: the largest logit t such that the tokens with
  logit >= t carry at least top_p of the truncated mass (the smallest prefix of the sorted
  distribution that reaches top_p; ties are kept together);
- min-p: ``m + log(min_p)``, since min-p keeps p_i >= min_p * p_max.

Membership is decided by comparing logits with a threshold that is itself a logit (or
m + log(min_p), computed the same way everywhere), never by comparing exponentials, so the
twin and the Triton kernel agree on the kept set bit for bit. This one-threshold form is what
makes a sort-free GPU search possible (FlashInfer): the Triton kernel finds the top-k and top-p
thresholds by bisection on the order-preserving integer image of the float bits, the twin by
topk and a radix select on the same integer image (three histogram passes, no sort); both land
on the same element of the row.

With several shards (vocabulary-parallel sampling) no filter is applied: a filtered row gets
INVALID_SPECULATION before its statistics are used. The merge of shard statistics is the
online-softmax merge: m = max_s m_s, Z = sum_s Z_s * exp(m_s - m).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flare.sampler import native_sampler as native


@dataclass(frozen=True)
class DistributionStatistics:
    max: torch.Tensor
    """[N, S] float32: max logit per shard."""
    sumexp: torch.Tensor | None
    """[N, S] float32: sum of exp(logit - shard max) over kept tokens; None when not asked."""
    argmax: torch.Tensor | None
    """[N, S] int64: global index of the shard's max (lowest on ties); None when not asked."""
    threshold: torch.Tensor
    """[N] float32: the kept-set threshold on logits (-inf: all kept, always so with shards)."""


def shard_bounds(vocab_size: int, num_shards: int) -> list[tuple[int, int]]:
    """Contiguous shards of ceil(V / S) tokens (the last may be shorter)."""
    size = -(-vocab_size // num_shards)
    return [(s * size, min((s + 1) * size, vocab_size)) for s in range(num_shards)]


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
    """Statistics of every position of ``scaled`` [N, V].

    Per-row filter parameters come sanitised (top_k 0 = off, top_p 1 = off, log_min_p -inf =
    off) and are indexed through ``row_of_position``. ``filtered`` (apply filters at all),
    ``max_top_k`` and ``any_top_p`` are host facts that let the twin skip work; the Triton kernel
    reads the parameters alone. ``need_sumexp``/``need_argmax`` let the twin skip outputs the
    round does not use (the Triton kernel always computes them).
    """
    vocab_size = scaled.shape[1]
    num_positions = scaled.shape[0]
    no_threshold = torch.full((num_positions,), float("-inf"), dtype=torch.float32, device=scaled.device)
    if num_shards > 1:
        maxes, sums, argmaxes = [], [], []
        for start, end in shard_bounds(vocab_size, num_shards):
            shard = scaled[:, start:end]
            shard_max = shard.amax(dim=-1)
            maxes.append(shard_max)
            if need_sumexp:
                # A shard a token mask empties (max -inf) holds no mass, not exp(-inf + inf) = NaN.
                shard_sum = torch.sub(shard, shard_max.unsqueeze(1)).exp_().sum(-1)
                sums.append(torch.where(shard_max > float("-inf"), shard_sum, 0.0))
            if need_argmax:
                argmaxes.append(shard.argmax(dim=-1) + start)
        return DistributionStatistics(
            max=torch.stack(maxes, 1),
            sumexp=torch.stack(sums, 1) if need_sumexp else None,
            argmax=torch.stack(argmaxes, 1) if need_argmax else None,
            threshold=no_threshold,
        )
    if need_argmax:
        # One pass for both; torch.max returns the first maximal index, as argmax does.
        row_max, first_max = scaled.max(dim=-1)
        argmax = first_max.unsqueeze(1)
    else:
        row_max, argmax = scaled.amax(dim=-1), None
    threshold = no_threshold
    weights = None
    if filtered:
        threshold, weights = kept_threshold(
            scaled, row_max, top_k[row_of_position], top_p[row_of_position], log_min_p[row_of_position],
            max_top_k, any_top_p,
        )
    sumexp = None
    if need_sumexp:
        sumexp = _kept_sumexp(scaled, row_max, threshold if filtered else None, weights).unsqueeze(1)
    return DistributionStatistics(max=row_max.unsqueeze(1), sumexp=sumexp, argmax=argmax, threshold=threshold)


ROW_BLOCK = 16
"""Positions per block when exponentials are only summed: a reused [16, V] buffer stays in cache
and costs no page faults, unlike an [N, V] temporary (N is up to rows x (1 + drafts))."""


def _kept_sumexp(
    scaled: torch.Tensor, row_max: torch.Tensor, threshold: torch.Tensor | None, weights: torch.Tensor | None
) -> torch.Tensor:
    """Per position, the sum of exp(logit - max) over the kept tokens (logit >= threshold; all
    when None). ``weights`` are those exponentials when already computed (they are consumed)."""
    if weights is not None:
        if threshold is not None:
            weights.masked_fill_(~(scaled >= threshold.unsqueeze(1)), 0.0)
        return weights.sum(-1)
    num_positions = scaled.shape[0]
    buffer = torch.empty(min(ROW_BLOCK, num_positions), scaled.shape[1], dtype=torch.float32, device=scaled.device)
    sums = []
    for start in range(0, num_positions, ROW_BLOCK):
        end = min(start + ROW_BLOCK, num_positions)
        block = torch.sub(scaled[start:end], row_max[start:end].unsqueeze(1), out=buffer[: end - start]).exp_()
        if threshold is not None:
            block.masked_fill_(~(scaled[start:end] >= threshold[start:end].unsqueeze(1)), 0.0)
        sums.append(block.sum(-1))
    return torch.cat(sums)


def kept_threshold(
    scaled: torch.Tensor,
    row_max: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    log_min_p: torch.Tensor,
    max_top_k: int,
    any_top_p: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The kept-set threshold of every position (module docstring), and when top-p computed them
    the weights exp(logit - max) of the tokens top-k keeps (0 elsewhere). Parameters per
    position, sanitised as for `distribution_statistics`."""
    vocab_size = scaled.shape[1]
    threshold = row_max + log_min_p
    threshold_k = torch.full_like(row_max, float("-inf"))
    if max_top_k > 0:
        k_limit = min(max_top_k, vocab_size)
        top_values = torch.topk(scaled, k_limit, dim=-1, sorted=True).values
        enabled = (top_k >= 1) & (top_k <= k_limit)
        kth = top_values.gather(1, (top_k.clamp(1, k_limit) - 1).unsqueeze(1)).squeeze(1)
        threshold_k = torch.where(enabled, kth, float("-inf"))
        threshold = torch.maximum(threshold, threshold_k)
    weights = None
    if any_top_p:
        # Top-p applies to the top-k-truncated distribution: the mass of the tokens top-k keeps.
        weights = torch.sub(scaled, row_max.unsqueeze(1)).exp_()
        if max_top_k > 0:
            weights.masked_fill_(~(scaled >= threshold_k.unsqueeze(1)), 0.0)
        threshold_p = top_p_threshold(scaled, weights, top_p * weights.sum(-1))
        threshold = torch.maximum(threshold, torch.where(top_p < 1.0, threshold_p, float("-inf")))
    return threshold, weights


RADIX_DIGITS = ((21, 11), (10, 11), (0, 10))
"""(shift, bits) of the order key's digits, most significant first: 11 + 11 + 10 = 32 bits."""


def order_key(x: torch.Tensor) -> torch.Tensor:
    """int32 keys that order as the float32 values: the bits, magnitude bits flipped when negative."""
    bits = x.view(torch.int32)
    return torch.bitwise_right_shift(bits, 31).bitwise_and_(0x7FFFFFFF).bitwise_xor_(bits)


def float_of_key(key: torch.Tensor) -> torch.Tensor:
    """The float32 value of an int32 order key (the map is its own inverse)."""
    return order_key(key.view(torch.float32)).view(torch.float32)


def top_p_threshold(scaled: torch.Tensor, mass: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """`largest_reaching_mass`, by the C kernel on the CPU where it was built
    (`native.top_p_threshold`: the same bits in one pass), by the torch operators below
    elsewhere."""
    if scaled.device.type == "cpu" and native.available():
        return native.top_p_threshold(scaled.contiguous(), mass.contiguous(), target.float().contiguous())
    return largest_reaching_mass(scaled, mass, target)


def largest_reaching_mass(scaled: torch.Tensor, mass: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row, the largest logit t such that the tokens with logit >= t carry at least ``target``
    of ``mass`` (the top-p threshold), without sorting the row.

    A radix select on the order keys, most significant digit first. Each pass builds the mass
    histogram of the next digit over the tokens that share the digits chosen so far, and
    chooses the largest digit whose suffix mass, plus the mass of the tokens above the chosen
    prefix, reaches the target. After the last digit the chosen key is the largest
    key whose suffix mass reaches the target, which is the key of a token (the suffix mass only
    changes at tokens): the element the Triton kernel's bisection on the same keys ends on.
    Three passes over [N, V] with fixed shapes, whatever the distribution, in int32 scratch
    tensors reused across passes (fresh [N, V] temporaries cost page faults on the CPU).
    """
    rows = scaled.shape[0]
    key = order_key(scaled)
    outside = torch.empty_like(key)
    digit = torch.empty_like(key)
    row = torch.arange(rows, device=scaled.device, dtype=torch.int32).unsqueeze(1)
    above = torch.zeros_like(target)
    prefix = torch.zeros(rows, dtype=torch.int64, device=scaled.device)
    flat_mass = mass.reshape(-1)
    for level, (shift, bits) in enumerate(RADIX_DIGITS):
        width = 1 << bits
        torch.bitwise_right_shift(key, shift, out=digit)
        if level == 0:
            # The top digit carries the sign: key >> 21 is in [-1024, 1024).
            digit.add_(row * (2 * width) + width // 2)
        else:
            # Tokens outside the chosen prefix go to a second bank of bins, spread by their digit
            # (one shared bin would serialise the histogram's additions), and are ignored.
            torch.bitwise_right_shift(key, shift + bits, out=outside).sub_(prefix.to(torch.int32).unsqueeze(1))
            outside.ne_(0).bitwise_left_shift_(bits)
            digit.bitwise_and_(width - 1).add_(outside).add_(row * (2 * width))
        histogram = torch.bincount(digit.view(-1), weights=flat_mass, minlength=rows * 2 * width).view(rows, 2 * width)
        histogram = histogram[:, :width]
        suffix = histogram.flip(1).cumsum(1).flip(1) + above.unsqueeze(1)
        chosen = ((suffix >= target.unsqueeze(1)).sum(1) - 1).clamp_(min=0)
        # The mass above the chosen digit: the suffix just past it (0 past the last digit).
        above = torch.cat([suffix, above.unsqueeze(1)], 1).gather(1, (chosen + 1).unsqueeze(1)).squeeze(1)
        prefix = chosen - width // 2 if level == 0 else prefix * width + chosen
    return float_of_key(prefix.to(torch.int32))
