"""Applying one row of a round's result to its sequence, on the event loop: its cached
positions, prompt scores, device status, accepted drafts and new tokens (into its stream through
`emission.py`), and what the row adds to the round's `RoundTally`.

The scheduler owns the sequences and ends their requests: `fail` ends every choice of a request
(`Scheduler._fail`), `finish` one choice (`Scheduler._finish`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from flare.sampler.status import DeviceStatus
from flare.scheduler.blocks import BlockManager
from flare.scheduler.emission import choice_usage, emit
from flare.scheduler.failures import device_failure
from flare.scheduler.request import Finished, RequestFailure, TokenLogprob
from flare.scheduler.round.plan import PlannedRow
from flare.scheduler.round.result import RowResult
from flare.scheduler.sequence import Sequence, SequenceState
from flare.scheduler.speculation.draft_planner import DraftPlanner
from flare.scheduler.stats import RoundTally

log = structlog.get_logger("flare.scheduler")


@dataclass(frozen=True)
class RowApplier:
    """The scheduler's parts a row's result goes into; `statuses`: the device statuses of sampled
    rows since start (the scheduler's, which its snapshot reports)."""

    blocks: BlockManager
    speculation: DraftPlanner
    statuses: Counter[str]
    eos: frozenset[int]
    max_context: int
    fail: Callable[[Sequence, RequestFailure], None]
    finish: Callable[[Sequence, Finished], None]

    def apply(
        self, round_index: int, row: PlannedRow, outcome: RowResult | None, seq: Sequence, now: float, tally: RoundTally
    ) -> None:
        """One running sequence's row of the round: its cached positions, prompt scores, status,
        accepted drafts and new tokens."""
        fed = len(row.token_ids)
        tally.prompt_tokens += max(0, min(seq.num_prompt_tokens, row.start_position + fed) - row.start_position)
        if outcome is not None and outcome.prompt_logprobs:
            # Position p predicts prompt token p + 1: entry p of the list. A recomputed
            # chunk (after a preemption) scores positions already kept again.
            for offset, entry in enumerate(outcome.prompt_logprobs):
                if row.start_position + offset == len(seq.prompt_logprobs):
                    seq.prompt_logprobs.append(entry)
        if not row.samples or outcome is None:
            seq.num_cached = row.start_position + fed
            self.blocks.publish(seq)
            return
        tally.statuses.append(int(outcome.status))
        self.statuses[outcome.status.name] += 1
        seq.sampled_rounds += 1
        if outcome.status is not DeviceStatus.OK:
            constraint = seq.grammar.grammar.spec.param if seq.grammar is not None else None
            log.warning(
                "request_device_status",
                request_id=seq.request_id,
                choice=seq.index,
                status=int(outcome.status),
                status_name=outcome.status.name,
                round=round_index,
            )
            self.fail(seq, device_failure(outcome.status, round_index, constraint))
            return
        if outcome.fell_back and not seq.fell_back:
            seq.fell_back = True
            log.warning("request_fell_back", request_id=seq.request_id, choice=seq.index, round=round_index)
        drafts = len(row.draft_ids)
        accepted = len(outcome.tokens) - 1 if not outcome.fell_back else 0
        tally.observe_drafts(seq.draft_source, drafts, accepted)
        self.speculation.learn(seq, drafts, accepted)
        seq.num_cached = row.start_position + fed - (drafts - accepted)
        self.speculation.keep_head_drafts(seq, row, outcome)
        if seq.first_token_at is None:
            seq.first_token_at = now
            if seq.index == 0:  # once per request
                tally.first_token_seconds.append(now - seq.arrival)
        else:
            tally.token_gaps.append((now - (seq.last_token_at or now), len(outcome.tokens)))
        seq.last_token_at = now
        tally.generated += self._emit(seq, outcome.tokens, outcome.logprobs)
        if seq.state is SequenceState.RUNNING:
            self.blocks.publish(seq)
            self.blocks.trim(seq)

    def _emit(self, seq: Sequence, new_tokens: tuple[int, ...], logprobs: tuple[TokenLogprob, ...] = ()) -> int:
        """`emission.emit` and what follows from it here; returns how many tokens were kept."""
        emission = emit(seq, new_tokens, logprobs, eos=self.eos, max_context=self.max_context)
        if emission.failure is not None:
            self.fail(seq, emission.failure)
            return 0
        self.speculation.extend(seq, list(emission.kept))
        if emission.end is not None:
            finished = Finished(emission.end, choice_usage(seq), seq.fell_back, seq.index, emission.stop_string)
            self.finish(seq, finished)
        return len(emission.kept)
