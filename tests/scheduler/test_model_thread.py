"""The scheduler's torch work stays on one thread: the weights load where the rounds run
(flare/scheduler/round/model_thread.py: a second thread's OpenMP team slowed every round by half)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from tests.running_scheduler import running

import flare.scheduler.loading as loading_module
from flare.package.directory import open_package
from flare.policy.params import SamplingParams
from flare.scheduler.round.model_runner import ModelRunner
from flare.scheduler.round.model_thread import ModelThread
from flare.scheduler.request import Finished, GenerationRequest
from flare.scheduler.scheduler import Scheduler, SchedulerOptions


async def test_the_weights_load_on_the_thread_that_runs_every_round_not_the_callers(tiny_package, monkeypatch):
    threads: dict[str, set[int]] = {"load": set(), "round": set()}
    load_model, execute = loading_module.load_model, ModelRunner.execute

    def recorded_load(*args, **kwargs):
        threads["load"].add(threading.get_ident())
        return load_model(*args, **kwargs)

    def recorded_execute(self, plan):
        threads["round"].add(threading.get_ident())
        return execute(self, plan)

    monkeypatch.setattr(loading_module, "load_model", recorded_load)
    monkeypatch.setattr(ModelRunner, "execute", recorded_execute)
    async with running(tiny_package, max_concurrency=2) as scheduler:
        ids = tuple(scheduler.tokenizer.encode("Hello there"))
        events = [e async for e in scheduler.submit(GenerationRequest("r", ids, SamplingParams(temperature=0.0, max_tokens=4)))]
    assert isinstance(events[-1], Finished)
    assert len(threads["load"]) == 1 and threads["load"] == threads["round"]
    assert threading.get_ident() not in threads["load"]


async def test_a_stopped_scheduler_has_ended_its_model_thread_when_its_loop_returns(tiny_package):
    # A model thread that ended while the interpreter finalized aborted the process (rc 134).
    before = set(threading.enumerate())
    async with running(tiny_package) as scheduler:
        started = [t for t in threading.enumerate() if t not in before and t.name == "flare-model"]
        ids = tuple(scheduler.tokenizer.encode("Hello"))
        async for _ in scheduler.submit(GenerationRequest("r", ids, SamplingParams(temperature=0.0, max_tokens=2))):
            pass
    assert len(started) == 1 and not started[0].is_alive()


def test_a_model_thread_runs_jobs_in_order_and_hands_back_results_and_errors():
    thread = ModelThread(name="test-model")
    try:
        order: list[int] = []
        futures = [thread.submit(order.append, k) for k in range(5)]
        assert [f.result(timeout=5) for f in futures] == [None] * 5
        assert order == [0, 1, 2, 3, 4]
        assert thread.run(lambda a, b: a + b, 2, 3) == 5
        with pytest.raises(ZeroDivisionError):
            thread.run(lambda: 1 / 0)
        assert thread.run(threading.current_thread).name == "test-model"  # still serving after an error
    finally:
        thread.shutdown()


def test_a_failed_load_ends_its_thread(tiny_package, monkeypatch):
    def failing_load(*args, **kwargs):
        raise RuntimeError("disk on fire")

    before = set(threading.enumerate())
    monkeypatch.setattr(loading_module, "load_model", failing_load)
    with pytest.raises(RuntimeError, match="disk on fire"):
        Scheduler.from_package(open_package(tiny_package), SchedulerOptions())
    started = [t for t in threading.enumerate() if t not in before and t.name == "flare-model"]
    for t in started:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in started)


async def test_schedulers_given_one_model_thread_load_and_run_on_it_and_leave_it_running(tiny_package):
    shared = ModelThread(name="shared-model")
    try:
        first = Scheduler.from_package(open_package(tiny_package), SchedulerOptions(), model_thread=shared)
        second = Scheduler.from_package(open_package(tiny_package), SchedulerOptions(draft_tokens=0), model_thread=shared)
        for scheduler in (first, second):
            loop = asyncio.create_task(scheduler.run())
            ids = tuple(scheduler.tokenizer.encode("Hello"))
            events = [e async for e in scheduler.submit(GenerationRequest("r", ids, SamplingParams(temperature=0.0, max_tokens=2)))]
            assert isinstance(events[-1], Finished)
            scheduler.stop()
            await loop
        assert shared.run(threading.current_thread).name == "shared-model"  # not ended by either
    finally:
        shared.shutdown(wait=True)
