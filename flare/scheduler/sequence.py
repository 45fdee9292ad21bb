"""One request's state inside the scheduler (touched only by the event-loop thread)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from flare.engine.drafters import Draft, DraftState
from flare.engine.drafters.prediction import PredictionState
from flare.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from flare.sampler.status import DeviceStatus
from flare.scheduler.speculation.draft_length import AcceptanceEstimate
from flare.scheduler.request import GenerationRequest, RequestFailure, RequestStream, TokenLogprob, choice_seed
from flare.scheduler.stop_strings import StopStringMatcher
from flare.structured import GrammarState


# What can propose a row's drafts (`Sequence.draft_source`): n-gram lookup, the draft head, the
# request's predicted output, and a grammar's forced run (jump-forward), which is no drafter's
# and teaches no estimate.
PREDICTION_SOURCE = "prediction"
GRAMMAR_SOURCE = "grammar"
DRAFT_SOURCES = ("ngram", "mtp", PREDICTION_SOURCE, GRAMMAR_SOURCE)


class SequenceState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One choice of a request: its tokens, KV blocks and streaming state.

    `tokens` is the prompt followed by the output. `num_cached` tokens have their keys and
    values in the blocks of `block_table`; the next round feeds `tokens[num_cached:]` (the
    rest of the prompt, in chunks, or the last sampled token) plus any drafts. After a
    preemption `num_cached` is 0 and the whole sequence is recomputed: the output is unchanged
    because the random stream is keyed by seed and output position, not by round.

    The blocks of the table may be shared: with the prefix cache (the leading
    `num_published` ones were offered to it) and with the other choices of the request. The
    first choice computes the prompt; the others wait in its `pending_choices` until it has
    all but the prompt's last token, then share those blocks.
    """

    request: GenerationRequest
    stream: RequestStream
    seed: int
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher
    draft_state: DraftState | None
    index: int = 0  # the choice's index in the request's answer
    arrival: float = field(default_factory=time.monotonic)
    tokens: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # of the full blocks of `tokens`, as far as computed
    num_published: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens the prefix cache served in the first run
    pending_choices: list[Sequence] = field(default_factory=list)
    state: SequenceState = SequenceState.WAITING
    sampled_rounds: int = 0  # rounds in which this sequence sampled tokens
    fell_back: bool = False  # speculation turned off after INVALID_SPECULATION
    head_draft: Draft | None = None  # the draft head's proposal from the last round (drafters/mtp.py)
    head_pause: int = 0  # rounds left without head drafts (`DraftPlanner.head_steps`)
    head_cached: int = 0  # head slots computed for the committed tokens (drafters/mtp.py)
    # How often a round went on to verify the head's drafts for this row (under `auto` n-gram
    # lookup takes the rounds where it proposes): a step of the head is weighed by it.
    head_use: AcceptanceEstimate = field(default_factory=lambda: AcceptanceEstimate(rate=1.0, prior=1.0))
    # Which drafter proposed the row's drafts this round (`DRAFT_SOURCES`), and each drafter's
    # acceptance on this row (`--drafter auto` runs both).
    draft_source: str = "ngram"
    source_acceptance: dict[str, AcceptanceEstimate] = field(
        default_factory=lambda: {source: AcceptanceEstimate() for source in ("ngram", "mtp", PREDICTION_SOURCE)}
    )
    # Where the output stands in the request's predicted output, and how many of the predicted
    # tokens this choice drafted were accepted and rejected (its usage reports both).
    prediction_state: PredictionState | None = None
    prediction_accepted: int = 0
    prediction_rejected: int = 0
    pending_cancel: RequestFailure | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    preemptions: int = 0
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # of prompt tokens 1.., as scored
    emitted: bool = False  # a first delta was put (it carries the prompt's log-probabilities)
    grammar: GrammarState | None = None  # where this choice's answer is in its grammar

    @classmethod
    def choice(
        cls,
        request: GenerationRequest,
        stream: RequestStream,
        seed: int,
        index: int,
        tokenizer: Tokenizer,
        draft_state: DraftState | None,
    ) -> Sequence:
        """Choice `index` of `request`, seeded from the request's `seed` (`choice_seed`)."""
        return cls(
            request=request,
            stream=stream,
            seed=choice_seed(seed, index),
            detokenizer=IncrementalDetokenizer(tokenizer, list(request.prompt_token_ids)),
            stop_matcher=StopStringMatcher(request.params.stop),
            draft_state=draft_state,
            index=index,
            grammar=GrammarState(request.grammar) if request.grammar is not None else None,
            prediction_state=PredictionState(request.prediction) if request.prediction else None,
        )

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.request.prompt_token_ids)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.tokens) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]

    @property
    def draft_acceptance(self) -> float:
        """The acceptance the draft-length model weighs this round's drafts by: their drafter's on
        this row (0 for a grammar's forced run, which is proposed whole, past the model)."""
        estimate = self.source_acceptance.get(self.draft_source)
        return estimate.rate if estimate is not None else 0.0

    def fault_due(self) -> DeviceStatus | None:
        """The device status the request asks injected (`FaultSpec`) when this is the round of
        its sampling it names (its first by default); the scheduler injects only with
        `--fault-injection`."""
        fault = self.request.fault
        if fault is None:
            return None
        target = 0 if fault.round is None else fault.round
        return fault.status if self.sampled_rounds == target else None

    @property
    def in_decode(self) -> bool:
        """Everything but the last sampled token is cached: the next row is a decode row."""
        return self.num_output_tokens > 0 and self.num_cached == len(self.tokens) - 1
