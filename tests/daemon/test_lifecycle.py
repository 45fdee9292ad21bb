"""The daemon's lifecycle with a fake scheduler: listen first, ready after warm-up, drain on stop."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
from tests.fake_scheduler import FakeScheduler

from flare.daemon.config import DaemonConfig
from flare.daemon.lifecycle import Daemon

CHAT = {"model": "tiny-model", "messages": [{"role": "user", "content": "Hi"}], "stream": True}


async def wait_for(condition, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


@pytest.fixture
def scheduler() -> FakeScheduler:
    scheduler = FakeScheduler()
    scheduler.hold = True
    return scheduler


@pytest.fixture
async def started(
    scheduler: FakeScheduler, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[Daemon, str, asyncio.Task[None]]]:
    config = replace(DaemonConfig(port=0, served_model_name=("tiny-model",), log_format="json"), **getattr(request, "param", {}))
    daemon = Daemon(replace(config, state_dir=tmp_path), {})
    monkeypatch.setattr(daemon, "load_scheduler", lambda: scheduler)
    task = asyncio.create_task(daemon.run())
    await wait_for(lambda: daemon.address is not None and daemon.scheduler is not None)
    host, port = daemon.address  # type: ignore[misc]
    yield daemon, f"http://{host}:{port}", task
    daemon.request_stop()
    await asyncio.wait_for(task, 30)


async def test_ready_only_after_warm_up(started: tuple[Daemon, str, asyncio.Task[None]], scheduler: FakeScheduler) -> None:
    daemon, url, _ = started
    async with aiohttp.ClientSession() as session:
        await wait_for(lambda: daemon.state.model_name is not None)
        async with session.get(f"{url}/health") as health:
            assert health.status == 200
    assert scheduler.warmed_up


async def test_stop_waits_for_streams_in_flight_then_exits(
    started: tuple[Daemon, str, asyncio.Task[None]], scheduler: FakeScheduler
) -> None:
    daemon, url, task = started
    await wait_for(lambda: daemon.state.model_name is not None)
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/chat/completions", json=CHAT) as stream:
            await stream.content.readline()
            daemon.request_stop()
            await wait_for(lambda: scheduler.draining)
            async with session.get(f"{url}/health") as health:
                assert health.status == 503
            assert not task.done()
            scheduler.release(scheduler.submitted[0].request_id)
            body = (await stream.read()).decode()
    assert body.endswith("data: [DONE]\n\n") and '"finish_reason":"stop"' in body
    await asyncio.wait_for(task, 10)


@pytest.mark.parametrize("started", [{"drain_grace_s": 0.0}], indirect=True)
async def test_stop_past_the_grace_period_ends_streams_with_shutdown_error(
    started: tuple[Daemon, str, asyncio.Task[None]], scheduler: FakeScheduler
) -> None:
    daemon, url, task = started
    await wait_for(lambda: daemon.state.model_name is not None)
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/chat/completions", json=CHAT) as stream:
            await stream.content.readline()
            daemon.request_stop()
            events = [e for e in (await stream.read()).decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "shutdown"
    await asyncio.wait_for(task, 10)
