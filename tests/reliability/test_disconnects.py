"""Hundreds of clients that go away at random moments (before the answer starts, after a few SSE
events, mid non-streaming request): nothing leaks (no running or waiting request, every KV block
free) and the daemon's resident memory stays where it was."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path

import httpx
from tests.reliability.reliability_daemon import Daemon, generate, report

CLIENTS = 240
AT_ONCE = 48  # connections open at once: all 32 slots busy and a queue
RSS_MARGIN = 0.15  # allocator noise on a process of ~400 MiB; a leak per client would exceed it


async def _client(http: httpx.AsyncClient, daemon: Daemon, chooser: random.Random) -> str:
    """One client that leaves early; returns how it left."""
    body = daemon.body(max_tokens=48, stream=True)
    kind = chooser.choice(("mid-stream", "mid-stream", "before the first event", "timed out"))
    if kind == "timed out":
        # Gone at a random moment: before the headers, mid-stream, or mid non-streaming request.
        body["stream"] = chooser.random() < 0.5
        try:
            await asyncio.wait_for(generate(http, "/v1/chat/completions", body), chooser.uniform(0.0, 0.3))
        except TimeoutError:
            return kind
        return "finished first"
    outcome = await generate(
        http, "/v1/chat/completions", body, drop_after_events=0 if kind != "mid-stream" else chooser.randint(1, 12)
    )
    assert outcome.status == 200, outcome
    return "finished first" if outcome.complete else kind


async def _wave(daemon: Daemon, clients: int, seed: int) -> list[str]:
    chooser = random.Random(seed)
    gate = asyncio.Semaphore(AT_ONCE)

    async def gated() -> str:
        # A fresh connection per client, so each drop really closes a TCP connection.
        async with gate, httpx.AsyncClient(base_url=daemon.url, timeout=120) as http:
            return await _client(http, daemon, chooser)

    return await asyncio.gather(*(gated() for _ in range(clients)))


async def test_clients_that_drop_at_random_moments_leak_nothing(
    tiny_package: Path, daemon_factory: Callable[..., Daemon]
) -> None:
    daemon = daemon_factory(tiny_package)
    await _wave(daemon, AT_ONCE, seed=0)  # warm-up: allocator pools, thread pools, tokenizer caches
    assert daemon.wait_idle()["kv_blocks_used"] == 0
    rss_before = daemon.rss_kib()

    left = await _wave(daemon, CLIENTS, seed=1)
    idle = daemon.wait_idle()
    rss_after = daemon.rss_kib()
    kinds = {kind: left.count(kind) for kind in sorted(set(left))}
    report(
        "disconnects", clients=CLIENTS, how_they_left=kinds, running=idle["running"], waiting=idle["waiting"],
        leaked_blocks=idle["kv_blocks_used"], rss_before_kib=rss_before, rss_after_kib=rss_after,
        rss_change=f"{(rss_after - rss_before) / rss_before:+.1%}",
    )
    assert idle["running"] == 0 and idle["waiting"] == 0 and idle["kv_blocks_used"] == 0
    assert sum(n for kind, n in kinds.items() if kind != "finished first") >= CLIENTS // 2
    assert rss_after <= rss_before * (1 + RSS_MARGIN)
    assert daemon.serves()
