"""A bounded soak at full concurrency (mixed streaming and not, clients that drop, injected faults)
that ends with zero leaked blocks, zero unexplained 5xx and resident memory that stops growing
(within 10% of its highest level in the soak's first half); then SIGTERM in the middle of such
load: no client sees a truncated success, new requests are refused, and the daemon exits 0 within
its grace period."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
from tests.reliability.reliability_daemon import Daemon, Outcome, generate, report

from flare.sampler.status import DeviceStatus

WORKERS = 40  # more clients than the tiny package's 32 slots, so a queue forms too
WARM_UP_S = 8.0  # long enough to reach the batch shapes (and allocator pools) of full load
SOAK_S = float(os.environ.get("FLARE_SOAK_S", "20"))  # raise it for a longer run (docs/reliability.md)
RSS_MARGIN = 0.10
FAULTS = [s.name for s in DeviceStatus if s is not DeviceStatus.OK]
DRAIN_GRACE_S = 3


class Tally:
    def __init__(self) -> None:
        self.kinds: Counter[str] = Counter()
        self.statuses: Counter[int] = Counter()
        self.faults_took_effect = 0
        self.unexplained_5xx = 0


def _check(outcome: Outcome, fault: str | None, stream: bool, tally: Tally) -> None:
    """A request with a fault ends with that status's error or (a round it never reached,
    INVALID_SPECULATION's fallback) completes; every other one completes."""
    tally.statuses[outcome.status] += 1
    if outcome.error is not None and fault is not None and outcome.error["code"] == fault:
        tally.faults_took_effect += 1
        assert outcome.complete or not stream
        return
    if outcome.status >= 500 or outcome.error is not None:
        tally.unexplained_5xx += outcome.status >= 500
        raise AssertionError(f"unexpected answer {outcome}")
    assert outcome.status == 200 and outcome.complete and outcome.finish_reason, outcome


async def _worker(daemon: Daemon, seed: int, until: float, tally: Tally) -> None:
    chooser = random.Random(seed)
    async with httpx.AsyncClient(base_url=daemon.url, timeout=120) as http:
        while time.monotonic() < until:
            stream = chooser.random() < 0.6
            body = daemon.body(
                max_tokens=chooser.randint(4, 32), stream=stream,
                temperature=chooser.choice([0.0, 0.8]), seed=chooser.randrange(1 << 30),
            )
            path = "/v1/chat/completions"
            if chooser.random() < 0.4:
                path, body = "/v1/completions", {**{k: v for k, v in body.items() if k != "messages"}, "prompt": "Once"}
            kind = chooser.choices(["plain", "fault", "drop"], weights=[6, 2, 2])[0]
            tally.kinds[kind] += 1
            if kind == "drop":
                body["stream"] = True
                outcome = await generate(http, path, body, drop_after_events=chooser.randint(0, 6))
                tally.statuses[outcome.status] += 1
                assert outcome.status == 200, outcome
                continue
            fault = f"{chooser.choice(FAULTS)}@{chooser.randint(0, 3)}" if kind == "fault" else None
            outcome = await generate(http, path, body, headers={"X-Flare-Fault": fault} if fault else None)
            _check(outcome, fault.split("@")[0] if fault else None, stream, tally)


async def test_soak_with_drops_and_faults_leaks_nothing(
    tiny_package: Path, daemon_factory: Callable[..., Daemon]
) -> None:
    daemon = daemon_factory(tiny_package, ["--fault-injection"])
    warm = Tally()
    start = time.monotonic()
    await asyncio.gather(*(_worker(daemon, -i, start + WARM_UP_S, warm) for i in range(WORKERS)))
    daemon.wait_idle()
    rss_warm = daemon.rss_kib()

    tally = Tally()
    start = time.monotonic()
    trajectory: list[int] = []

    async def sample_rss() -> None:
        while time.monotonic() < start + SOAK_S:
            await asyncio.sleep(SOAK_S / 8)
            trajectory.append(daemon.rss_kib() // 1024)

    await asyncio.wait_for(
        asyncio.gather(sample_rss(), *(_worker(daemon, i, start + SOAK_S, tally) for i in range(WORKERS))),
        timeout=SOAK_S + 120,
    )
    elapsed = time.monotonic() - start
    idle = daemon.wait_idle()
    rss_end = daemon.rss_kib()
    report(
        "soak", seconds=round(elapsed, 1), workers=WORKERS, requests=sum(tally.kinds.values()),
        kinds=dict(tally.kinds), statuses=dict(sorted(tally.statuses.items())),
        faults_took_effect=tally.faults_took_effect, unexplained_5xx=tally.unexplained_5xx,
        leaked_blocks=idle["kv_blocks_used"], running=idle["running"], waiting=idle["waiting"],
        rss_after_warm_up_kib=rss_warm, rss_end_kib=rss_end, rss_change=f"{(rss_end - rss_warm) / rss_warm:+.1%}",
        rss_mib_during=trajectory,
    )
    assert tally.unexplained_5xx == 0
    assert idle["kv_blocks_used"] == 0 and idle["running"] == 0 and idle["waiting"] == 0
    # The allocator's pools step up under load and then hold: one idle sample after warm-up was
    # 11% low with nothing leaked (398 against 442 MiB), and one soak stepped from 315 to 373 MiB
    # in its first quarter, then held at 373-375 MiB to the end. A leak keeps growing: the
    # baseline is the highest sample of the soak's first half, and the end must not pass it by
    # more than the margin.
    first_half = trajectory[: max(len(trajectory) // 2, 1)]
    assert rss_end <= max(rss_warm, max(first_half) * 1024) * (1 + RSS_MARGIN)
    assert daemon.serves()


async def test_sigterm_under_load_loses_no_completed_answer_and_exits_0(
    tiny_package: Path, daemon_factory: Callable[..., Daemon]
) -> None:
    daemon = daemon_factory(tiny_package, ["--drain-grace-s", str(DRAIN_GRACE_S)])
    clients = 40

    async def one(i: int, http: httpx.AsyncClient) -> Outcome | str:
        body = daemon.body(max_tokens=[16, 64, 400][i % 3], temperature=0.8, seed=i, stream=i % 4 != 0)
        try:
            return await generate(http, "/v1/chat/completions", body)
        except httpx.TransportError as error:  # the listener closed before this request was sent
            return type(error).__name__

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=daemon.url, timeout=120, limits=limits) as http:
        load = asyncio.gather(*(one(i, http) for i in range(clients)))
        while daemon.status()["running"] < 16:  # mid-load: the slots are filling
            await asyncio.sleep(0.02)
        signalled = time.monotonic()
        daemon.process.process.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.2)
        try:
            late = await generate(http, "/v1/completions", {"model": daemon.model, "prompt": "late", "max_tokens": 2})
            refused = late.status == 503 and late.error is not None and late.error["code"] == "draining"
        except httpx.TransportError:
            refused = True  # the listener is already closed
        outcomes = await asyncio.wait_for(load, timeout=120)
    code = await asyncio.to_thread(daemon.process.process.wait, DRAIN_GRACE_S + 60)
    exited_s = time.monotonic() - signalled

    ends: Counter[str] = Counter()
    for outcome in outcomes:
        if isinstance(outcome, str):
            ends["not sent"] += 1
            continue
        if outcome.status != 200:
            # Non-streaming: refused while draining, or ended past the grace period; both 503, said so.
            assert outcome.status == 503 and outcome.error and outcome.error["code"] in ("draining", "shutdown")
            ends[f"503 {outcome.error['code']}"] += 1
            continue
        # Whole or clearly ended: a stream always reaches [DONE], after its finish_reason or an error.
        assert outcome.complete, outcome
        if outcome.error is not None:
            assert outcome.error["code"] == "shutdown", outcome
            ends["ended with shutdown error"] += 1
        else:
            assert outcome.finish_reason in ("stop", "length"), outcome
            ends["completed"] += 1
    report(
        "shutdown_under_load", clients=clients, ends=dict(ends), new_request_refused=refused, exit_code=code,
        exit_s_after_sigterm=round(exited_s, 2), drain_grace_s=DRAIN_GRACE_S,
    )
    assert refused and code == 0 and ends["completed"] > 0
    assert daemon.process.events("draining") and daemon.process.events("stopped")
