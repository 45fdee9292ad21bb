"""The load: fixed concurrency levels or Poisson arrivals, after a warm-up, bounded in count and time.

At concurrency C, C clients each send a conversation's turns one after another and start the
next conversation when one ends. At rate R, conversations arrive at exponentially distributed
intervals of mean 1/R seconds (a Poisson process, seeded), each sent as it arrives whatever is
still running, up to `max_concurrency` in flight when that is set. Either way a level stops
starting requests once `requests` have been started or `duration_s` has passed, whichever
comes first, and ends when the requests it started have ended. Every level sends the same
conversations in the same (seeded, shuffled) order, so levels differ only in the load.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import anyio

from flare.bench.client import Endpoint, RequestRecord, stream_chat
from flare.bench.datasets import Conversation, Message
from flare.bench.progress import Progress
from flare.bench.server_metrics import difference, read_snapshot
from flare.bench.stats import summarize

MAX_TURNS = 1000  # request seeds are seed + conversation index * MAX_TURNS + turn number


@dataclass(frozen=True)
class Level:
    """One load level: a fixed number of clients, or an arrival rate (requests per second)."""

    concurrency: int | None = None
    rate: float | None = None
    max_concurrency: int | None = None  # rate mode only: arrivals wait while this many run

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("a level has either a concurrency or a rate")

    @property
    def name(self) -> str:
        if self.concurrency is not None:
            return f"concurrency {self.concurrency}"
        return f"rate {self.rate:g}/s"

    def to_json(self) -> dict[str, Any]:
        if self.concurrency is not None:
            return {"mode": "concurrency", "concurrency": self.concurrency}
        return {"mode": "rate", "rate": self.rate, "max_concurrency": self.max_concurrency}


@dataclass(frozen=True)
class LoadSettings:
    endpoint: Endpoint
    conversations: tuple[Conversation, ...]
    max_tokens: int
    temperature: float | None = None
    seed: int = 0
    extra_body: dict[str, Any] = field(default_factory=dict)  # more request fields (top_p, ...)
    requests: int | None = 64  # per level; None: the duration alone bounds it
    duration_s: float | None = None
    warmup: int = 1
    timeout_s: float = 600.0
    count_tokens: Callable[[str], int] | None = None  # the client's tokenizer, when usage is missing

    def __post_init__(self) -> None:
        if self.requests is None and self.duration_s is None:
            raise ValueError("bound the level by a number of requests, a duration, or both")


def arrival_offsets(rate: float, seed: int, count: int | None, duration_s: float | None) -> list[float]:
    """A Poisson process's first arrivals (seconds from the start), within the count and time bounds."""
    if rate <= 0:
        raise ValueError(f"the rate must be positive, got {rate}")
    rng = random.Random(seed)
    offsets: list[float] = []
    t = 0.0
    while count is None or len(offsets) < count:
        t += rng.expovariate(rate)
        if duration_s is not None and t >= duration_s:
            break
        offsets.append(t)
    return offsets


class _Budget:
    """How many more requests a level may start, and until when."""

    def __init__(self, requests: int | None, deadline: float | None) -> None:
        self.left = requests
        self.deadline = deadline

    def take(self) -> bool:
        if self.left is not None and self.left <= 0:
            return False
        if self.deadline is not None and time.perf_counter() >= self.deadline:
            return False
        if self.left is not None:
            self.left -= 1
        return True


@dataclass
class LevelRun:
    """One level as measured: every request, the wall time, flare's counters (or None)."""

    level: Level
    records: list[RequestRecord]
    duration_s: float
    server_metrics: dict[str, Any] | None
    arrivals_s: list[float] | None = None

    def to_json(self) -> dict[str, Any]:
        result = {**self.level.to_json(), **summarize(self.records, self.duration_s)}
        result["server_metrics"] = self.server_metrics
        if self.arrivals_s is not None:
            result["arrivals_s"] = [round(t, 6) for t in self.arrivals_s]
        result["records"] = [r.to_json() for r in self.records]
        return result


class LoadGenerator:
    """Owns the HTTP session and the settings; runs levels one after another."""

    def __init__(self, session: aiohttp.ClientSession, settings: LoadSettings) -> None:
        self.session = session
        self.settings = settings
        order = list(range(len(settings.conversations)))
        random.Random(settings.seed).shuffle(order)
        self.order = order

    async def warm_up(self, concurrency: int) -> None:
        """`settings.warmup` requests, not measured: connections, caches and the server's first
        rounds of each shape are warm when the first level starts."""
        if self.settings.warmup <= 0:
            return
        budget = _Budget(self.settings.warmup, None)
        records: list[RequestRecord] = []
        progress = Progress("warm-up", self.settings.warmup, None)
        await self._with_progress(progress, lambda: self._clients(max(1, concurrency), budget, records, progress, 0.0))

    async def run_level(self, level: Level) -> LevelRun:
        settings = self.settings
        before = await read_snapshot(self.session, settings.endpoint)
        records: list[RequestRecord] = []
        progress = Progress(level.name, settings.requests, settings.duration_s)
        start = time.perf_counter()
        budget = _Budget(settings.requests, start + settings.duration_s if settings.duration_s else None)
        arrivals: list[float] | None = None
        if level.concurrency is not None:
            concurrency = level.concurrency
            await self._with_progress(progress, lambda: self._clients(concurrency, budget, records, progress, start))
        else:
            assert level.rate is not None
            arrivals = arrival_offsets(level.rate, settings.seed, settings.requests, settings.duration_s)
            offsets = arrivals
            await self._with_progress(progress, lambda: self._arrivals(level, offsets, budget, records, progress, start))
        duration = max((r.start_s + (r.e2e_s or 0.0) for r in records), default=0.0)
        after = await read_snapshot(self.session, settings.endpoint)
        return LevelRun(level, records, duration, difference(before, after), arrivals)

    async def _with_progress(self, progress: Progress, load: Callable[[], Any]) -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(progress.redraw)
            await load()
            group.cancel_scope.cancel()
        progress.finish()

    async def _clients(
        self, concurrency: int, budget: _Budget, records: list[RequestRecord], progress: Progress, start: float
    ) -> None:
        next_index = iter(range(10**12))

        async def client() -> None:
            while await self._conversation(next(next_index), budget, records, progress, start):
                pass

        async with anyio.create_task_group() as group:
            for _ in range(concurrency):
                group.start_soon(client)

    async def _arrivals(
        self,
        level: Level,
        offsets: list[float],
        budget: _Budget,
        records: list[RequestRecord],
        progress: Progress,
        start: float,
    ) -> None:
        limit = anyio.Semaphore(level.max_concurrency) if level.max_concurrency else None

        async def arrive(index: int) -> None:
            if limit is None:
                await self._conversation(index, budget, records, progress, start)
                return
            async with limit:
                await self._conversation(index, budget, records, progress, start)

        async with anyio.create_task_group() as group:
            for index, offset in enumerate(offsets):
                await anyio.sleep(max(0.0, start + offset - time.perf_counter()))
                group.start_soon(arrive, index)

    async def _conversation(
        self, index: int, budget: _Budget, records: list[RequestRecord], progress: Progress, start: float
    ) -> bool:
        """Sends one conversation's turns; False once the budget stopped it (the client stops too)."""
        settings = self.settings
        conversation = settings.conversations[self.order[index % len(self.order)]]
        messages: list[Message] = list(conversation.history)
        for number, turn in enumerate(conversation.turns):
            if not budget.take():
                return False
            messages.append({"role": "user", "content": turn})
            # A seed per conversation and turn: the same request gets the same seed in every level.
            body = self._body(messages, conversation, seed=settings.seed + index * MAX_TURNS + number)
            record = await stream_chat(
                self.session,
                settings.endpoint,
                body,
                level_start=start,
                timeout_s=settings.timeout_s,
                count_tokens=settings.count_tokens,
            )
            records.append(record)
            progress.request_done(record.ok, record.output_tokens)
            if not record.ok:
                return True  # the rest of this conversation needs the answer it did not get
            messages.append({"role": "assistant", "content": record.text})
        return True

    def _body(self, messages: list[Message], conversation: Conversation, *, seed: int) -> dict[str, Any]:
        settings = self.settings
        body: dict[str, Any] = {
            "messages": list(messages),
            "max_tokens": conversation.max_tokens or settings.max_tokens,
            "seed": seed,
        }
        if settings.temperature is not None:
            body["temperature"] = settings.temperature
        return {**body, **settings.extra_body}
