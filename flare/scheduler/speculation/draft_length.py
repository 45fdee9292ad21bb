"""Adaptive draft length: how many of the drafter's proposals each row verifies this round.

A row whose drafts are accepted with per-token probability a yields 1 + a + a^2 + ... + a^k
tokens for k drafts (accepting draft j needs every earlier draft accepted), so its j-th draft
adds a^j expected tokens. Within a row the gains fall with j, so the best n drafts of a round are
the n largest gains over all rows, and they always take a row's drafts in order. The round keeps
the n that maximises a rate, n = 0 included, and drafts only when that beats the plain round by
`DRAFT_MARGIN`: under the cost model speculation never costs more than K = 0. At batch 32
(compute bound) only rows whose drafts are nearly always accepted draft at all.

Which rate depends on whether requests wait for a free row:
- some wait: expected tokens per second, rows x mean(E_r) / seconds, where E_r is row r's
  expected tokens. Throughput is what starts the waiting requests sooner.
- none wait: rows x harmonic_mean(E_r) / seconds, i.e. the inverse of the rows' summed
  expected time per token (seconds / E_r): every running request's own speed counts. A round
  that drafts for a few rows slows all the others; it pays here only if the few gain more
  time than the others lose (with the throughput rate, rows that drafted finished early and the
  rest ran in rounds that cost what a full one does: docs/benchmarks.md, "The draft planner's
  rules").
With one row both rates are the same.

Cost model (`RoundCostModel`): what a round of T tokens took, measured per T. On a CPU the
cost is far from a line in T: GEMMs have cliffs (docs/benchmarks.md, "The draft planner's
rules"), so one draft on a round of decode rows can cost more than several further drafts past
the next tile. Token counts not measured recently are estimated from the measured ones around them (`seconds_range`), and a
round at such a count is tried only when clearly better (`EXPLORATION_MARGIN`); it is then
measured. What wrong guesses cost, in seconds past their estimates, is capped at
`EXPLORATION_ALLOWANCE_S` plus `EXPLORATION_SHARE` of all rounds' time; past that only measured
counts are chosen until the share has grown. Drafts are weighed only against a plain round (no
drafts) that was itself measured, so that round is run first.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from dataclasses import dataclass, field


# A round of a token count not timed recently is tried only when its estimate beats the best
# measured choice by this factor: an estimate is a guess, and each wrong guess costs a slow
# round (without a margin a daemon tried every count near its batch once after its first prefill).
EXPLORATION_MARGIN = 1.1
# The margin cannot see a cliff (a count past one estimated far below what it took:
# docs/benchmarks.md), so a budget bounds what guesses may lose: a fixed allowance at first,
# then a small share of the time in rounds.
EXPLORATION_ALLOWANCE_S = 0.1
EXPLORATION_SHARE = 0.01
# Drafts are taken only when their expected rate beats the plain round's by this factor. Both
# sides are estimates (acceptance is a moving average, times too), and near a GEMM cliff a bet
# that falls short costs far more than one that comes good gains (at 32 chat streams a few rows'
# acceptance near 0.9 drew rounds past a cliff that accepted little). A small margin keeps the
# bets that pay, such as repetitive text at one stream.
DRAFT_MARGIN = 1.05


@dataclass
class RoundCostModel:
    """Seconds a round of T tokens takes: the measured time where T was seen recently, else an
    estimate from the measured counts around T and a least-squares line c0 + c1 * T (with
    exponential forgetting) over rounds of 2+ tokens.

    A count's measured time is the median of its last `window` rounds, not a moving average:
    a lone slow round (a collection, a neighbour's burst) moved an average a fifth of the way
    and kept it there while the count was not chosen again, so that one slow round of 2 tokens
    kept every row from drafting for dozens of rounds.

    The line only fills gaps (counts below every measured one, and the slope past the largest).
    One-token rounds stay off it: on CPU they are a matrix-vector product, a different regime
    from two tokens on. A measurement
    older than `max_age_rounds` rounds is dropped, so a count timed during a burst of load
    elsewhere on the machine is timed again rather than avoided for good.

    The machine's own speed moves under every count alike (a shared host's neighbours, a
    hypervisor's contended units slow every count together for seconds at a time), so times are
    kept at the machine's `pace` and scaled back by it: pace is the median, over the last
    `pace_window` rounds, of each round's seconds over what its count was stored at, and a round
    is stored as its seconds over the pace. A count timed in a slow
    stretch and not chosen since then is estimated at today's speed, not left at the slow time
    for `max_age_rounds` rounds, where it kept copying rows at fewer drafts than paid once the
    machine came back. The pace follows a change a few rounds late, so a count timed once, in the
    first rounds of a slow stretch, is stored slow; such a count is dropped after
    `single_age_rounds` and tried again if its estimate is then worth it (a count timed so kept a
    copying row from drafting at all for hundreds of rounds). The runs are in docs/benchmarks.md,
    "The draft planner's rules".
    """

    c0: float = 0.02
    c1: float = 0.003
    forgetting: float = 0.98
    window: int = 7  # a count's last rounds whose median is its measured time
    max_age_rounds: int = 500
    single_age_rounds: int = 50  # a count timed once is dropped sooner (the class docstring says why)
    pace_window: int = 5  # rounds whose median ratio to their counts' stored times is the pace
    _s: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0)  # n, x, y, xx, xy
    # T -> (median stored seconds, round last measured, the last `window` rounds' stored
    # seconds); a round is stored as its seconds over the pace, and so is the line (c0, c1).
    _measured: dict[int, tuple[float, int, deque[float]]] = field(default_factory=dict)
    _pace: float = 1.0
    _pace_ratios: deque[float] = field(default_factory=deque)
    _rounds: int = 0
    _total_seconds: float = 0.0
    _exploration_loss: float = 0.0  # seconds that tried rounds took past their estimates
    _trying: tuple[int, float] | None = None  # the next round's untimed count and its estimate

    def observe(self, tokens: int, seconds: float) -> None:
        self._rounds += 1
        self._total_seconds += seconds
        if self._trying is not None and self._trying[0] == tokens:
            self._exploration_loss += max(0.0, seconds - self._trying[1])
        self._trying = None
        single_age = min(self.max_age_rounds, self.single_age_rounds)
        self._measured = {
            t: m for t, m in self._measured.items() if self._rounds - m[1] <= (self.max_age_rounds if len(m[2]) > 1 else single_age)
        }
        previous = self._measured.get(tokens)
        if previous is not None and previous[0] > 0.0 and seconds > 0.0:
            self._pace_ratios.append(seconds / previous[0])
            if len(self._pace_ratios) > self.pace_window:
                self._pace_ratios.popleft()
            self._pace = statistics.median(self._pace_ratios)
        stored = seconds / self._pace
        recent = previous[2] if previous is not None else deque(maxlen=self.window)
        recent.append(stored)
        self._measured[tokens] = (statistics.median(recent), self._rounds, recent)
        if tokens >= 2:
            self._fit(float(tokens), stored)

    def _fit(self, x: float, seconds: float) -> None:
        f = self.forgetting
        n, sx, sy, sxx, sxy = self._s
        n, sx, sy, sxx, sxy = f * n + 1, f * sx + x, f * sy + seconds, f * sxx + x * x, f * sxy + x * seconds
        self._s = (n, sx, sy, sxx, sxy)
        det = n * sxx - sx * sx
        if n >= 2 and det > 1e-9 * max(1.0, sxx * n):
            c1 = (n * sxy - sx * sy) / det
            c0 = (sy - c1 * sx) / n
            if c1 > 0 and c0 > 0:
                self.c0, self.c1 = c0, c1

    def is_measured(self, tokens: int) -> bool:
        """Whether a round of `tokens` tokens was timed within the last `max_age_rounds`."""
        return tokens in self._measured

    def may_try(self) -> bool:
        """Whether an untimed count may be chosen: what tried counts took past their estimates
        is within `EXPLORATION_ALLOWANCE_S` plus `EXPLORATION_SHARE` of all rounds' time."""
        return self._exploration_loss <= EXPLORATION_ALLOWANCE_S + EXPLORATION_SHARE * self._total_seconds

    def trying(self, tokens: int, estimate: float) -> None:
        """The next round runs the untimed count `tokens`, estimated at `estimate` seconds."""
        self._trying = (tokens, estimate)

    def seconds(self, tokens: int) -> float:
        return self.seconds_range(tokens, tokens)[0]

    def seconds_range(self, first: int, last: int) -> list[float]:
        """The seconds of rounds of first, first + 1, ..., last tokens at the machine's pace.

        A count not measured recently is interpolated between the nearest measured counts
        around it. Past the largest measured count the time grows from the nearest measured
        count by the steeper of the line's slope and the slope between the two nearest measured
        counts: the line, pulled flat by prefill rounds of hundreds of tokens, would promise a
        few more decode tokens almost for free (the GEMM cliffs above say otherwise).
        """
        counts = sorted(self._measured)
        times = []
        for tokens in range(first, last + 1):
            if tokens in self._measured:
                times.append(self._measured[tokens][0])
                continue
            at = bisect.bisect_left(counts, tokens)
            if at == 0:
                times.append(self.c0 + self.c1 * tokens)
                continue
            below = counts[at - 1]
            below_s = self._measured[below][0]
            if at < len(counts):
                above = counts[at]
                above_s = self._measured[above][0]
                times.append(below_s + (above_s - below_s) * (tokens - below) / (above - below))
                continue
            slope = self.c1
            if at >= 2:
                before = counts[at - 2]
                slope = max(slope, (below_s - self._measured[before][0]) / (below - before))
            times.append(below_s + slope * (tokens - below))
        return [t * self._pace for t in times]


@dataclass
class AcceptanceEstimate:
    """Per-row probability that a draft token is accepted, as an exponential moving average
    over the drafts verified: each tested draft is one observation, in the order verified (the
    accepted ones, then the rejected one if any; the drafts after it were never tested).

    A round is not one observation: a row that copies text has its drafts accepted four at a
    time and then, where the text changes a word, one rejected; averaging rounds took one
    rejection (0 of 1) as much as a round of four accepted, and a copying row drafted fewer for
    several rounds after every changed word.

    A row whose estimate fell low enough that its drafts are no longer verified would keep it
    for good, since only verified drafts are observed: after six rejections in a row (odds of
    7% for a draft head accepted at 35%, so most long chat answers had such a run) a row never
    drafted again. Each round without verified drafts moves the estimate `recovery` of the way
    back to the prior, so the row is tried again once the cost model finds that worth it
    (docs/benchmarks.md has the run).
    """

    rate: float = 0.5
    weight: float = 0.3
    prior: float = 0.5
    recovery: float = 0.05

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        keep = 1.0 - self.weight
        self.rate = 1.0 - (1.0 - self.rate) * keep**accepted  # each accepted draft moves it toward 1
        if accepted < proposed:
            self.rate *= keep  # the rejected one toward 0

    def unobserved(self) -> None:
        """A round in which the row verified no drafts."""
        if self.rate < self.prior:
            self.rate += self.recovery * (self.prior - self.rate)


def choose_draft_lengths(
    available: list[int],
    acceptance: list[float],
    base_tokens: int,
    cost: RoundCostModel,
    *,
    requests_waiting: bool,
) -> list[int]:
    """Draft length per row, given the proposals available per row and their acceptance.

    `base_tokens` is the round without drafts (decode rows and prefill tokens); each decode row
    yields one token, plus its accepted drafts. `requests_waiting` picks the rate (module
    docstring): throughput when requests wait for a row, the rows' own speed when none do.
    """
    if not available:
        return []
    if not cost.is_measured(base_tokens):
        # Every choice is weighed against the round without drafts, so that round is timed
        # first. A model that only ever saw drafted rounds would keep guessing the plain one, and
        # rows drafted every round at a loss.
        return [0] * len(available)
    # (gain, j, row): the j-th draft of `row` adds gain = a^j expected tokens.
    candidates = sorted(
        ((a**j, j, i) for i, (n, a) in enumerate(zip(available, acceptance)) if a > 0.0 for j in range(1, n + 1)),
        key=lambda c: (-c[0], c[1], c[2]),
    )
    times = cost.seconds_range(base_tokens, base_tokens + len(candidates))
    may_try = cost.may_try()
    rows = len(available)
    expected = [1.0] * rows  # E_r
    total, inverse_total = float(rows), float(rows)  # sum of E_r, sum of 1 / E_r

    def tokens() -> float:
        """rows x mean(E_r), or rows x harmonic_mean(E_r)."""
        return total if requests_waiting else rows * rows / inverse_total

    best, best_rate = 0, DRAFT_MARGIN * tokens() / times[0]
    for extra, (gain, _, i) in enumerate(candidates, start=1):
        inverse_total += 1.0 / (expected[i] + gain) - 1.0 / expected[i]
        expected[i] += gain
        total += gain
        rate = tokens() / times[extra]
        if not cost.is_measured(base_tokens + extra):
            if not may_try:
                continue
            rate /= EXPLORATION_MARGIN
        if rate > best_rate:
            best, best_rate = extra, rate
    if best and not cost.is_measured(base_tokens + best):
        cost.trying(base_tokens + best, times[best])
    lengths = [0] * len(available)
    for _, _, i in candidates[:best]:
        lengths[i] += 1
    return lengths


HEAD_COST_WINDOW = 15  # head passes whose median is the head's cost
# A head step is drafted only when its expected saving is this many times its cost. A step's
# cost is paid for certain, its saving is an estimate, and verifying a learned q costs a sampled
# row more than lookup's one-hot q (the residual over the whole vocabulary), which the round cost
# model does not tell apart (docs/benchmarks.md has the margins' runs).
HEAD_STEP_MARGIN = 2.0


@dataclass
class HeadCostModel:
    """Seconds the draft head takes per step of one row: the median over its last
    `HEAD_COST_WINDOW` passes of each pass's seconds over its row-steps (a pass's catch-up
    shared among them). None until the head has run."""

    _recent: deque[float] = field(default_factory=lambda: deque(maxlen=HEAD_COST_WINDOW))

    def observe(self, row_steps: int, seconds: float) -> None:
        if row_steps > 0:
            self._recent.append(seconds / row_steps)

    def seconds_per_step(self) -> float | None:
        return statistics.median(self._recent) if self._recent else None


def worthwhile_head_steps(steps: int, acceptance: float, token_seconds: float, step_seconds: float | None) -> int:
    """How many of `steps` head drafts are worth drafting for a row's next round.

    Draft j is accepted (with every draft before it) with probability a^j and then saves a
    token, worth `token_seconds` (a round's time over its rows); drafting it costs a step of the
    head whether or not it is verified. So the row drafts the longest prefix whose last draft
    still gains `HEAD_STEP_MARGIN` times what a step costs:
    a^j * token_seconds >= HEAD_STEP_MARGIN * step_seconds. A row whose head drafts none
    recovers toward the prior acceptance (`AcceptanceEstimate.unobserved`), so it is weighed
    again later. Until the head has been timed every step is taken.
    """
    if step_seconds is None:
        return steps
    worthwhile = 0
    while worthwhile < steps and acceptance ** (worthwhile + 1) * token_seconds >= HEAD_STEP_MARGIN * step_seconds:
        worthwhile += 1
    return worthwhile
