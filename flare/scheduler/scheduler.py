"""Continuous batching of requests into speculative rounds.

The scheduler owns the waiting queue and the running set. Each round it plans (`_plan_round`):
admits waiting requests (`admission.py`), plans one row per running sequence (a prompt chunk:
`prefill_budget.py`, or the last sampled token plus drafts: `speculation/`; the row and its parts:
`round/sequence_row.py`), preempting the newest while blocks run short (`preemption.py`); runs
the plan on its one model thread (`round/`); and applies the result on the event loop
(`_apply`, each row's by `round/apply.py`): tokens to streams, stops, failures, freed blocks,
and what the round did to its observer (the metrics). Requests join and leave between rounds;
nothing waits for a whole batch to finish. Each sequence's blocks are `blocks.py`'s, the parts
the scheduler runs with are built by `loading.py`, and what it reports when asked is assembled
by `stats.py`.

Everything here runs on the event-loop thread except `ModelRunner.execute`, which gets an
immutable plan and returns an immutable result.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections import Counter, deque
from collections.abc import Callable

import anyio
import structlog

from flare.engine.drafters import Draft, Drafter
from flare.engine.model import DecoderModel
from flare.parallel.failstop import EngineDead
from flare.package.directory import Package
from flare.policy.params import SamplingParams
from flare.scheduler.admission import Admission
from flare.scheduler.blocks import BlockCopy, BlockManager
from flare.scheduler.emission import choice_usage
from flare.scheduler.errors import Draining, DuplicateRequestId
from flare.scheduler.failures import cancelled_failure, engine_dead_failure, round_failure, shutdown_failure
from flare.scheduler.loading import SchedulerParts, load_parts
from flare.scheduler.options import SchedulerOptions
from flare.scheduler.preemption import make_writable
from flare.scheduler.prefill_budget import prefill_chunks
from flare.scheduler.request import Failed, Finished, GenerationRequest, RequestFailure, RequestStream, Usage
from flare.scheduler.round.apply import RowApplier
from flare.scheduler.round.model_runner import ModelRunner, RoundObserver
from flare.scheduler.round.model_thread import ModelThread
from flare.scheduler.round.plan import PlannedRow, RoundPlan
from flare.scheduler.round.result import RoundResult
from flare.scheduler.round.sequence_row import sequence_row
from flare.scheduler.sequence import Sequence, SequenceState
from flare.scheduler.speculation.draft_planner import DraftPlanner
from flare.scheduler.stats import (
    RequestInfo,
    RoundTally,
    SchedulerObserver,
    SchedulerSnapshot,
    Throughput,
    occupancy,
    request_infos,
    scheduler_snapshot,
)
from flare.structured.memory import give_back_heap

log = structlog.get_logger("flare.scheduler")


class Scheduler:
    def __init__(
        self,
        parts: SchedulerParts,
        options: SchedulerOptions,
        *,
        observer: SchedulerObserver | None = None,
        heartbeat: Callable[[], None] | None = None,
    ) -> None:
        """`observer`: what observes the scheduler (the daemon's Prometheus `SchedulerMetrics`)."""
        package = parts.package
        self.package = package
        self.policy = parts.policy
        self.tokenizer = parts.tokenizer
        self.max_context = package.manifest.serving.max_context
        self.draft_tokens = parts.draft_tokens
        self.vocabulary_parallel = package.manifest.serving.vocabulary_parallel_sampling
        self.options = options
        self.observer = observer if observer is not None else SchedulerObserver()
        self.heartbeat: Callable[[], None] = heartbeat if heartbeat is not None else (lambda: None)
        self.draining = False
        self.drafter_name = parts.drafter_name
        self.grammars = parts.grammars
        self.observer.watch_grammar_cache(parts.grammars.use)
        self._runner = parts.runner
        self._blocks = BlockManager(parts.cache, parts.runner.kv_cache.block_size, head_slot=parts.runner.head is not None)
        self._admission = Admission(
            max_concurrency=parts.max_concurrency, max_context=self.max_context, options=options, blocks=self._blocks
        )
        self._speculation = DraftPlanner(
            drafter=parts.drafter,
            head=parts.runner.head is not None,
            drafter_name=parts.drafter_name,
            draft_tokens=parts.draft_tokens,
            max_context=self.max_context,
            options=options,
        )
        self._eos = frozenset(parts.tokenizer.eos_token_ids)
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._by_id: dict[str, list[Sequence]] = {}  # a request's choices, by index
        self._wake = asyncio.Event()
        self._stop = False
        self._in_flight = False
        # Every round runs on this one thread for the scheduler's life (round/model_thread.py says why).
        self._model_thread = parts.model_thread
        self._owns_model_thread = parts.owns_model_thread
        self._throughput = Throughput()
        self._rounds = 0
        self._statuses: Counter[str] = Counter()
        self._prompt_tokens: Counter[str] = Counter()  # "cached" and "computed", since start
        self._row_applier = RowApplier(
            blocks=self._blocks,
            speculation=self._speculation,
            statuses=self._statuses,
            eos=self._eos,
            max_context=self.max_context,
            fail=self._fail,
            finish=self._finish,
        )

    @classmethod
    def from_package(
        cls,
        package: Package,
        options: SchedulerOptions,
        *,
        observer: SchedulerObserver | None = None,
        heartbeat: Callable[[], None] | None = None,
        drafter: Drafter | None = None,
        round_observer: RoundObserver | None = None,
        model_thread: ModelThread | None = None,
    ) -> Scheduler:
        """Load the package's weights and size the KV cache. Heavy: call it off the event loop.

        The sampler contract is checked before any weight is read. `drafter` replaces the one
        the package names (`serving.drafter`), e.g. a learned draft head. `model_thread`: a
        thread shared with other schedulers of the process, which then keep one OpenMP team
        between them (round/model_thread.py); by default the scheduler has its own and ends it.
        """
        parts = load_parts(package, options, drafter=drafter, round_observer=round_observer, model_thread=model_thread)
        return cls(parts, options, observer=observer, heartbeat=heartbeat)

    # ----------------------------------------------------------------- the daemon's interface

    def submit(self, request: GenerationRequest) -> RequestStream:
        """Queue a request; its stream yields TextDelta events, then Finished (one per choice)
        or Failed."""
        if self.draining or self._stop:
            raise Draining()
        if request.request_id in self._by_id:
            raise DuplicateRequestId(f"request id {request.request_id!r} is already in use")
        self._admission.check(request, self._waiting, self._running, self._throughput.rate)
        stream = RequestStream(request.request_id, choices=request.n)
        # Every row on the device is seeded; an unseeded request gets a random seed here.
        seed = request.params.seed if request.params.seed is not None else secrets.randbits(63)
        choices = [
            Sequence.choice(request, stream, seed, index, self.tokenizer, self._speculation.new_state(request.prompt_token_ids))
            for index in range(request.n)
        ]
        leader = choices[0]
        leader.pending_choices = choices[1:]
        self._waiting.append(leader)
        self._by_id[request.request_id] = choices
        self._wake.set()
        log.debug(
            "request_queued",
            request_id=request.request_id,
            prompt_tokens=len(request.prompt_token_ids),
            n=request.n,
            waiting=len(self._waiting),
        )
        return stream

    def cancel(self, request_id: str, failure: RequestFailure | None = None) -> bool:
        """End one request, every choice of it, with `failure` (default: cancelled).
        Idempotent; False if unknown.

        A request with a row in the round now running ends when the round returns: its
        tokens from that round are discarded and its blocks freed, within one round.
        """
        choices = self._by_id.get(request_id)
        if choices is None:
            return False
        failure = failure or cancelled_failure("the client went away")
        if self._in_flight and any(s.state is SequenceState.RUNNING for s in choices):
            for seq in choices:
                seq.pending_cancel = failure
        else:
            self._fail(choices[0], failure)
        return True

    def drain(self) -> None:
        self.draining = True

    def resume(self) -> None:
        self.draining = False

    def stop(self) -> None:
        """Ask the loop to end after the current round; requests still there fail with `shutdown`."""
        self._stop = True
        self._wake.set()

    def clear_prefix_cache(self) -> int:
        """Drop every cached block no request holds (`flare ctl cache clear`); returns how many."""
        dropped = self._blocks.cache.clear()
        log.info("prefix_cache_cleared", blocks=dropped)
        self._publish_occupancy()
        return dropped

    @property
    def max_concurrency(self) -> int:
        """The most sequences that run at once (the choices of a request run together)."""
        return self._admission.max_concurrency

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary: token ids a request may name are below it."""
        return self._runner.vocab_size

    @property
    def target_model(self) -> DecoderModel:
        return self._runner.model

    @property
    def runner(self) -> ModelRunner:
        """What runs each round's plan on the model thread (tests wrap its `execute` to see plans)."""
        return self._runner

    @property
    def idle(self) -> bool:
        return not self._running and not self._waiting

    def snapshot(self) -> SchedulerSnapshot:
        return scheduler_snapshot(
            running=len(self._running),
            waiting=len(self._waiting),
            cache=self._blocks.cache,
            prompt_tokens=self._prompt_tokens,
            draining=self.draining,
            statuses=self._statuses,
            rounds=self._rounds,
            throughput=self._throughput,
            max_concurrency=self.max_concurrency,
            draft_tokens=self.draft_tokens,
            package=self.package,
            runner=self._runner,
            activations=self.options.activations,
        )

    def requests(self) -> list[RequestInfo]:
        return request_infos(self._by_id.values())

    async def warm_up(self) -> None:
        """Run one short request through every stage (prefill, sampling, a decode round)
        before the daemon reports ready; it also gives the cost model its first points."""
        prompt = tuple(self.tokenizer.encode("Hello")) or (0,)
        request = GenerationRequest(
            f"warm-up-{secrets.token_hex(4)}", prompt, SamplingParams(temperature=0.0, max_tokens=2)
        )
        observer, self.observer = self.observer, SchedulerObserver()  # the warm-up request is not traffic
        try:
            stream = self.submit(request)
            while not self.idle:
                await self._step()
            async for _ in stream:
                pass
        finally:
            self.observer = observer
            self._statuses.clear()
            self._throughput = Throughput()  # STATUS= and ctl report traffic, not the warm-up

    async def run(self) -> None:
        """The scheduler loop: one round at a time until stop(); then every request left fails
        with `shutdown`. Owned by the daemon's task group."""
        worked = False
        try:
            while not self._stop:
                self._runner.check_group()  # a rank lost while idle ends the loop too (EngineDead)
                self.heartbeat()
                if await self._step():
                    worked = True
                    continue
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), self.options.idle_tick_s)
                except TimeoutError:
                    if worked:
                        # A whole tick idle after rounds: what they freed (a long prompt's
                        # activations, tens of MB) goes back to the system instead of staying in
                        # the allocator's arenas. Not at once: the trim costs milliseconds, and
                        # the next round would fault the pages back in, between requests that
                        # follow each other closely.
                        await anyio.to_thread.run_sync(give_back_heap)
                        worked = False
        finally:
            for seq in [*self._running, *self._waiting]:
                self._fail(seq, shutdown_failure())
            if self._owns_model_thread:
                self._model_thread.shutdown(wait=True)  # idle: no round is in flight here
                self._runner.close()

    # ----------------------------------------------------------------- one round

    async def _step(self) -> bool:
        """Plan, run and apply one round; False when there was nothing to do."""
        plan = self._plan_round()
        if plan is None:
            return False
        self._in_flight = True
        try:
            result = await self._on_model_thread(self._runner.execute, plan)
        except EngineDead as error:  # a lost rank: every request ends, and the raise stops the daemon
            log.error("engine_dead", round=plan.index, reason=error.reason)
            for seq in [*self._running, *self._waiting]:
                self._fail(seq, engine_dead_failure(error.reason))
            raise
        except Exception as error:  # a bug or device fault outside any row's status
            log.exception("round_failed", round=plan.index, rows=len(plan.rows))
            failure = round_failure(plan.index, error)
            for row in plan.rows:
                if (choices := self._by_id.get(row.request_id)) is not None:
                    self._fail(choices[0], failure)
            return True
        finally:
            self._in_flight = False
        self._apply(plan, result)
        return True

    async def _on_model_thread(self, work: Callable[[RoundPlan], RoundResult], plan: RoundPlan) -> RoundResult:
        future = asyncio.wrap_future(self._model_thread.submit_round(work, plan))
        # As anyio.to_thread.run_sync does: a cancelled caller still waits for the round, whose
        # rows and KV blocks are in use until it returns.
        with anyio.CancelScope(shield=True):
            return await future

    # ----------------------------------------------------------------- planning a round

    def _plan_round(self) -> RoundPlan | None:
        """Admit, fork, and plan one row per running sequence within the round's token budget:
        prefill chunks, and decode rows with their drafts."""
        for seq in self._admission.admit(self._waiting, self._running):
            self._count_cached_prompt(seq, computed=0)
        self._admission.fork_choices(self._running)
        for seq in self._running:
            if not seq.in_decode:  # the blocks of its prompt that other prompts computed since
                computed = seq.num_cached
                self._blocks.map_cached_prefix(seq)
                self._count_cached_prompt(seq, computed)
        if not self._running:
            return None
        index = self._rounds
        copies: list[BlockCopy] = []
        decode = [s for s in self._running if s.in_decode]
        in_order = sorted(self._running, key=lambda s: (s.arrival, s.index))
        prefilling = [s for s in in_order if not s.in_decode]
        followers = self._blocks.followers(prefilling)
        chunks = prefill_chunks([s for s in prefilling if s not in followers], len(decode), self.options)
        base_tokens = len(decode) + sum(chunks.values())
        drafts = self._speculation.drafts(decode, base_tokens, requests_waiting=bool(self._waiting))
        token_seconds = self._speculation.token_seconds(base_tokens, len(decode))
        rows: list[PlannedRow] = []
        for seq in in_order:
            if seq.state is not SequenceState.RUNNING:
                continue  # preempted while planning this round
            draft = drafts.get(seq, Draft(()))
            tail = seq.tokens[seq.num_cached :]
            if not seq.in_decode:
                tail = seq.tokens[seq.num_cached : seq.num_cached + chunks.get(seq, 0)]
                if not tail:
                    continue
            row_tokens = len(tail) + len(draft.token_ids)
            samples = seq.num_cached + len(tail) == len(seq.tokens)
            head_steps = self._speculation.head_steps(seq, row_tokens, len(draft.token_ids), token_seconds) if samples else 0
            # A drafting row's head writes the new token's slot, one past the row's tokens at
            # most, and K - 1 more.
            writable = make_writable(
                seq,
                seq.num_cached + row_tokens + head_steps,
                blocks=self._blocks,
                running=self._running,
                waiting=self._waiting,
            )
            if writable is None:
                if seq.state is SequenceState.RUNNING:
                    # Alone and still short: the sequence has outgrown the whole cache. Waiting
                    # would never help, so it ends here, as at the context length.
                    log.warning("request_outgrew_kv_cache", request_id=seq.request_id, tokens=len(seq.tokens))
                    self._finish(seq, Finished("length", choice_usage(seq), fell_back=seq.fell_back, index=seq.index))
                continue  # `seq` was preempted (it waits for blocks) or outgrew the cache and ended
            copies += writable
            rows.append(
                sequence_row(
                    seq,
                    tail,
                    draft,
                    samples,
                    head_steps,
                    vocabulary_parallel=self.vocabulary_parallel,
                    fault_injection=self.options.fault_injection,
                )
            )
        # A row dropped after its blocks were made writable (its sequence preempted by a later
        # row) leaves a copy into a block that is free again: harmless, the copies run first.
        rows = [row for row in rows if self._row_still_planned(row)]
        if not rows:
            return None
        self._rounds += 1
        return RoundPlan(index, tuple(rows), tuple(copies))

    def _row_still_planned(self, row: PlannedRow) -> bool:
        choices = self._by_id.get(row.request_id)
        return choices is not None and choices[row.choice].state is SequenceState.RUNNING

    def _count_cached_prompt(self, seq: Sequence, computed: int) -> None:
        """The prompt tokens the prefix cache served `seq` past the `computed` it had before it
        was mapped (admission's, or while it prefills, blocks other prompts computed since)."""
        cached = min(seq.num_cached, seq.num_prompt_tokens) - min(computed, seq.num_prompt_tokens)
        if not cached:
            return
        if not seq.preemptions:
            seq.cached_prompt_tokens += cached  # the first run's hits are what the request's usage reports
        self._prompt_tokens["cached"] += cached
        self.observer.prompt_cached(cached)
        log.debug("prefix_cache_hit", request_id=seq.request_id, tokens=cached)

    # ----------------------------------------------------------------- applying a round

    def _apply(self, plan: RoundPlan, result: RoundResult) -> None:
        """Each row's result into its sequence, then what the round did to the observer."""
        self._speculation.observe_round(plan, result)
        now = time.monotonic()
        tally = RoundTally(head_seconds=result.head_seconds)
        for row, outcome in zip(plan.rows, result.rows):
            choices = self._by_id.get(row.request_id)
            seq = choices[row.choice] if choices is not None else None
            if seq is None or seq.state is not SequenceState.RUNNING:
                continue
            if seq.pending_cancel is not None:
                self._fail(seq, seq.pending_cancel)
                continue
            self._row_applier.apply(plan.index, row, outcome, seq, now, tally)
        # A request cancelled while the round ran but without a row in it ends now.
        for choices in [c for c in self._by_id.values() if any(s.pending_cancel for s in c)]:
            self._fail(choices[0], next(s.pending_cancel for s in choices if s.pending_cancel is not None))
        self._throughput.observe(tally.generated)
        self._prompt_tokens["computed"] += tally.prompt_tokens
        # What the draft-length model learns from (flare_draft_tokens_* give the totals only).
        log.debug(
            "round_completed",
            round=plan.index,
            rows=len(plan.rows),
            tokens=plan.num_tokens,
            drafts=sum(tally.proposed.values()),
            accepted=sum(tally.accepted_per_row),
            generated=tally.generated,
            copies=len(plan.copies),
            seconds=round(result.seconds, 4),
            head_seconds=round(result.head_seconds, 4),
        )
        self.observer.round_applied(tally)
        self._publish_occupancy()

    # ----------------------------------------------------------------- ending a request

    def _fail(self, seq: Sequence, failure: RequestFailure) -> None:
        """End `seq`'s request with `failure`: every choice of it not finished yet (a request's
        answer is whole or failed), with one Failed event and usage over all its choices."""
        choices = self._by_id.pop(seq.request_id, None)
        if choices is None:
            return  # ended already
        for choice in choices:
            self._end(choice, publish=False)
        usage = Usage(
            seq.num_prompt_tokens,
            sum(s.num_output_tokens for s in choices),
            seq.cached_prompt_tokens,
            sum(s.prediction_accepted for s in choices),
            sum(s.prediction_rejected for s in choices),
        )
        seq.stream.put(Failed(failure, usage))
        self.observer.request_ended(time.monotonic() - seq.arrival)
        log.info("request_failed", request_id=seq.request_id, code=failure.code)

    def _finish(self, seq: Sequence, event: Finished) -> None:
        if seq.state is SequenceState.FINISHED:
            return
        # The answer's blocks are published too: the next turn of a chat resends it.
        self._end(seq, publish=True)
        choices = self._by_id.get(seq.request_id, [])
        seq.stream.put(event)
        if all(s.state is SequenceState.FINISHED for s in choices):
            self._by_id.pop(seq.request_id, None)
            self.observer.request_ended(time.monotonic() - seq.arrival)

    def _end(self, seq: Sequence, *, publish: bool) -> None:
        """Take `seq` out of the running set or the queue and give back its blocks."""
        if seq.state is SequenceState.FINISHED:
            return
        if seq.state is SequenceState.RUNNING:
            self._running.remove(seq)
        else:
            with contextlib.suppress(ValueError):
                self._waiting.remove(seq)
        seq.state = SequenceState.FINISHED
        seq.pending_choices = []
        if publish:
            self._blocks.publish(seq)
        self._blocks.release(seq)
        self._publish_occupancy()
        self._wake.set()

    def _publish_occupancy(self) -> None:
        self.observer.occupancy_changed(occupancy(len(self._running), len(self._waiting), self._blocks.cache))
