"""What a load frees goes back to the system: the heap is trimmed once the last heavy part (the
tokenizer, the grammar compiler) is built, since glibc keeps freed chunks resident in the arenas
the serving threads then reuse (a 150k-token tokenizer's parse left ~75 MB of them)."""

from __future__ import annotations

import flare.scheduler.loading as loading_module
from flare.package.directory import open_package
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
