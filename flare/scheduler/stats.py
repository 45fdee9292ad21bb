"""What the scheduler reports about itself: as it happens, to one observer (`SchedulerObserver`,
which the Prometheus metrics implement: metrics.py), and when asked, its snapshot (`flare ctl
status`, systemd STATUS=), the requests it holds (`flare ctl requests`) and its recent throughput."""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from flare.engine.kv_cache import bytes_per_token
from flare.engine.precision import dtype_name
from flare.engine.prefix_cache import PrefixCache
from flare.engine.quantized import served_activations
from flare.package.directory import Package
from flare.scheduler.round.model_runner import ModelRunner
from flare.scheduler.sequence import Sequence, SequenceState
from flare.structured import CacheUse


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
    activations: str  # what ggml block weights multiply: int8 blocks or float32 (`quantized.served_activations`)
    # What one cached token costs, all layers (`kv_cache.bytes_per_token`), in each rank's pool
    # under tensor parallel: its share of the KV heads, or the whole latent row.
    kv_bytes_per_token: int
    # Tensors and bytes by stored type (Q4_1, F32, ...): `package.weight_types`.
    weight_types: dict[str, dict[str, int]] = field(default_factory=dict)
    # This host's tensor-parallel ranks as (rank, pid, CPUs); empty without a group.
    ranks: tuple[tuple[int, int, tuple[int, ...]], ...] = ()
    # How a round of short rows runs the layers: "one call", or "steps: " and why (`DecoderModel.layer_calls`).
    layer_calls: str = ""


@dataclass
class Throughput:
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

    @property
    def rounds_held(self) -> int:
        """How many rounds the window holds now."""
        return len(self._rounds)

    def _forget_before(self, horizon: float) -> None:
        while self._rounds and self._rounds[0][0] < horizon:
            self._rounds.popleft()


@dataclass
class RoundTally:
    """What one round did, for its `round_completed` log line and the observer."""

    statuses: list[int] = field(default_factory=list)  # of the rows that sampled
    accepted_per_row: list[int] = field(default_factory=list)  # of the rows that verified drafts
    proposed: Counter[str] = field(default_factory=Counter)  # draft tokens by drafter (`Sequence.draft_source`)
    accepted_by: Counter[str] = field(default_factory=Counter)
    generated: int = 0
    prompt_tokens: int = 0  # computed (prefilled) this round
    head_seconds: float = 0.0  # the draft head's pass (`RoundResult.head_seconds`)
    # Seconds from arrival to the first token, of the requests whose first token came this round.
    first_token_seconds: list[float] = field(default_factory=list)
    # (seconds since the choice's previous tokens, tokens) of each row that emitted after its first.
    token_gaps: list[tuple[float, int]] = field(default_factory=list)

    def observe_drafts(self, source: str, drafts: int, accepted: int) -> None:
        if drafts:
            self.proposed[source] += drafts
            self.accepted_by[source] += accepted
            self.accepted_per_row.append(accepted)


@dataclass(frozen=True)
class Occupancy:
    running: int
    waiting: int
    kv_blocks_used: int  # held by requests
    kv_blocks_total: int
    kv_blocks_cached: int = 0
    kv_blocks_evictable: int = 0


class SchedulerObserver:
    """What the scheduler tells as it happens (on the event-loop thread); this one listens to
    nothing, and an observer overrides what it wants to hear (`SchedulerMetrics`)."""

    def watch_grammar_cache(self, use: Callable[[], CacheUse]) -> None:
        """`use()` reads the grammar cache's size whenever the observer wants it (it changes off
        the scheduler's rounds)."""

    def prompt_cached(self, tokens: int) -> None:
        """An admitted sequence's prompt had `tokens` tokens served from the prefix cache."""

    def round_applied(self, tally: RoundTally) -> None:
        """A round's result was applied."""

    def request_ended(self, seconds: float) -> None:
        """A request ended (finished, failed or cancelled) `seconds` after it arrived."""

    def occupancy_changed(self, occupancy: Occupancy) -> None:
        """The running set, the waiting queue or the KV blocks changed."""


def scheduler_snapshot(
    *,
    running: int,
    waiting: int,
    cache: PrefixCache,
    prompt_tokens: Counter[str],
    draining: bool,
    statuses: Counter[str],
    rounds: int,
    throughput: Throughput,
    max_concurrency: int,
    draft_tokens: int,
    package: Package,
    runner: ModelRunner,
    activations: str,
) -> SchedulerSnapshot:
    """The scheduler's state as `flare ctl status` and systemd STATUS= read it; `prompt_tokens`:
    "cached" and "computed" since start; `activations`: the option (`SchedulerOptions.activations`)."""
    counts = cache.counts()
    return SchedulerSnapshot(
        running=running,
        waiting=waiting,
        kv_blocks_used=counts.held,
        kv_blocks_total=counts.total,
        prefix_cache=cache.enabled,
        kv_blocks_cached=counts.cached,
        kv_blocks_evictable=counts.evictable,
        prompt_tokens_cached=prompt_tokens["cached"],
        prompt_tokens_computed=prompt_tokens["computed"],
        draining=draining,
        device_statuses=dict(statuses),
        rounds=rounds,
        tokens_per_second=throughput.rate,
        max_concurrency=max_concurrency,
        draft_tokens=draft_tokens,
        weights_dtype=package.manifest.serving.dtype,
        weight_format=str(runner.model.weight_format),
        kv_cache_dtype=dtype_name(runner.kv_cache.dtype),
        activations=served_activations(package.weight_types(), activations),
        # The pool the blocks count: under tensor parallel rank 0's, of its model's config.
        kv_bytes_per_token=bytes_per_token(runner.model.config, runner.kv_cache.dtype),
        weight_types=package.weight_types(),
        ranks=runner.rank_list(),
        layer_calls=runner.model.layer_calls,
    )


def request_infos(requests: Iterable[list[Sequence]]) -> list[RequestInfo]:
    """`flare ctl requests`: one line per request, from its choices (a request runs while any does)."""
    now = time.monotonic()
    infos = []
    for choices in requests:
        leader = choices[0]
        state = "running" if any(s.state is SequenceState.RUNNING for s in choices) else leader.state.value
        completion = sum(s.num_output_tokens for s in choices)
        infos.append(RequestInfo(leader.request_id, state, now - leader.arrival, leader.num_prompt_tokens, completion))
    return infos


def occupancy(running: int, waiting: int, cache: PrefixCache) -> Occupancy:
    counts = cache.counts()
    return Occupancy(
        running=running,
        waiting=waiting,
        kv_blocks_used=counts.held,
        kv_blocks_total=counts.total,
        kv_blocks_cached=counts.cached,
        kv_blocks_evictable=counts.evictable,
    )
