"""A round's plan: what the scheduler hands the model thread, frozen.

A planned row is one sequence's new tokens, where they go, and the parts that say what the round
does with them beyond computing their keys and values: a row that samples has a `Sampling` part,
one that verifies drafts a `Draft`, one that scores its prompt (echo) a `Scoring` part, and one
after which the draft head proposes the next round's drafts a `DraftHeadPass`. A row without a
part does not do that thing.
"""

from __future__ import annotations

from dataclasses import dataclass

from flare.engine.drafters import Draft
from flare.policy.params import SamplingParams
from flare.sampler.status import DeviceStatus
from flare.structured import GrammarState


@dataclass(frozen=True)
class Sampling:
    """How a row samples after its tokens: its first sampled token has index `output_position`
    in the request's output (the key of its random stream)."""

    params: SamplingParams
    seed: int
    output_position: int
    prompt_ids: tuple[int, ...]  # the prompt and the output so far, for penalties; empty without them
    output_ids: tuple[int, ...]
    vocabulary_parallel: bool  # the package's vocabulary-parallel sampler, unless the row fell back
    fault: DeviceStatus | None = None  # a test fault to inject (--fault-injection)
    logprobs: int | None = None  # per sampled token, its log-probability and this many alternatives
    raw_logprobs: bool = False  # of the raw model distribution rather than the one sampled from
    grammar: GrammarState | None = None  # the choice's grammar: the runner reads its masks only


@dataclass(frozen=True)
class Scoring:
    """The prompt tokens a prefill row's first positions predict, scored for echo."""

    targets: tuple[int, ...]
    top: int  # alternatives reported per scored prompt token


@dataclass(frozen=True)
class DraftHeadPass:
    """The draft head's pass after a sampling row: `steps` drafts for the row's next round, from
    the first head slot it has not computed (`first_slot`), fed the committed tokens from that
    slot to the end of the row's tokens before its drafts."""

    steps: int  # at least 1: a row the head drafts nothing after has no such part
    first_slot: int
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class PlannedRow:
    """One row of a round: new tokens of one sequence, and what to do after them.

    `token_ids` is the sequence's uncached tail (a prompt chunk, or its last sampled token)
    followed by the drafts' tokens. A row that samples needs logits at its last
    `1 + len(draft_ids)` positions.
    """

    request_id: str
    choice: int  # which of the request's choices the row belongs to
    token_ids: tuple[int, ...]
    start_position: int
    block_table: tuple[int, ...]
    sampling: Sampling | None = None
    drafts: Draft | None = None  # only on a row that samples
    scoring: Scoring | None = None
    draft_head: DraftHeadPass | None = None  # only on a row that samples

    @property
    def samples(self) -> bool:
        return self.sampling is not None

    @property
    def draft_ids(self) -> tuple[int, ...]:
        return self.drafts.token_ids if self.drafts is not None else ()

    @property
    def head_steps(self) -> int:
        """Drafts the head proposes after the row (0: the head does nothing for it)."""
        return self.draft_head.steps if self.draft_head is not None else 0

    @property
    def num_logits(self) -> int:
        if self.scoring is not None:
            # A prompt chunk that is scored needs every position: the scored ones first, the
            # sampling one (if it samples) last.
            return len(self.token_ids)
        return self.sample_positions

    @property
    def sample_positions(self) -> int:
        """The positions sampling reads: the last 1 + drafts of the row's logits."""
        return 1 + len(self.draft_ids) if self.samples else 0


@dataclass(frozen=True)
class RoundPlan:
    index: int
    rows: tuple[PlannedRow, ...]
    # (source, target) blocks copied, in order, before the forward: a row's private copy of a
    # block it shares with the prefix cache or with the other choices of its request.
    copies: tuple[tuple[int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(row.token_ids) for row in self.rows)
