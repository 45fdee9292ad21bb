"""Admission: which requests the scheduler takes, and which waiting sequences start running.

At submission a request is refused (errors.py) when it could never run here (more choices than
`max_concurrency`, a prompt longer than the context or than the whole KV cache) or when it would
have to wait while the waiting queue is full (`max_waiting` requests or `max_waiting_tokens`
prompt tokens). Before each round, waiting sequences join the running set in arrival order while
`max_concurrency` allows it and their blocks fit. A request's choices run together: its first
choice is admitted with a slot for each, and the others join once it has computed the prompt.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import structlog

from flare.scheduler.blocks import BlockManager
from flare.scheduler.errors import PromptTooLong, QueueFull, TooManyChoices
from flare.scheduler.options import SchedulerOptions
from flare.scheduler.request import GenerationRequest
from flare.scheduler.sequence import Sequence, SequenceState

log = structlog.get_logger("flare.scheduler")


def slots(sequences: Iterable[Sequence]) -> int:
    """Running slots `sequences` take: one each, plus the choices waiting to fork off them."""
    return sum(1 + len(s.pending_choices) for s in sequences)


class Admission:
    def __init__(self, *, max_concurrency: int, max_context: int, options: SchedulerOptions, blocks: BlockManager) -> None:
        self.max_concurrency = max_concurrency
        self._max_context = max_context
        self._max_waiting = options.max_waiting
        self._max_waiting_tokens = options.max_waiting_tokens
        self._blocks = blocks

    def check(
        self, request: GenerationRequest, waiting: deque[Sequence], running: list[Sequence], tokens_per_second: float
    ) -> None:
        """Raise the AdmissionError that refuses `request`, if one does; `tokens_per_second`, the
        recent rate, sizes a full queue's Retry-After."""
        if not 1 <= request.n <= self.max_concurrency:
            raise TooManyChoices(
                f"n is {request.n}, but this server runs at most {self.max_concurrency} sequences at once "
                f"(max_concurrency) and the choices of one request run together; send n <= {self.max_concurrency}",
                self.max_concurrency,
            )
        prompt_len = len(request.prompt_token_ids)
        if prompt_len + 1 > self._max_context:
            raise PromptTooLong(
                f"the prompt has {prompt_len} tokens; this model's context is {self._max_context} tokens, "
                f"including at least one generated token",
                prompt_len,
                self._max_context - 1,
            )
        capacity = self._blocks.capacity
        # The choices share the prompt's blocks; each needs a block of its own after them.
        if prompt_len + 1 + (request.n - 1) * self._blocks.block_size > capacity:
            raise PromptTooLong(
                f"the prompt has {prompt_len} tokens but the whole KV cache holds {capacity}"
                + (f" (less a block for each of the other {request.n - 1} choices)" if request.n > 1 else "")
                + "; it can never be served here (raise --kv-cache-memory)",
                prompt_len,
                capacity - 1 - (request.n - 1) * self._blocks.block_size,
            )
        waiting_tokens = sum(len(s.tokens) for s in waiting)
        # The bounds are on requests that must wait: while running slots are free, a request
        # is never refused for the queue's sake (even with --max-waiting 0).
        must_wait = slots(running) + slots(waiting) + request.n > self.max_concurrency
        queue_full = len(waiting) >= self._max_waiting
        tokens_full = waiting_tokens + prompt_len > self._max_waiting_tokens
        if must_wait and (queue_full or tokens_full):
            raise QueueFull(
                f"the waiting queue is full ({len(waiting)} requests, {waiting_tokens} prompt tokens)",
                retry_after_s=self._retry_after_s(waiting, tokens_per_second),
            )

    def admit(self, waiting: deque[Sequence], running: list[Sequence]) -> list[Sequence]:
        """Move waiting sequences, in order, into the running set while they fit; returns them."""
        admitted: list[Sequence] = []
        used = slots(running)
        while waiting:
            seq = waiting[0]
            group = 1 + len(seq.pending_choices)
            if used + group > self.max_concurrency:
                break
            if not seq.block_table:
                self._blocks.map_cached_prefix(seq)
            # Admit when the whole sequence fits with a block of headroom per running sequence,
            # so admission does not immediately force a preemption.
            if self._blocks.admission_need(seq) + len(running) > self._blocks.cache.num_available and running:
                self._blocks.release(seq)  # cached blocks it found stay evictable while it waits
                break
            waiting.popleft()
            seq.state = SequenceState.RUNNING
            running.append(seq)
            admitted.append(seq)
            used += group
        return admitted

    def fork_choices(self, running: list[Sequence]) -> None:
        """The other choices of a request share its first choice's blocks once those hold all
        but the prompt's last token; from then on each runs as a sequence of its own."""
        for leader in [s for s in running if s.pending_choices]:
            if leader.num_cached < leader.num_prompt_tokens - 1:
                continue
            self._blocks.fork(leader)
            for choice in leader.pending_choices:
                choice.cached_prompt_tokens = leader.cached_prompt_tokens
                choice.prompt_logprobs = list(leader.prompt_logprobs)
                choice.state = SequenceState.RUNNING
                running.append(choice)
            log.debug("choices_forked", request_id=leader.request_id, n=1 + len(leader.pending_choices))
            leader.pending_choices = []

    def _retry_after_s(self, waiting: deque[Sequence], tokens_per_second: float) -> float:
        """A rough wait until a queue slot frees: the queued tokens at the recent rate."""
        rate = max(tokens_per_second, 1.0)
        queued = sum(s.request.params.max_tokens for s in waiting)
        return float(min(60, max(1, round(queued / rate / max(1, self.max_concurrency)))))
