"""Admission under pressure, end to end: 10x max_concurrency clients at once get either a complete
answer or a prompt 429 with Retry-After; a KV cache far too small for the load still serves every
request with the output of an unconstrained daemon (preemption by recomputation), and a prompt that
could never fit is a 400 that says so."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from tests.reliability.reliability_daemon import Daemon, Outcome, generate, is_error_body, report

MAX_CONCURRENCY = 4
MAX_WAITING = 2
KV_CACHE_MEMORY = "96KiB"  # a dozen 16-token blocks of the tiny model: three requests' worth

TOPICS = ("the sea", "mountains", "bread", "rivers", "the moon", "cats", "trains", "winter", "bees", "clocks")


async def _timed(http: httpx.AsyncClient, path: str, body: dict) -> tuple[Outcome, float]:
    started = time.monotonic()
    outcome = await generate(http, path, body)
    return outcome, time.monotonic() - started


async def test_ten_times_max_concurrency_clients_complete_or_get_a_prompt_429(
    tiny_package: Path, daemon_factory: Callable[..., Daemon]
) -> None:
    daemon = daemon_factory(
        tiny_package, ["--max-concurrency", str(MAX_CONCURRENCY), "--max-waiting", str(MAX_WAITING)]
    )
    clients = 10 * MAX_CONCURRENCY
    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=daemon.url, timeout=120, limits=limits) as http:
        await generate(http, "/v1/completions", {"model": daemon.model, "prompt": "warm", "max_tokens": 2})
        bodies = [daemon.body(max_tokens=24, stream=i % 2 == 1) for i in range(clients)]
        results = await asyncio.wait_for(
            asyncio.gather(*(_timed(http, "/v1/chat/completions", body) for body in bodies)), timeout=180
        )
    served = [(o, s) for o, s in results if o.status == 200]
    refused = [(o, s) for o, s in results if o.status == 429]
    assert len(served) + len(refused) == clients, [o.status for o, _ in results]
    assert len(served) >= MAX_CONCURRENCY + MAX_WAITING and refused
    for outcome, _ in served:  # every admitted request completes, with the same greedy text
        assert outcome.complete and outcome.finish_reason and outcome.error is None, outcome
        assert outcome.text == served[0][0].text
    for outcome, _ in refused:
        assert outcome.error is not None and outcome.error["code"] == "queue_full"
        assert is_error_body({"error": outcome.error}) and int(outcome.headers["retry-after"]) >= 1
    refusal_s = [s for _, s in refused]
    idle = daemon.wait_idle()
    report(
        "overload", clients=clients, max_concurrency=MAX_CONCURRENCY, max_waiting=MAX_WAITING, completed=len(served),
        refused_429=len(refused), refusal_latency_median_s=round(statistics.median(refusal_s), 3),
        refusal_latency_max_s=round(max(refusal_s), 3),
        completed_latency_max_s=round(max(s for _, s in served), 2), leaked_blocks=idle["kv_blocks_used"],
    )
    # Generous: a refusal never waits for a generation slot (a 24-token answer takes longer on this machine).
    assert max(refusal_s) < 30
    assert idle["kv_blocks_used"] == 0 and idle["running"] == 0


async def _outputs(daemon: Daemon) -> list[Outcome]:
    limits = httpx.Limits(max_connections=len(TOPICS))
    async with httpx.AsyncClient(base_url=daemon.url, timeout=120, limits=limits) as http:
        return await asyncio.wait_for(
            asyncio.gather(
                *(
                    generate(
                        http, "/v1/chat/completions",
                        daemon.body(
                            messages=[{"role": "user", "content": f"Tell me about {topic}."}], max_tokens=40,
                            stream=i % 2 == 0,
                        ),
                    )
                    for i, topic in enumerate(TOPICS)
                )
            ),
            timeout=180,
        )


async def test_a_tiny_kv_cache_serves_every_request_unchanged_and_refuses_what_never_fits(
    tiny_package: Path, daemon_factory: Callable[..., Daemon]
) -> None:
    roomy = daemon_factory(tiny_package)
    expected = await _outputs(roomy)
    tight = daemon_factory(tiny_package, ["--kv-cache-memory", KV_CACHE_MEMORY])
    blocks = tight.status()["kv_blocks_total"]
    got = await _outputs(tight)
    for want, have in zip(expected, got, strict=True):
        assert want.complete and have.complete and have.error is None, have
        assert (have.text, have.finish_reason) == (want.text, want.finish_reason)

    capacity = blocks * 16
    assert capacity + 60 < 500, "the never-fitting prompt must still fit the tiny model's context"
    never_fits = {"model": tight.model, "prompt": "sea " * (capacity + 60), "max_tokens": 4}
    async with httpx.AsyncClient(base_url=tight.url, timeout=60) as http:
        refused = await http.post("/v1/completions", json=never_fits)
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["code"] == "context_length_exceeded", refused.text
    assert "KV cache" in error["message"] and "--kv-cache-memory" in error["message"]
    idle = tight.wait_idle()
    report(
        "kv_exhaustion", requests=len(TOPICS), kv_blocks_total=blocks, outputs_identical=len(got),
        never_fits_status=refused.status_code, leaked_blocks=idle["kv_blocks_used"],
    )
    assert idle["kv_blocks_used"] == 0 and idle["running"] == 0
