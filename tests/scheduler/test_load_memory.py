"""What a load and the rounds free goes back to the system: the heap is trimmed once the last
heavy part (the tokenizer, the grammar compiler) is built, and each time the scheduler goes idle
after rounds, since glibc keeps freed chunks resident in the arenas the serving threads then reuse
(a 150k-token tokenizer's parse left ~75 MB of them, a 1,473-token prompt's rounds ~50 MB)."""

from __future__ import annotations

import asyncio

from tests.running_scheduler import running

import flare.scheduler.loading as loading_module
import flare.scheduler.scheduler as scheduler_module
from flare.package.directory import open_package
from flare.policy.params import SamplingParams
from flare.scheduler.request import Finished, GenerationRequest
from flare.scheduler.round.model_thread import ModelThread
from flare.scheduler.scheduler import Scheduler, SchedulerOptions


def test_loading_hands_the_heap_back_after_every_part_is_built(tiny_package, monkeypatch):
    events: list[str] = []
    compiler = loading_module.GrammarCompiler
    tokenizer = loading_module.Tokenizer.from_package

    def built_compiler(*args, **kwargs):
        events.append("grammar compiler")
        return compiler(*args, **kwargs)

    def built_tokenizer(package):
        events.append("tokenizer")
        return tokenizer(package)

    monkeypatch.setattr(loading_module, "GrammarCompiler", built_compiler)
    monkeypatch.setattr(loading_module.Tokenizer, "from_package", built_tokenizer)
    monkeypatch.setattr(loading_module, "give_back_heap", lambda: events.append("heap given back"))
    thread = ModelThread()
    try:
        Scheduler.from_package(open_package(tiny_package), SchedulerOptions(), model_thread=thread)
    finally:
        thread.shutdown()
    assert {"tokenizer", "grammar compiler"} <= set(events)
    assert events[-1] == "heap given back" and events.count("heap given back") == 1


async def test_the_heap_is_given_back_once_each_time_the_scheduler_goes_idle_after_rounds(tiny_package, monkeypatch):
    """A long prompt's activations are freed when its rounds end; glibc would keep them resident in
    its arenas. Once a whole idle tick has passed the scheduler trims the heap, once, not on every
    idle tick."""
    trims: list[bool] = []
    monkeypatch.setattr(scheduler_module, "give_back_heap", lambda: trims.append(True))
    async with running(tiny_package, idle_tick_s=0.01) as scheduler:
        await asyncio.sleep(0.1)
        assert trims == []  # idle from the start: nothing to give back
        for round_ in range(2):
            prompt = tuple(scheduler.tokenizer.encode("Tell me about the sea.")) or (0,)
            stream = scheduler.submit(GenerationRequest(f"r{round_}", prompt, SamplingParams(temperature=0.0, max_tokens=4)))
            events = [event async for event in stream]
            assert isinstance(events[-1], Finished)
            await asyncio.sleep(0.2)  # twenty idle ticks
            assert trims == [True] * (round_ + 1)
