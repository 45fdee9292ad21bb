"""A flood of prompts far longer than the context never freezes the event loop: they are refused by
their length before any tokenizing, `/health` and other clients are answered meanwhile, and the
tokenizing that remains runs off the loop for real (unit-tested in tests/engine/test_tokenizer_gil.py)."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from tests.reliability.reliability_daemon import Daemon, report

FLOOD = 16
PROMPT_CHARACTERS = 500_000  # the probe's: half the default 1 MiB body limit
HEALTH_LIMIT_S = 1.0  # the probe saw /health wait 11.7 s under 8 such prompts, 28.2 s under 16


async def _health_latencies(http: httpx.AsyncClient, stop: asyncio.Event) -> list[float]:
    latencies = []
    while not stop.is_set():
        started = time.monotonic()
        response = await http.get("/health")
        assert response.status_code == 200
        latencies.append(time.monotonic() - started)
        await asyncio.sleep(0.02)
    return latencies


async def test_a_flood_of_prompts_beyond_the_context_never_freezes_health_or_other_requests(
    tiny_package: Path, daemon_factory: Callable[..., Daemon]
) -> None:
    daemon = daemon_factory(tiny_package)
    rss_before = daemon.rss_kib()
    prompt = "lorem ipsum dolor sit amet " * (PROMPT_CHARACTERS // 27)
    limits = httpx.Limits(max_connections=FLOOD + 4)
    async with httpx.AsyncClient(base_url=daemon.url, timeout=120, limits=limits) as http:
        stop = asyncio.Event()
        watcher = asyncio.create_task(_health_latencies(http, stop))
        await asyncio.sleep(0.1)
        started = time.monotonic()
        flood = [
            http.post("/v1/completions", json={"model": daemon.model, "prompt": prompt, "max_tokens": 4})
            for _ in range(FLOOD)
        ]
        small = http.post("/v1/completions", json={"model": daemon.model, "prompt": "hi", "max_tokens": 2})
        answers = await asyncio.gather(*flood, small)
        flood_s = time.monotonic() - started
        stop.set()
        latencies = await watcher
    *refused, served = answers
    for response in refused:
        assert response.status_code == 400, response.text[:300]
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded" and "characters" in error["message"]
    assert served.status_code == 200
    rss_after = daemon.rss_kib()
    report(
        "long_prompt_flood", prompts=FLOOD, prompt_chars=len(prompt), all_refused_s=round(flood_s, 2),
        health_checks=len(latencies), health_median_s=round(statistics.median(latencies), 4),
        health_max_s=round(max(latencies), 3), rss_change_mib=round((rss_after - rss_before) / 1024, 1),
    )
    assert max(latencies) < HEALTH_LIMIT_S
    assert flood_s < 10
