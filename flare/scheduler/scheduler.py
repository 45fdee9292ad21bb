"""Continuous batching of requests into speculative rounds.

The scheduler owns the waiting queue and the running set. Each round it admits waiting
requests (up to `max_concurrency` running, when their prompt fits in free KV blocks), plans one
row per running sequence (a prompt chunk, or the last sampled token plus drafts), runs the
round in its one worker thread, and applies the result on the event loop: tokens to streams,
stops, failures, freed blocks. Requests join and leave between rounds; nothing waits for a
whole batch to finish.

Everything here runs on the event-loop thread except `ModelRunner.execute`, which gets an
immutable plan and returns an immutable result.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

import anyio
import structlog
import torch

from flare.engine.drafters import Draft, Drafter, make_drafter
from flare.engine.drafters.mtp import load_draft_head
from flare.engine.kv_cache import BlockAllocator, KVCache, OutOfBlocks, blocks_for_tokens, default_kv_cache_bytes
from flare.engine.model import LlamaModel, load_model
from flare.engine.precision import cpu_flags, dtype_name
from flare.engine.prefix_cache import PrefixCache, chain_hashes, namespace_hash
from flare.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from flare.kernels.status import DeviceStatus
from flare.preparation.contract import check_contract
from flare.preparation.package import Package
from flare.sampling.params import SamplingParams
from flare.sampling.policy import PolicyError, SamplingPolicy
from flare.scheduler.draft_length import HeadCostModel, RoundCostModel, choose_draft_lengths, worthwhile_head_steps
from flare.scheduler.errors import (
    ContractViolation,
    Draining,
    DuplicateRequestId,
    PromptTooLong,
    QueueFull,
    TooManyChoices,
)
from flare.scheduler.failures import cancelled_failure, device_failure, grammar_failure, shutdown_failure
from flare.scheduler.metrics import SchedulerMetrics
from flare.scheduler.model_runner import ModelRunner, PlannedRow, RoundObserver, RoundPlan, RoundResult
from flare.scheduler.model_thread import ModelThread
from flare.scheduler.request import (
    Failed,
    FaultSpec,
    Finished,
    GenerationRequest,
    RequestFailure,
    RequestStream,
    TextDelta,
    TokenLogprob,
    Usage,
    choice_seed,
)
from flare.scheduler.sequence import GRAMMAR_SOURCE, Sequence, SequenceState
from flare.scheduler.stop_strings import StopStringMatcher
from flare.structured import GrammarCompiler, GrammarState

log = structlog.get_logger("flare.scheduler")

# The most tokens a grammar's forced run is proposed at once (jump-forward drafts).
JUMP_FORWARD_TOKENS = 16

# Faults that need the row to verify at least one draft to reach their device path.
_DRAFT_FAULTS = (DeviceStatus.INVALID_DRAFT_TOKEN, DeviceStatus.INVALID_DRAFT_PROBABILITY)

# Rounds a row's draft head pauses after the draft-length model declined its drafts, per decode
# row of the round, before it drafts one token again to be weighed anew (`Scheduler._head_steps`).
HEAD_PAUSE_ROUNDS = 16


@dataclass(frozen=True)
class SchedulerOptions:
    max_concurrency: int | None = None  # None: the package's serving.max_concurrency
    max_waiting: int = 256
    max_waiting_tokens: int = 262_144
    kv_cache_memory: int | None = None  # bytes; None: default_kv_cache_bytes
    kv_cache_dtype: str = "float32"  # manifest.KV_CACHE_DTYPES: what the KV cache stores
    prefix_cache: bool = True  # keep full KV blocks after their request for later prompts to share
    block_size: int = 16
    max_batched_tokens: int = 256  # tokens fed per round: bounds a prompt chunk's share of a round
    draft_tokens: int | None = None  # None: the package's serving.draft_tokens; may only lower it
    # ngram, mtp (the package's learned draft head) or auto (mtp where the package ships a head,
    # else ngram); None: the package's serving.drafter.
    drafter: str | None = None
    adaptive_draft_length: bool = True  # False: every decode row verifies all the drafter proposes
    vocabulary_shards: int = 1
    sampling_policy: Literal["package", "unfiltered"] = "package"
    on_invalid_speculation: Literal["fallback", "fail"] = "fallback"
    fault_injection: bool = False
    jump_forward: bool = True  # propose the tokens a grammar forces as drafts (free: always accepted)
    device: str = "cpu"
    weight_format: str = "auto"  # precision.FORMAT_CHOICES: what the linear layers multiply in
    idle_tick_s: float = 1.0  # how often an idle loop wakes to send its heartbeat


def resolve_drafter(package: Package, requested: str | None) -> str:
    """The drafter to run: `requested` (ngram, mtp, auto) or the package's serving.drafter.
    mtp for a package without a draft head raises ValueError naming the fix."""
    name = requested or package.manifest.serving.drafter
    has_head = package.manifest.draft_head is not None
    if name == "auto":
        # The head, with n-gram lookup beside it (`Scheduler._proposal`); n-gram alone without one.
        return "mtp" if has_head else "ngram"
    if name == "mtp" and not has_head:
        raise ValueError(
            f"--drafter mtp: the package at {package.path} ships no draft head; re-export it with "
            "`flare export SOURCE -o DIR --drafter mtp` to distill one, or run with --drafter ngram"
        )
    if name not in ("ngram", "mtp"):
        raise ValueError(f"--drafter must be one of ngram, mtp, auto, got {name!r}")
    return name


def served_policy(package: Package, mode: Literal["package", "unfiltered"]) -> SamplingPolicy:
    """The policy requests are clamped to: the package's own, after the same sampler contract
    check that export runs, or `unfiltered()` of it (`flare run --sampling-policy unfiltered`)."""
    policy = package.manifest.sampling
    if mode == "unfiltered":
        try:
            return policy.unfiltered()
        except PolicyError as error:
            raise ContractViolation(f"--sampling-policy unfiltered cannot serve {package.path}: {error}") from error
    problems = check_contract(package.manifest.serving, policy, str(package.path))
    if problems:
        raise ContractViolation(f"refusing to serve {package.path}: " + " ".join(p.message for p in problems))
    return policy


@dataclass(frozen=True)
class RequestInfo:
    request_id: str
    state: str
    age_s: float
    prompt_tokens: int
    completion_tokens: int  # over all its choices


@dataclass(frozen=True)
class SchedulerSnapshot:
    running: int
    waiting: int
    kv_blocks_used: int  # held by requests
    kv_blocks_total: int
    prefix_cache: bool
    kv_blocks_cached: int  # published in the prefix cache, in use or not
    kv_blocks_evictable: int  # cached and held by no request: reclaimed when blocks run out
    prompt_tokens_cached: int  # since start: prompt tokens served from the prefix cache
    prompt_tokens_computed: int  # since start: prompt tokens prefilled
    draining: bool
    device_statuses: dict[str, int]
    rounds: int
    tokens_per_second: float
    max_concurrency: int
    draft_tokens: int
    weights_dtype: str  # what the package stores
    weight_format: str  # what the linear layers multiply in here (`precision.WeightFormat`)
    kv_cache_dtype: str  # what the KV cache stores keys and values as
    # Tensors and bytes by stored type (Q4_1, F32, ...): `package.weight_types`.
    weight_types: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass
class _Throughput:
    """Generated tokens per second over the last `window_s` seconds (0 once the daemon idles)."""

    window_s: float = 10.0
    _rounds: deque[tuple[float, int]] = field(default_factory=deque)

    def observe(self, tokens: int) -> None:
        now = time.monotonic()
        self._rounds.append((now, tokens))
        # Pruned here too, not only when read: a daemon nobody asks (no systemd, no ctl) would
        # otherwise keep one entry per round forever.
        self._forget_before(now - self.window_s)

    @property
    def rate(self) -> float:
        self._forget_before(time.monotonic() - self.window_s)
        return sum(tokens for _, tokens in self._rounds) / self.window_s

    def _forget_before(self, horizon: float) -> None:
        while self._rounds and self._rounds[0][0] < horizon:
            self._rounds.popleft()


class Scheduler:
    def __init__(
        self,
        *,
        package: Package,
        policy: SamplingPolicy,
        tokenizer: Tokenizer,
        runner: ModelRunner,
        blocks: PrefixCache,
        drafter: Drafter | None,
        options: SchedulerOptions,
        drafter_name: str = "ngram",
        max_concurrency: int,
        draft_tokens: int,
        metrics: SchedulerMetrics | None = None,
        heartbeat: Callable[[], None] | None = None,
        model_thread: ModelThread,
        owns_model_thread: bool = True,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        self.package = package
        self.policy = policy
        self.tokenizer = tokenizer
        self.max_context = package.manifest.serving.max_context
        self.max_concurrency = max_concurrency
        self.draft_tokens = draft_tokens
        self.vocabulary_parallel = package.manifest.serving.vocabulary_parallel_sampling
        self.options = options
        self.metrics = metrics
        self.heartbeat = heartbeat
        self.draining = False
        self._runner = runner
        self._blocks = blocks
        self._drafter = drafter
        # The learned draft head runs inside the round (ModelRunner.head); its drafts come back
        # with the round's result and are kept on the sequence for its next round.
        self._mtp = runner.head is not None
        self.drafter_name = drafter_name if draft_tokens > 0 else "none"
        self._block_size = runner.kv_cache.block_size
        self._eos = frozenset(tokenizer.eos_token_ids)
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._by_id: dict[str, list[Sequence]] = {}  # a request's choices, by index
        self._wake = asyncio.Event()
        self._stop = False
        self._in_flight = False
        # Every round runs on this one thread for the scheduler's life, the one that loaded the
        # weights (model_thread.py). torch keeps native state per calling thread (an OpenMP team,
        # MKL/oneDNN buffers) that is not given back when the thread ends; rounds on anyio's pooled
        # threads, which retire after 10 s idle and are replaced, grew resident memory by ~0.4 MiB
        # per request (tests/reliability/test_disconnects.py).
        self._model_thread = model_thread
        self._owns_model_thread = owns_model_thread
        self._cost = RoundCostModel()
        self._head_cost = HeadCostModel()
        self._throughput = _Throughput()
        self._rounds = 0
        self._statuses: Counter[str] = Counter()
        self._prompt_tokens: Counter[str] = Counter()  # "cached" and "computed", since start
        self._copies: list[tuple[int, int]] = []  # the copy-on-writes of the round being planned
        self.grammars = grammars

    # ----------------------------------------------------------------- construction

    @classmethod
    def from_package(
        cls,
        package: Package,
        options: SchedulerOptions,
        *,
        metrics: SchedulerMetrics | None = None,
        heartbeat: Callable[[], None] | None = None,
        drafter: Drafter | None = None,
        round_observer: RoundObserver | None = None,
        model_thread: ModelThread | None = None,
    ) -> Scheduler:
        """Load the package's weights and size the KV cache. Heavy: call it off the event loop.

        The sampler contract is checked before any weight is read. `drafter` replaces the one
        the package names (`serving.drafter`), e.g. a learned draft head. `model_thread`: a
        thread shared with other schedulers of the process, which then keep one OpenMP team
        between them (model_thread.py); by default the scheduler has its own and ends it.
        """
        serving = package.manifest.serving
        policy = served_policy(package, options.sampling_policy)
        max_concurrency = min(options.max_concurrency or serving.max_concurrency, serving.max_concurrency)
        draft_tokens = serving.draft_tokens if options.draft_tokens is None else options.draft_tokens
        if draft_tokens > serving.draft_tokens:
            raise ValueError(
                f"--draft-tokens {draft_tokens} is more than the package's {serving.draft_tokens} "
                f"(serving.draft_tokens); it may only lower it: re-export with --mtp-draft-tokens to raise it"
            )
        drafter_name = resolve_drafter(package, options.drafter)
        auto = (options.drafter or serving.drafter) == "auto"
        device = torch.device(options.device)
        config = package.manifest.model

        def load() -> ModelRunner:
            model = load_model(package, device=device, weight_format=options.weight_format)
            kv_dtype = getattr(torch, options.kv_cache_dtype)
            budget = options.kv_cache_memory or default_kv_cache_bytes(
                config,
                max_context=serving.max_context,
                max_concurrency=max_concurrency,
                block_size=options.block_size,
                dtype=kv_dtype,
            )
            kv_cache = KVCache.for_budget(config, budget, block_size=options.block_size, dtype=kv_dtype, device=device)
            log.info(
                "engine_loaded",
                device=str(device),
                threads=torch.get_num_threads(),
                native_kernels=model.native_kernels,
                weights_dtype=serving.dtype,
                weight_format=str(model.weight_format),
                weight_types=package.weight_types(),
                cpu_flags=" ".join(cpu_flags()),
                kv_cache_blocks=kv_cache.num_blocks,
                kv_cache_dtype=dtype_name(kv_cache.dtype),
                block_size=kv_cache.block_size,
                prefix_cache=options.prefix_cache,
                drafter=drafter_name if draft_tokens > 0 else "none",
                draft_tokens=draft_tokens,
            )
            head = None
            if drafter_name == "mtp" and draft_tokens > 0:
                head = load_draft_head(
                    package, model, num_blocks=kv_cache.num_blocks, block_size=kv_cache.block_size, kv_dtype=kv_cache.dtype
                )
            return ModelRunner(
                model,
                kv_cache,
                vocab_size=config.vocab_size,
                vocabulary_shards=options.vocabulary_shards,
                fallback_on_invalid_speculation=options.on_invalid_speculation == "fallback",
                device=device,
                head=head,
                observer=round_observer,
            )

        # The weights load on the thread that will run the rounds (model_thread.py says why).
        owns_model_thread = model_thread is None
        model_thread = model_thread or ModelThread()
        try:
            runner = model_thread.run(load)
        except BaseException:
            if owns_model_thread:
                model_thread.shutdown()
            raise
        model, kv_cache, head = runner.model, runner.kv_cache, runner.head
        # Whatever besides the tokens decides a block's keys and values: the weights (by their
        # checksums) and the dtypes the model computes and stores them in.
        root = namespace_hash(
            *(f"{name}={digest}" for name, digest in sorted(package.manifest.files.items())),
            f"kv={dtype_name(kv_cache.dtype)}",
            f"weights={model.weight_format}",
            f"native={model.native_kernels}",
        )
        return cls(
            package=package,
            policy=policy,
            tokenizer=Tokenizer.from_package(package),
            runner=runner,
            blocks=PrefixCache(BlockAllocator(kv_cache.num_blocks), root=root, enabled=options.prefix_cache),
            # n-gram lookup runs alone, or beside the head under `auto` (rows whose text repeats).
            drafter=(drafter or make_drafter("ngram")) if draft_tokens > 0 and (head is None or auto) else None,
            options=options,
            drafter_name="auto" if auto and head is not None else drafter_name,
            max_concurrency=max_concurrency,
            draft_tokens=draft_tokens,
            metrics=metrics,
            heartbeat=heartbeat,
            model_thread=model_thread,
            owns_model_thread=owns_model_thread,
            grammars=GrammarCompiler(
                package.tokenizer_json_path.read_text(encoding="utf-8"),
                vocab_size=config.vocab_size,
                eos_token_ids=config.eos_token_ids,
            ),
        )

    # ----------------------------------------------------------------- the daemon's interface

    def submit(self, request: GenerationRequest) -> RequestStream:
        """Queue a request; its stream yields TextDelta events, then Finished (one per choice)
        or Failed."""
        if self.draining or self._stop:
            raise Draining()
        if request.request_id in self._by_id:
            raise DuplicateRequestId(f"request id {request.request_id!r} is already in use")
        if not 1 <= request.n <= self.max_concurrency:
            raise TooManyChoices(
                f"n is {request.n}, but this server runs at most {self.max_concurrency} sequences at once "
                f"(max_concurrency) and the choices of one request run together; send n <= {self.max_concurrency}",
                self.max_concurrency,
            )
        prompt_len = len(request.prompt_token_ids)
        if prompt_len + 1 > self.max_context:
            raise PromptTooLong(
                f"the prompt has {prompt_len} tokens; this model's context is {self.max_context} tokens, "
                f"including at least one generated token",
                prompt_len,
                self.max_context - 1,
            )
        capacity = self._blocks.allocator.num_total * self._block_size
        # The choices share the prompt's blocks; each needs a block of its own after them.
        if prompt_len + 1 + (request.n - 1) * self._block_size > capacity:
            raise PromptTooLong(
                f"the prompt has {prompt_len} tokens but the whole KV cache holds {capacity}"
                + (f" (less a block for each of the other {request.n - 1} choices)" if request.n > 1 else "")
                + "; it can never be served here (raise --kv-cache-memory)",
                prompt_len,
                capacity - 1 - (request.n - 1) * self._block_size,
            )
        waiting_tokens = sum(len(s.tokens) for s in self._waiting)
        # The bounds are on requests that must wait: while running slots are free, a request
        # is never refused for the queue's sake (even with --max-waiting 0).
        must_wait = self._slots(self._running) + self._slots(self._waiting) + request.n > self.max_concurrency
        queue_full = len(self._waiting) >= self.options.max_waiting
        tokens_full = waiting_tokens + prompt_len > self.options.max_waiting_tokens
        if must_wait and (queue_full or tokens_full):
            raise QueueFull(
                f"the waiting queue is full ({len(self._waiting)} requests, {waiting_tokens} prompt tokens)",
                retry_after_s=self._retry_after_s(),
            )
        stream = RequestStream(request.request_id, choices=request.n)
        # Every row on the device is seeded; an unseeded request gets a random seed here.
        seed = request.params.seed if request.params.seed is not None else secrets.randbits(63)
        choices = [self._new_sequence(request, stream, seed, index) for index in range(request.n)]
        leader = choices[0]
        leader.pending_choices = choices[1:]
        self._waiting.append(leader)
        self._by_id[request.request_id] = choices
        self._wake.set()
        log.debug(
            "request_queued",
            request_id=request.request_id,
            prompt_tokens=prompt_len,
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
        dropped = self._blocks.clear()
        log.info("prefix_cache_cleared", blocks=dropped)
        if self.metrics is not None:
            self._publish_occupancy()
        return dropped

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary: token ids a request may name are below it."""
        return self._runner.vocab_size

    @property
    def target_model(self) -> LlamaModel:
        return self._runner.model

    @property
    def idle(self) -> bool:
        return not self._running and not self._waiting

    def snapshot(self) -> SchedulerSnapshot:
        counts = self._blocks.counts()
        return SchedulerSnapshot(
            running=len(self._running),
            waiting=len(self._waiting),
            kv_blocks_used=counts.held,
            kv_blocks_total=counts.total,
            prefix_cache=self._blocks.enabled,
            kv_blocks_cached=counts.cached,
            kv_blocks_evictable=counts.evictable,
            prompt_tokens_cached=self._prompt_tokens["cached"],
            prompt_tokens_computed=self._prompt_tokens["computed"],
            draining=self.draining,
            device_statuses=dict(self._statuses),
            rounds=self._rounds,
            tokens_per_second=self._throughput.rate,
            max_concurrency=self.max_concurrency,
            draft_tokens=self.draft_tokens,
            weights_dtype=self.package.manifest.serving.dtype,
            weight_format=str(self._runner.model.weight_format),
            kv_cache_dtype=dtype_name(self._runner.kv_cache.dtype),
            weight_types=self.package.weight_types(),
        )

    def requests(self) -> list[RequestInfo]:
        now = time.monotonic()
        infos = []
        for choices in self._by_id.values():
            leader = choices[0]
            state = "running" if any(s.state is SequenceState.RUNNING for s in choices) else leader.state.value
            completion = sum(s.num_output_tokens for s in choices)
            infos.append(RequestInfo(leader.request_id, state, now - leader.arrival, leader.num_prompt_tokens, completion))
        return infos

    async def warm_up(self) -> None:
        """Run one short request through every stage (prefill, sampling, a decode round)
        before the daemon reports ready; it also gives the cost model its first points."""
        prompt = tuple(self.tokenizer.encode("Hello")) or (0,)
        request = GenerationRequest(
            f"warm-up-{secrets.token_hex(4)}", prompt, SamplingParams(temperature=0.0, max_tokens=2)
        )
        metrics, self.metrics = self.metrics, None  # the warm-up request is not traffic
        try:
            stream = self.submit(request)
            while not self.idle:
                await self._step()
            async for _ in stream:
                pass
        finally:
            self.metrics = metrics
            self._statuses.clear()
            self._throughput = _Throughput()  # STATUS= and ctl report traffic, not the warm-up

    async def run(self) -> None:
        """The scheduler loop: one round at a time until stop(); then every request left fails
        with `shutdown`. Owned by the daemon's task group."""
        try:
            while not self._stop:
                if self.heartbeat is not None:
                    self.heartbeat()
                if not await self._step():
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), self.options.idle_tick_s)
        finally:
            for seq in [*self._running, *self._waiting]:
                self._fail(seq, shutdown_failure())
            if self._owns_model_thread:
                self._model_thread.shutdown(wait=True)  # idle: no round is in flight here

    # ----------------------------------------------------------------- one round

    async def _step(self) -> bool:
        """Plan, run and apply one round; False when there was nothing to do."""
        plan = self._plan_round()
        if plan is None:
            return False
        self._in_flight = True
        try:
            result = await self._on_model_thread(self._runner.execute, plan)
        except Exception as error:  # a bug or device fault outside any row's status
            log.exception("round_failed", round=plan.index, rows=len(plan.rows))
            failure = RequestFailure(
                code="round_failed", message=f"the model failed in round {plan.index}: {error}", http_status=503
            )
            for row in plan.rows:
                if (choices := self._by_id.get(row.request_id)) is not None:
                    self._fail(choices[0], failure)
            return True
        finally:
            self._in_flight = False
        self._apply(plan, result)
        return True

    async def _on_model_thread(self, work: Callable[[RoundPlan], RoundResult], plan: RoundPlan) -> RoundResult:
        future = asyncio.wrap_future(self._model_thread.submit(work, plan))
        # As anyio.to_thread.run_sync does: a cancelled caller still waits for the round, whose
        # rows and KV blocks are in use until it returns.
        with anyio.CancelScope(shield=True):
            return await future

    def _plan_round(self) -> RoundPlan | None:
        self._admit()
        self._fork_choices()
        if not self._running:
            return None
        index = self._rounds
        budget = self.options.max_batched_tokens
        self._copies = []
        decode = [s for s in self._running if s.in_decode]
        prefill_tokens = sum(len(s.tokens) - s.num_cached for s in self._running if not s.in_decode)
        base_tokens = len(decode) + max(0, min(budget - len(decode), prefill_tokens))
        drafts = self._drafts(decode, base_tokens=base_tokens)
        # What a row's token is worth this round, against which a head step is weighed.
        token_seconds = self._cost.seconds(base_tokens) / max(1, len(decode))
        rows: list[PlannedRow] = []
        for seq in sorted(self._running, key=lambda s: (s.arrival, s.index)):
            if seq.state is not SequenceState.RUNNING:
                continue  # preempted while planning this round
            draft = drafts.get(seq, Draft(()))
            tail = seq.tokens[seq.num_cached :]
            if not seq.in_decode:
                if budget <= 0:
                    continue
                # A first choice whose other choices wait stops short of the prompt's last token:
                # each choice computes that one itself, to sample its first token from it.
                end = len(seq.tokens) - 1 if seq.pending_choices else len(seq.tokens)
                tail = seq.tokens[seq.num_cached : end][:budget]
                if not tail:
                    continue
            row_tokens = len(tail) + len(draft.token_ids)
            samples = seq.num_cached + len(tail) == len(seq.tokens)
            head_steps = self._head_steps(seq, row_tokens, len(draft.token_ids), token_seconds) if samples else 0
            # A drafting row's head writes the new token's slot, one past the row's tokens at
            # most, and K - 1 more.
            if not self._ensure_blocks(seq, seq.num_cached + row_tokens + head_steps):
                head_steps = self._head_steps(seq, len(tail), 0, token_seconds) if samples else 0
                if draft.token_ids and self._ensure_blocks(seq, seq.num_cached + len(tail) + head_steps):
                    draft = Draft(())
                else:
                    continue  # preempted: it waits for blocks
            budget -= len(tail) + len(draft.token_ids)
            penalized = seq.request.params.penalized
            prompt_targets = self._prompt_targets(seq, len(tail)) if not seq.in_decode else ()
            rows.append(
                PlannedRow(
                    request_id=seq.request_id,
                    token_ids=tuple(tail) + draft.token_ids,
                    start_position=seq.num_cached,
                    block_table=tuple(seq.block_table),
                    samples=samples,
                    draft_ids=draft.token_ids,
                    draft_probs=draft.probs,
                    draft_vocab=draft.vocab,
                    params=seq.request.params,
                    seed=seq.seed,
                    output_position=seq.num_output_tokens,
                    prompt_ids=seq.request.prompt_token_ids if penalized else (),
                    output_ids=tuple(seq.output_ids) if penalized else (),
                    vocabulary_parallel=self.vocabulary_parallel and not seq.fell_back,
                    fault=self._fault_now(seq) if samples else None,
                    choice=seq.index,
                    logprobs=seq.request.logprobs,
                    raw_logprobs=seq.request.raw_logprobs,
                    prompt_targets=prompt_targets,
                    prompt_top=seq.request.prompt_logprobs or 0,
                    grammar=seq.grammar if samples else None,
                    head_steps=head_steps,
                    head_from=seq.head_cached if head_steps else 0,
                    head_tokens=tuple(seq.tokens[seq.head_cached : seq.num_cached + len(tail)]) if head_steps else (),
                )
            )
        # A row dropped after its blocks were made writable (its sequence preempted by a later
        # row) leaves a copy into a block that is free again: harmless, the copies run first.
        rows = [row for row in rows if self._row_still_planned(row)]
        if not rows:
            return None
        self._rounds += 1
        return RoundPlan(index, tuple(rows), tuple(self._copies))

    def _prompt_targets(self, seq: Sequence, fed: int) -> tuple[int, ...]:
        """The prompt tokens a prefill chunk of `fed` tokens from `num_cached` predicts, when the
        request scores its prompt: position i predicts token i + 1, up to the prompt's last."""
        if seq.request.prompt_logprobs is None:
            return ()
        start = seq.num_cached
        end = min(start + fed, seq.num_prompt_tokens - 1)
        return tuple(seq.tokens[start + 1 : end + 1]) if end > start else ()

    def _row_still_planned(self, row: PlannedRow) -> bool:
        choices = self._by_id.get(row.request_id)
        return choices is not None and choices[row.choice].state is SequenceState.RUNNING

    def _drafts(self, decode: list[Sequence], base_tokens: int) -> dict[Sequence, Draft]:
        """Each decode row's drafts, cut to the adaptive draft length."""
        constrained = [s for s in decode if s.grammar is not None]
        if self._drafter is None and not self._mtp and not self.options.fault_injection and not constrained:
            return {}
        forced: dict[Sequence, Draft] = {}
        proposals: list[Draft] = []
        for seq in decode:
            limit = self._draft_limit(seq)
            proposal = self._proposal(seq, limit) if limit > 0 else Draft(())
            if seq.grammar is not None:
                proposal, jump = self._grammar_draft(seq, proposal)
                if jump.token_ids:
                    forced[seq] = jump
                    proposal = Draft(())
                    seq.draft_source = GRAMMAR_SOURCE
            proposals.append(proposal)
        available = [len(d.token_ids) for d in proposals]
        lengths = (
            choose_draft_lengths(
                available,
                [s.draft_acceptance for s in decode],
                base_tokens,
                self._cost,
                requests_waiting=bool(self._waiting),
            )
            if self.options.adaptive_draft_length
            else available
        )
        drafts: dict[Sequence, Draft] = dict(forced)
        for seq, draft, k in zip(decode, proposals, lengths):
            if k:
                drafts[seq] = draft.cut(k)
            if seq.head_draft is not None and seq.head_draft.token_ids:
                seq.head_use.observe(proposed=1, accepted=int(bool(k) and seq.draft_source == "mtp"))
            else:  # so that a row whose head stopped drafting is weighed again
                seq.head_use.unobserved()
            if self._mtp and self.options.adaptive_draft_length:
                # The head's drafts were there and not worth verifying: it pauses (`_head_steps`)
                # for HEAD_PAUSE_ROUNDS rounds a decode row, so that paused rows probe about once
                # in that many rounds whatever the batch, and a pause shortens as the batch does.
                longest = HEAD_PAUSE_ROUNDS * len(decode)
                if not k and draft.token_ids and seq.draft_source == "mtp":
                    seq.head_pause = longest
                elif seq.head_pause:
                    seq.head_pause = min(seq.head_pause - 1, longest)
            fault = self._fault_now(seq)
            if fault in _DRAFT_FAULTS and seq not in drafts:
                # The draft fault path needs one draft to verify; propose the token 0.
                drafts[seq] = Draft((0,))
        return drafts

    def _grammar_draft(self, seq: Sequence, proposal: Draft) -> tuple[Draft, Draft]:
        """A constrained row's drafts: (the drafter's proposal cut at its first token the grammar
        refuses, the tokens the grammar forces from here). Forced tokens have p = 1 under the
        mask, so they are always accepted: proposed whole, past the draft-length model."""
        assert seq.grammar is not None
        if self.options.jump_forward:
            room = self._draft_limit(seq, JUMP_FORWARD_TOKENS)
            forced = seq.grammar.forced_tokens()[:room]
            if forced:
                return Draft(()), Draft(tuple(forced))
        valid = seq.grammar.valid_prefix(proposal.token_ids)
        return proposal.cut(valid), Draft(())

    def _proposal(self, seq: Sequence, limit: int) -> Draft:
        """The row's draft: n-gram lookup's, the head's, or under `auto` lookup's wherever it
        proposes and the head's elsewhere. Lookup's drafts cost nothing to make and little to
        verify at one stream, and the head's cost it a step each (and a row drafted by lookup
        has the head draft nothing: `_head_steps`), so a lookup draft accepted less often than
        the head's still pays better. Measured in one process, 20 chat answers at one stream
        (2 cores of a Zen 5 EPYC with AVX-512, the default model's distilled head, 2026-12-01),
        against K = 0, before the head-step weighing of `_head_steps`: greedy, this rule 1.28x
        and n-gram alone 1.30x in one run, lookup only where its acceptance on the row was at
        least the head's 1.24x and n-gram alone 1.30x in another; at T = 0.7 1.12x (n-gram
        1.18x) and 1.09x (n-gram 1.22x)."""
        head = seq.head_draft.cut(limit) if self._mtp and seq.head_draft is not None else Draft(())
        if seq.draft_state is None:
            seq.draft_source = "mtp"
            return head
        ngram = seq.draft_state.propose(limit)
        if not self._mtp or ngram.token_ids:
            seq.draft_source = "ngram"
            return ngram
        seq.draft_source = "mtp"
        return head

    def _head_steps(self, seq: Sequence, row_tokens: int, drafts: int, token_seconds: float) -> int:
        """Drafts the head proposes after this row for the row's next round (0 once the sequence
        no longer speculates, or where they would pass the context).

        Each step is a forward of the head, paid whether or not the next round verifies its
        draft, so with adaptive draft length the head drafts at most one more than this round's
        length (at least one): the length then grows a step a round where acceptance is high, and
        a row whose drafts do not pay costs one step, not K. Of those it drafts the steps whose
        expected saving covers twice what a step costs (`worthwhile_head_steps`: the head's
        acceptance on the row, a token's worth of this round's time, the head's measured seconds
        per row-step, `HEAD_STEP_MARGIN`), the saving weighed by how often the row's head drafts
        were verified at all (`Sequence.head_use`). Measured in one process on 24 chat answers at
        one stream (the default model's distilled head, 2 cores of a Zen 5 EPYC with AVX-512,
        2026-12-01), against K = 0: greedy, auto 1.31x without this weighing and 1.34x with it at
        a margin of 1 (n-gram alone 1.35x), mtp 1.08x and 1.11x; at T = 0.7 auto 1.07x and 1.10x
        (n-gram alone 1.21x), mtp 0.99x and 1.01x (the margin's own figures are at
        `HEAD_STEP_MARGIN`). A row whose drafts the draft-length model declined gets none for
        `HEAD_PAUSE_ROUNDS` rounds per decode row, then one again (each
        probe costs a catch-up and a step): at 8 and 32 streams, where a draft accepted a third
        of the time does not pay for the rows it adds, the head cost the round for nothing. A
        row without steps costs the head nothing: when it drafts again the head catches up on the
        slots since from its pool of hidden states (drafters/mtp.py).

        Under `auto` a row whose draft this round came from n-gram lookup gets none: lookup is
        likely to propose again next round (its text repeats), and the head's drafts would then
        go unverified. The round after lookup finds nothing verifies no drafts, and the head drafts
        for the one after. On the `copy` set at one stream, greedy: with K steps drafted beside
        lookup, auto served 121 tokens/s against n-gram alone's 227; with one step 0.87x of
        n-gram alone, with none 0.94-0.97x (`benchmarks/drafters.py PACKAGE --configs ngram,auto
        --dataset copy --answers 10`, same head and CPU as above)."""
        if not self._mtp or seq.fell_back or self.draft_tokens <= 0 or seq.head_pause:
            return 0
        if self.drafter_name == "auto" and seq.draft_source == "ngram":
            return 0
        if self.options.adaptive_draft_length:
            steps = worthwhile_head_steps(
                min(self.draft_tokens, drafts + 1),
                seq.source_acceptance["mtp"].rate,
                seq.head_use.rate * token_seconds,
                self._head_cost.seconds_per_step(),
            )
        else:
            steps = self.draft_tokens
        # The last slot the head writes: the row's end, plus its new token, plus steps - 1.
        if seq.num_cached + row_tokens + steps > self.max_context:
            return 0
        return steps

    def _draft_limit(self, seq: Sequence, most: int | None = None) -> int:
        if seq.fell_back:
            return 0
        params = seq.request.params
        # Every emitted token counts: the accepted drafts plus one must fit max_tokens and the context.
        return max(
            0,
            min(
                self.draft_tokens if most is None else most,
                params.max_tokens - seq.num_output_tokens - 1,
                self.max_context - len(seq.tokens) - 1,
            ),
        )

    def _fault_now(self, seq: Sequence) -> DeviceStatus | None:
        fault: FaultSpec | None = seq.request.fault
        if fault is None or not self.options.fault_injection:
            return None
        target = 0 if fault.round is None else fault.round
        return fault.status if seq.sampled_rounds == target else None

    # ----------------------------------------------------------------- admission and blocks

    @staticmethod
    def _slots(sequences: Iterable[Sequence]) -> int:
        """Running slots `sequences` take: one each, plus the choices waiting to fork off them."""
        return sum(1 + len(s.pending_choices) for s in sequences)

    def _admit(self) -> None:
        slots = self._slots(self._running)
        while self._waiting:
            seq = self._waiting[0]
            group = 1 + len(seq.pending_choices)
            if slots + group > self.max_concurrency:
                return
            if not seq.block_table:
                self._reuse_cached_prefix(seq)
            # Admit when the whole sequence fits with a block of headroom per running sequence,
            # so admission does not immediately force a preemption; each choice still to fork
            # needs a block of its own.
            needed = blocks_for_tokens(len(seq.tokens) + 1, self._block_size) - len(seq.block_table) + group - 1
            if needed + len(self._running) > self._blocks.num_available and self._running:
                self._release_blocks(seq)  # cached blocks it found stay evictable while it waits
                return
            self._waiting.popleft()
            seq.state = SequenceState.RUNNING
            self._running.append(seq)
            slots += group
            self._count_cached_prompt(seq)

    def _reuse_cached_prefix(self, seq: Sequence) -> None:
        """Map the longest cached prefix of `seq`'s tokens to the blocks that hold it. At least
        the last token is computed again: the row that samples needs its logits."""
        if not self._blocks.enabled or seq.request.prompt_logprobs is not None:
            # A scored prompt is computed whole: cached blocks hold no logits to score it by.
            return
        seq.block_hashes = chain_hashes(self._blocks.root, seq.tokens, self._block_size, seq.block_hashes)
        # A last block that holds the last token is found too, and copied before that token's
        # position is written again: cheaper than computing the whole block.
        seq.block_table = self._blocks.lookup(seq.block_hashes)
        seq.num_published = len(seq.block_table)
        seq.num_cached = min(len(seq.block_table) * self._block_size, len(seq.tokens) - 1)

    def _count_cached_prompt(self, seq: Sequence) -> None:
        """An admitted sequence's prompt tokens that the prefix cache served."""
        cached = min(seq.num_cached, seq.num_prompt_tokens)
        if seq.cached_prompt_tokens is None:
            seq.cached_prompt_tokens = cached  # what the request's usage reports
        if cached:
            self._prompt_tokens["cached"] += cached
            if self.metrics is not None:
                self.metrics.observe_tokens(cached=cached)
            log.debug("prefix_cache_hit", request_id=seq.request_id, tokens=cached)

    def _fork_choices(self) -> None:
        """The other choices of a request share its first choice's blocks once those hold all
        but the prompt's last token; from then on each runs as a sequence of its own."""
        for leader in [s for s in self._running if s.pending_choices]:
            prompt_len = leader.num_prompt_tokens
            if leader.num_cached < prompt_len - 1:
                continue
            shared = leader.block_table[: blocks_for_tokens(prompt_len - 1, self._block_size)]
            for choice in leader.pending_choices:
                self._blocks.share(shared)
                choice.block_table = list(shared)
                choice.num_cached = prompt_len - 1
                choice.num_published = min(leader.num_published, len(shared))
                choice.block_hashes = leader.block_hashes[: prompt_len // self._block_size]
                choice.cached_prompt_tokens = leader.cached_prompt_tokens
                choice.prompt_logprobs = list(leader.prompt_logprobs)
                choice.state = SequenceState.RUNNING
                self._running.append(choice)
            log.debug("choices_forked", request_id=leader.request_id, n=1 + len(leader.pending_choices))
            leader.pending_choices = []

    def _ensure_blocks(self, seq: Sequence, num_positions: int) -> bool:
        """Give `seq` blocks it may write for positions `num_cached .. num_positions - 1`: new
        ones past its table, and private copies of the blocks in that range it shares (copied
        before the round's forward). Preempts the newest other running sequences if the pool
        is short. False when `seq` itself had to be preempted."""
        while True:
            shared = [
                i
                for i in range(seq.num_cached // self._block_size, len(seq.block_table))
                if i * self._block_size < num_positions and not self._blocks.owns(seq.block_table[i])
            ]
            needed = blocks_for_tokens(num_positions, self._block_size) - len(seq.block_table) + len(shared)
            if needed <= 0:
                return True
            try:
                fresh = self._blocks.allocate(needed)
            except OutOfBlocks:
                victim = max(self._running, key=lambda s: (s.arrival, s.index))
                if victim is seq and len(self._running) == 1:
                    # Alone and still short: the sequence has outgrown the whole cache. Waiting
                    # would never help, so it ends here, as at the context length.
                    log.warning("request_outgrew_kv_cache", request_id=seq.request_id, tokens=len(seq.tokens))
                    self._finish(seq, Finished("length", self._usage(seq), fell_back=seq.fell_back, index=seq.index))
                    return False
                self._preempt(victim)
                if victim is seq:
                    return False
                continue
            for i in shared:
                copy = fresh.pop()
                self._copies.append((seq.block_table[i], copy))
                self._blocks.release([seq.block_table[i]])
                seq.block_table[i] = copy
                seq.num_published = min(seq.num_published, i)
            seq.block_table.extend(fresh)
            return True

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and put it back at the head of the queue; it is
        recomputed from its tokens later (from its cached prefix, if the cache kept it), with
        the same output (seeded by position)."""
        self._release_blocks(seq)
        seq.preemptions += 1
        seq.state = SequenceState.WAITING
        self._running.remove(seq)
        self._waiting.appendleft(seq)
        log.info("request_preempted", request_id=seq.request_id, tokens=len(seq.tokens), preemptions=seq.preemptions)

    def _release_blocks(self, seq: Sequence) -> None:
        self._blocks.release(seq.block_table)
        seq.block_table.clear()
        seq.num_cached = 0
        seq.head_cached = 0
        seq.num_published = 0

    def _trim_blocks(self, seq: Sequence) -> None:
        """Release blocks past the cached positions (those of rejected drafts) at once."""
        # The head's KV holds one slot more than the target's: the new token's (drafters/mtp.py).
        keep = blocks_for_tokens(seq.num_cached + (1 if self._mtp else 0), self._block_size)
        if len(seq.block_table) > keep:
            self._blocks.release(seq.block_table[keep:])
            del seq.block_table[keep:]

    def _publish(self, seq: Sequence) -> None:
        """Offer the prefix cache every block of `seq` that is now full of committed tokens:
        keys and values of positions that hold a prompt token or an accepted output token,
        never a draft's that may still be rejected."""
        if not self._blocks.enabled:
            return
        committed = min(seq.num_cached, len(seq.tokens))
        full = min(committed // self._block_size, len(seq.block_table))
        if full <= seq.num_published:
            return
        if len(seq.block_hashes) < full:
            seq.block_hashes = chain_hashes(
                self._blocks.root, seq.tokens[: full * self._block_size], self._block_size, seq.block_hashes
            )
        for i in range(seq.num_published, full):
            self._blocks.publish(seq.block_table[i], seq.block_hashes[i])
        seq.num_published = full

    # ----------------------------------------------------------------- applying a round

    def _apply(self, plan: RoundPlan, result: RoundResult) -> None:
        # The cost model weighs this round's drafts: what verifying T tokens takes. The head's
        # pass drafts for the next round, whatever this one verified, so it is left out.
        self._cost.observe(plan.num_tokens, result.seconds - result.head_seconds)
        self._head_cost.observe(sum(row.head_steps for row in plan.rows), result.head_seconds)
        now = time.monotonic()
        statuses: list[int] = []
        accepted_per_row: list[int] = []
        proposed: Counter[str] = Counter()  # draft tokens by drafter (`Sequence.draft_source`)
        accepted_by: Counter[str] = Counter()
        generated = 0
        prompt_tokens = 0
        for row, outcome in zip(plan.rows, result.rows):
            choices = self._by_id.get(row.request_id)
            seq = choices[row.choice] if choices is not None else None
            if seq is None or seq.state is not SequenceState.RUNNING:
                continue
            if seq.pending_cancel is not None:
                self._fail(seq, seq.pending_cancel)
                continue
            fed = len(row.token_ids)
            prompt_tokens += max(0, min(seq.num_prompt_tokens, row.start_position + fed) - row.start_position)
            if outcome is not None and outcome.prompt_logprobs:
                # Position p predicts prompt token p + 1: entry p of the list. A recomputed
                # chunk (after a preemption) scores positions already kept again.
                for offset, entry in enumerate(outcome.prompt_logprobs):
                    if row.start_position + offset == len(seq.prompt_logprobs):
                        seq.prompt_logprobs.append(entry)
            if not row.samples or outcome is None:
                seq.num_cached = row.start_position + fed
                self._publish(seq)
                continue
            statuses.append(int(outcome.status))
            self._statuses[outcome.status.name] += 1
            seq.sampled_rounds += 1
            if outcome.status is not DeviceStatus.OK:
                failure = device_failure(outcome.status, plan.index)
                log.warning(
                    "request_device_status",
                    request_id=seq.request_id,
                    choice=seq.index,
                    status=int(outcome.status),
                    status_name=outcome.status.name,
                    round=plan.index,
                )
                self._fail(seq, failure)
                continue
            if outcome.fell_back and not seq.fell_back:
                seq.fell_back = True
                log.warning("request_fell_back", request_id=seq.request_id, choice=seq.index, round=plan.index)
            drafts = len(row.draft_ids)
            accepted = len(outcome.tokens) - 1 if not outcome.fell_back else 0
            if drafts:
                proposed[seq.draft_source] += drafts
                accepted_by[seq.draft_source] += accepted
                accepted_per_row.append(accepted)
            if seq.in_decode:
                # The drafter whose drafts were verified learns from them; the others recover.
                for source, estimate in seq.source_acceptance.items():
                    if drafts and source == seq.draft_source:
                        estimate.observe(drafts, accepted)
                    else:
                        estimate.unobserved()
            seq.num_cached = row.start_position + fed - (drafts - accepted)
            if row.head_steps and outcome.next_draft is not None:
                # The head computed every slot through the new token's (drafters/mtp.py).
                seq.head_cached = seq.num_cached + 1
            if seq.first_token_at is None:
                seq.first_token_at = now
                if self.metrics is not None and seq.index == 0:  # once per request
                    self.metrics.time_to_first_token.observe(now - seq.arrival)
            elif self.metrics is not None:
                self.metrics.observe_emission(now - (seq.last_token_at or now), len(outcome.tokens))
            seq.last_token_at = now
            seq.head_draft = outcome.next_draft
            generated += self._emit(seq, outcome.tokens, outcome.logprobs)
            if seq.state is SequenceState.RUNNING:
                self._publish(seq)
                self._trim_blocks(seq)
        # A request cancelled while the round ran but without a row in it ends now.
        for choices in [c for c in self._by_id.values() if any(s.pending_cancel for s in c)]:
            self._fail(choices[0], next(s.pending_cancel for s in choices if s.pending_cancel is not None))
        self._throughput.observe(generated)
        self._prompt_tokens["computed"] += prompt_tokens
        # What the draft-length model learns from (flare_draft_tokens_* give the totals only).
        log.debug(
            "round_completed",
            round=plan.index,
            rows=len(plan.rows),
            tokens=plan.num_tokens,
            drafts=sum(proposed.values()),
            accepted=sum(accepted_per_row),
            generated=generated,
            copies=len(plan.copies),
            seconds=round(result.seconds, 4),
            head_seconds=round(result.head_seconds, 4),
        )
        if self.metrics is not None:
            self.metrics.observe_round(statuses, accepted_per_row, proposed, accepted_by, result.head_seconds)
            self.metrics.observe_tokens(prompt=prompt_tokens, generated=generated)
            self._publish_occupancy()

    def _emit(self, seq: Sequence, new_tokens: tuple[int, ...], logprobs: tuple[TokenLogprob, ...] = ()) -> int:
        """Append sampled tokens to `seq`, stream their text (and their log-probabilities, when
        asked), and finish it at EOS, a stop string, max_tokens or the context length. Returns
        how many tokens were kept."""
        params = seq.request.params
        kept: list[int] = []
        reason: Literal["stop", "length"] | None = None
        for token in new_tokens:
            if token in self._eos:
                reason = "stop"
                break
            kept.append(token)
            if seq.num_output_tokens + len(kept) >= params.max_tokens or len(seq.tokens) + len(kept) >= self.max_context:
                reason = "length"
                break
        if seq.grammar is not None:
            if not seq.grammar.accept(kept):
                self._fail(seq, grammar_failure(seq.grammar.error, seq.grammar.grammar.spec.param))
                return 0
            if reason is None and seq.grammar.finished:
                reason = "stop"  # the answer is complete: only its end may follow
        seq.tokens.extend(kept)
        if seq.draft_state is not None and kept:
            seq.draft_state.extend(kept)
        text, hit_stop = seq.stop_matcher.push(seq.detokenizer.push(kept))
        if hit_stop:
            reason = "stop"
        elif reason is not None:
            text += seq.stop_matcher.push(seq.detokenizer.flush())[0] + seq.stop_matcher.flush()
        # The first delta of a scored prompt's choice carries the prompt's entries, even empty.
        scored_first = not seq.emitted and seq.request.prompt_logprobs is not None
        if text or kept or scored_first:
            seq.emitted = True
            prompt = tuple(seq.prompt_logprobs) if scored_first else None
            seq.stream.put(TextDelta(text, tuple(kept), seq.index, tuple(logprobs[: len(kept)]), prompt))
        if reason is not None:
            self._finish(seq, Finished(reason, self._usage(seq), fell_back=seq.fell_back, index=seq.index))
        return len(kept)

    def _usage(self, seq: Sequence) -> Usage:
        return Usage(seq.num_prompt_tokens, seq.num_output_tokens, seq.cached_prompt_tokens or 0)

    def _fail(self, seq: Sequence, failure: RequestFailure) -> None:
        """End `seq`'s request with `failure`: every choice of it not finished yet (a request's
        answer is whole or failed), with one Failed event and usage over all its choices."""
        choices = self._by_id.pop(seq.request_id, None)
        if choices is None:
            return  # ended already
        for choice in choices:
            self._end(choice, publish=False)
        usage = Usage(seq.num_prompt_tokens, sum(s.num_output_tokens for s in choices), seq.cached_prompt_tokens or 0)
        seq.stream.put(Failed(failure, usage))
        if self.metrics is not None:
            self.metrics.e2e_latency.observe(time.monotonic() - seq.arrival)
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
            if self.metrics is not None:
                self.metrics.e2e_latency.observe(time.monotonic() - seq.arrival)

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
            self._publish(seq)
        self._release_blocks(seq)
        if self.metrics is not None:
            self._publish_occupancy()
        self._wake.set()

    def _publish_occupancy(self) -> None:
        assert self.metrics is not None
        counts = self._blocks.counts()
        self.metrics.set_occupancy(
            running=len(self._running),
            waiting=len(self._waiting),
            kv_blocks_used=counts.held,
            kv_blocks_total=counts.total,
            kv_blocks_cached=counts.cached,
            kv_blocks_evictable=counts.evictable,
        )

    def _new_sequence(self, request: GenerationRequest, stream: RequestStream, seed: int, index: int) -> Sequence:
        return Sequence(
            request=request,
            stream=stream,
            seed=choice_seed(seed, index),
            detokenizer=IncrementalDetokenizer(self.tokenizer, list(request.prompt_token_ids)),
            stop_matcher=StopStringMatcher(request.params.stop),
            draft_state=self._drafter.new_state(request.prompt_token_ids) if self._drafter is not None else None,
            index=index,
            grammar=GrammarState(request.grammar) if request.grammar is not None else None,
        )

    def _retry_after_s(self) -> float:
        """A rough wait until a queue slot frees: the queued tokens at the recent rate."""
        rate = max(self._throughput.rate, 1.0)
        queued = sum(s.request.params.max_tokens for s in self._waiting)
        return float(min(60, max(1, round(queued / rate / max(1, self.max_concurrency)))))
