"""The scheduler's Prometheus collectors, which observe it as its `SchedulerObserver`.

The registry is passed in (the daemon builds one per process; tests build their own), never
the global default. Counters count per round, not per token: the scheduler hands over a round's
tally, so the cost is a handful of increments per round.
"""

from __future__ import annotations

import os
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from flare.sampler.status import DeviceStatus
from flare.scheduler.sequence import DRAFT_SOURCES
from flare.scheduler.stats import Occupancy, RoundTally, SchedulerObserver
from flare.structured import CacheUse

# Latency buckets (seconds): time to first token spans queueing and prefill (tens of ms to
# tens of seconds on CPU); inter-token latency is one round divided by the tokens it emitted.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _status_name(code: int) -> str:
    # A code outside the table still gets counted, under its number, rather than failing the round.
    return DeviceStatus(code).name if code in DeviceStatus._value2member_map_ else str(code)


class SchedulerMetrics(SchedulerObserver):
    """Collectors for what the scheduler sees: rounds, tokens, latencies, occupancy (a
    `SchedulerObserver`)."""

    def __init__(self, registry: CollectorRegistry, *, max_draft_tokens: int = 8) -> None:
        self._registry = registry
        self.device_statuses = Counter(
            "flare_device_statuses",
            "Rows reported by the sample/verify kernels, by device status name (OK included).",
            ["status"],
            registry=registry,
        )
        for status in DeviceStatus:
            self.device_statuses.labels(status=status.name)  # every name present from the start
        self.prompt_tokens = Counter(
            "flare_prompt_tokens",
            "Prompt tokens computed (prefilled); those served from the prefix cache are not counted here.",
            registry=registry,
        )
        self.prompt_tokens_cached = Counter(
            "flare_prompt_tokens_cached",
            "Prompt tokens served from the prefix cache instead of computed.",
            registry=registry,
        )
        self.generated_tokens = Counter(
            "flare_generated_tokens", "Tokens generated and delivered to requests.", registry=registry
        )
        self.draft_tokens_proposed = Counter(
            "flare_draft_tokens_proposed",
            "Draft tokens verified, by what proposed them (ngram, mtp: the draft head, "
            "prediction: a request's predicted output, grammar: a forced run).",
            ["drafter"],
            registry=registry,
        )
        self.draft_tokens_accepted = Counter(
            "flare_draft_tokens_accepted",
            "Draft tokens accepted by speculative verification, by what proposed them.",
            ["drafter"],
            registry=registry,
        )
        for drafter in DRAFT_SOURCES:  # every drafter present from the start
            self.draft_tokens_proposed.labels(drafter=drafter)
            self.draft_tokens_accepted.labels(drafter=drafter)
        self.draft_head_seconds = Counter(
            "flare_draft_head_seconds",
            "Seconds the draft head's passes took (rounds run back to back: its rate is the head's share of the time).",
            registry=registry,
        )
        self.accepted_per_round = Histogram(
            "flare_draft_tokens_accepted_per_round",
            "Draft tokens accepted per request row and speculative round.",
            buckets=tuple(float(k) for k in range(max_draft_tokens + 1)),
            registry=registry,
        )
        self.time_to_first_token = Histogram(
            "flare_time_to_first_token_seconds",
            "From admission to the request's first generated token.",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.inter_token_latency = Histogram(
            "flare_inter_token_latency_seconds",
            "Time between a request's consecutive tokens (a round's gap shared by the tokens it emitted).",
            buckets=INTER_TOKEN_BUCKETS,
            registry=registry,
        )
        self.e2e_latency = Histogram(
            "flare_e2e_request_latency_seconds",
            "From admission to a request's end (finished, failed or cancelled).",
            buckets=E2E_BUCKETS,
            registry=registry,
        )
        self.running = Gauge("flare_requests_running", "Requests in the running set.", registry=registry)
        self.waiting = Gauge("flare_requests_waiting", "Requests in the waiting queue.", registry=registry)
        self.kv_blocks_used = Gauge("flare_kv_blocks_used", "KV-cache blocks held by requests.", registry=registry)
        self.kv_blocks_total = Gauge("flare_kv_blocks_total", "KV-cache blocks in the pool.", registry=registry)
        self.kv_blocks_cached = Gauge(
            "flare_kv_blocks_cached", "KV-cache blocks in the prefix cache, held by requests or not.", registry=registry
        )
        self.kv_blocks_evictable = Gauge(
            "flare_kv_blocks_evictable",
            "Prefix-cache blocks no request holds: kept for later prompts, reclaimed when free blocks run out.",
            registry=registry,
        )
        self.grammar_cache_entries = Gauge(
            "flare_grammar_cache_entries", "Compiled grammars kept for reuse by later requests.", registry=registry
        )
        self.grammar_cache_bytes = Gauge(
            "flare_grammar_cache_bytes",
            "Estimated bytes of the compiled grammars kept (resident memory each compile added).",
            registry=registry,
        )

    def watch_ranks(self, ranks: Callable[[], Iterable[tuple[int, int, tuple[int, ...]]]]) -> None:
        """Report the CPU seconds of this host's tensor-parallel ranks, ``ranks()`` as (rank,
        pid, CPUs), read from /proc at each scrape."""
        self._registry.register(RankCpuCollector(ranks))

    def watch_grammar_cache(self, use: Callable[[], CacheUse]) -> None:
        """Read the grammar cache's size at each scrape (it changes off the scheduler's rounds)."""
        self.grammar_cache_entries.set_function(lambda: use().entries)
        self.grammar_cache_bytes.set_function(lambda: use().bytes)

    def prompt_cached(self, tokens: int) -> None:
        if tokens:
            self.prompt_tokens_cached.inc(tokens)

    def round_applied(self, tally: RoundTally) -> None:
        """Every sampling row's device status; for the rows that verified drafts, how many of
        them were accepted; draft tokens verified and accepted, by drafter; the draft head's
        seconds; prompt tokens computed and tokens generated; time to first token, and each
        token's inter-token latency: the gap since its choice's previous tokens, shared among
        the tokens that came together."""
        for code, rows in Tally(int(s) for s in tally.statuses).items():
            self.device_statuses.labels(status=_status_name(code)).inc(rows)
        for row_accepted in tally.accepted_per_row:
            self.accepted_per_round.observe(row_accepted)
        for drafter, tokens in tally.proposed.items():
            self.draft_tokens_proposed.labels(drafter=drafter).inc(tokens)
        for drafter, tokens in tally.accepted_by.items():
            self.draft_tokens_accepted.labels(drafter=drafter).inc(tokens)
        if tally.head_seconds:
            self.draft_head_seconds.inc(tally.head_seconds)
        if tally.prompt_tokens:
            self.prompt_tokens.inc(tally.prompt_tokens)
        if tally.generated:
            self.generated_tokens.inc(tally.generated)
        for seconds in tally.first_token_seconds:
            self.time_to_first_token.observe(seconds)
        for gap_s, tokens in tally.token_gaps:
            for _ in range(tokens):
                self.inter_token_latency.observe(gap_s / tokens)

    def request_ended(self, seconds: float) -> None:
        self.e2e_latency.observe(seconds)

    def occupancy_changed(self, occupancy: Occupancy) -> None:
        self.running.set(occupancy.running)
        self.waiting.set(occupancy.waiting)
        self.kv_blocks_used.set(occupancy.kv_blocks_used)
        self.kv_blocks_total.set(occupancy.kv_blocks_total)
        self.kv_blocks_cached.set(occupancy.kv_blocks_cached)
        self.kv_blocks_evictable.set(occupancy.kv_blocks_evictable)


class RankCpuCollector(Collector):
    """``flare_tensor_parallel_rank_cpu_seconds_total{rank}``: user + system CPU seconds of each
    tensor-parallel rank on this host (rank 0's is the daemon's whole process), so that a rank
    that works less or more than its peers, or not at all, shows without a collective."""

    def __init__(self, ranks: Callable[[], Iterable[tuple[int, int, tuple[int, ...]]]]) -> None:
        self._ranks = ranks
        self._tick = os.sysconf("SC_CLK_TCK")

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "flare_tensor_parallel_rank_cpu_seconds",
            "CPU seconds (user + system) each tensor-parallel rank on this host has used (rank 0: the daemon's process).",
            labels=["rank"],
        )
        for rank, pid, _ in self._ranks():
            try:
                # /proc/PID/stat: utime and stime are fields 14 and 15, counted after the
                # command name's closing parenthesis (the name may hold spaces).
                fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            except OSError:  # the rank has exited: the group is failing, nothing to report
                continue
            family.add_metric([str(rank)], (int(fields[11]) + int(fields[12])) / self._tick)
        yield family
