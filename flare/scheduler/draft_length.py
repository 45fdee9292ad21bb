"""Adaptive draft length: how many of the drafter's proposals each row verifies this round.

Cost model: a round that feeds T tokens through the target takes about c0 + c1 * T seconds
(c0: reading the weights and per-round overhead; c1: compute per token), fitted online by
least squares with exponential forgetting over observed rounds. A row whose drafts are
accepted with per-token probability a yields 1 + a + a^2 + ... + a^k tokens for k drafts
(accepting draft j needs every earlier draft accepted), so its j-th draft adds a^j expected
tokens for c1 more seconds. Drafts are added greedily, best marginal gain first, while the
marginal rate a^j / c1 beats the round's average rate tokens / time: throughput only rises,
so speculation never costs more than K = 0 under the model. At batch 32 (compute bound) only
rows whose drafts are nearly always accepted draft at all.

A round of exactly one token is the exception: on CPU it is a matrix-vector product, and the
second token turns it into a matrix product that costs far more than c1 (measured: 46 ms for one
token, 75 ms for two, 76 ms for five). So the line is fitted on rounds of two or more tokens, the
one-token round is timed on its own, and a lone decode row weighs every draft length against it
as a whole: drafting pays only when enough drafts are likely to be accepted to cover the step.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass
class RoundCostModel:
    """Least squares fit of round seconds = c0 + c1 * tokens with exponential forgetting."""

    c0: float = 0.02
    c1: float = 0.003
    single_token_s: float | None = None  # one-token rounds, as an exponential moving average
    forgetting: float = 0.98
    _s: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0)  # n, x, y, xx, xy

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens == 1:
            previous = self.single_token_s
            self.single_token_s = seconds if previous is None else previous + 0.1 * (seconds - previous)
            return
        f = self.forgetting
        n, sx, sy, sxx, sxy = self._s
        x = float(tokens)
        n, sx, sy, sxx, sxy = f * n + 1, f * sx + x, f * sy + seconds, f * sxx + x * x, f * sxy + x * seconds
        self._s = (n, sx, sy, sxx, sxy)
        det = n * sxx - sx * sx
        if n >= 2 and det > 1e-9 * max(1.0, sxx * n):
            c1 = (n * sxy - sx * sy) / det
            c0 = (sy - c1 * sx) / n
            if c1 > 0 and c0 > 0:
                self.c0, self.c1 = c0, c1

    def seconds(self, tokens: int) -> float:
        if tokens == 1 and self.single_token_s is not None:
            return self.single_token_s
        return self.c0 + self.c1 * tokens


@dataclass
class AcceptanceEstimate:
    """Per-row probability that a draft token is accepted, as an exponential moving average."""

    rate: float = 0.5
    weight: float = 0.3

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        # Drafts after the first rejection are never tested; count the tested ones only.
        tested = accepted + (1 if accepted < proposed else 0)
        self.rate += self.weight * (accepted / tested - self.rate)


def choose_draft_lengths(
    available: list[int], acceptance: list[float], base_tokens: int, cost: RoundCostModel
) -> list[int]:
    """Draft length per row, given the proposals available per row and their acceptance."""
    if base_tokens == 1 and len(available) == 1:
        return [_lone_row_draft_length(available[0], acceptance[0], cost)]
    lengths = [0] * len(available)
    expected_tokens = float(len(available))
    seconds = cost.seconds(base_tokens)
    heap = [(-a, i) for i, (n, a) in enumerate(zip(available, acceptance)) if n > 0 and a > 0.0]
    heapq.heapify(heap)
    while heap:
        neg_gain, i = heapq.heappop(heap)
        gain = -neg_gain
        if gain * seconds < cost.c1 * expected_tokens:
            break  # the best remaining draft would lower tokens per second
        lengths[i] += 1
        expected_tokens += gain
        seconds += cost.c1
        if lengths[i] < available[i]:
            heapq.heappush(heap, (-(gain * acceptance[i]), i))
    return lengths


def _lone_row_draft_length(available: int, acceptance: float, cost: RoundCostModel) -> int:
    """The draft length that maximises expected tokens per second for a round of one decode row,
    the one-token round's own time included (see the module docstring)."""
    best, best_rate = 0, 1.0 / cost.seconds(1)
    expected = 1.0
    for k in range(1, available + 1):
        expected += acceptance**k
        rate = expected / cost.seconds(1 + k)
        if rate > best_rate:
            best, best_rate = k, rate
    return best
