"""Adaptive draft length: how many of the drafter's proposals each row verifies this round.

Cost model: a round that feeds T tokens through the target takes about c0 + c1 * T seconds
(c0: reading the weights and per-round overhead; c1: compute per token), fitted online by
least squares with exponential forgetting over observed rounds. A row whose drafts are
accepted with per-token probability a yields 1 + a + a^2 + ... + a^k tokens for k drafts
(accepting draft j needs every earlier draft accepted), so its j-th draft adds a^j expected
tokens for c1 more seconds. Drafts are added greedily, best marginal gain first, while the
marginal rate a^j / c1 beats the round's average rate tokens / time: throughput only rises,
so speculation never costs more than K = 0 under the model. At batch 1 (weight-read bound,
c0 >> c1) almost any acceptance pays; at batch 32 (compute bound) only rows whose drafts are
nearly always accepted draft at all.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass
class RoundCostModel:
    """Least squares fit of round seconds = c0 + c1 * tokens with exponential forgetting."""

    c0: float = 0.02
    c1: float = 0.003
    forgetting: float = 0.98
    _s: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0)  # n, x, y, xx, xy

    def observe(self, tokens: int, seconds: float) -> None:
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
