"""A round's result: what the model thread hands back to the scheduler, frozen."""

from __future__ import annotations

from dataclasses import dataclass

from flare.engine.drafters import Draft
from flare.sampler.status import DeviceStatus
from flare.scheduler.request import TokenLogprob


@dataclass(frozen=True)
class RowResult:
    tokens: tuple[int, ...]  # accepted drafts then one sampled token; empty on failure
    status: DeviceStatus
    fell_back: bool = False
    logprobs: tuple[TokenLogprob, ...] = ()  # aligned with tokens, when the row asked
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # aligned with the row's scoring targets
    next_draft: Draft | None = None  # the draft head's proposal for the row's next round


@dataclass(frozen=True)
class RoundResult:
    rows: tuple[RowResult | None, ...]  # aligned with plan.rows; None for rows that neither sample nor score
    seconds: float
    # Of `seconds`, the draft head's pass for the next round's drafts (host time: on a GPU, where
    # the round's one read waits for the head's kernels, only their launches).
    head_seconds: float = 0.0
