"""The scheduler over the tiny package at tensor-parallel 2: the answers of TP 1, and fail-stop."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from tests.running_scheduler import running

from flare.parallel.failstop import EngineDead
from flare.package.directory import open_package
from flare.policy.params import SamplingParams
from flare.scheduler.request import Failed, Finished, GenerationRequest
from flare.scheduler.scheduler import Scheduler, SchedulerOptions

REQUESTS = [
    ("greedy", "Hello there, how are", SamplingParams(temperature=0.0, max_tokens=12)),
    ("seeded", "Tell me a story about", SamplingParams(temperature=0.8, seed=7, max_tokens=12)),
    ("penalized", "one two one two one two", SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=12)),
]


async def _answers(package, **options) -> tuple[dict[str, tuple[int, ...]], int]:
    """Each request's tokens, and what a token costs the KV pool (`flare ctl status`)."""
    async with running(package, max_concurrency=4, **options) as scheduler:

        async def one(name: str, text: str, params: SamplingParams) -> tuple[str, tuple[int, ...]]:
            ids = tuple(scheduler.tokenizer.encode(text))
            tokens: list[int] = []
            async for event in scheduler.submit(GenerationRequest(name, ids, params)):
                tokens += getattr(event, "token_ids", ())
                assert not isinstance(event, Failed), event
            return name, tuple(tokens)

        return dict(await asyncio.gather(*(one(*r) for r in REQUESTS))), scheduler.snapshot().kv_bytes_per_token


async def test_tp2_answers_equal_tp1_greedy_seeded_and_penalized_with_ngram_drafts(tiny_package) -> None:
    single, whole_pool_bytes = await _answers(tiny_package)
    double, rank_pool_bytes = await _answers(tiny_package, tensor_parallel=2)
    assert all(len(tokens) == 12 for tokens in single.values())
    assert double == single
    # Each rank's pool holds half of the KV heads: a token costs it half.
    assert rank_pool_bytes * 2 == whole_pool_bytes


async def test_a_worker_killed_mid_stream_ends_the_stream_with_engine_dead_and_stops_the_loop(tiny_package) -> None:
    scheduler = Scheduler.from_package(open_package(tiny_package), SchedulerOptions(tensor_parallel=2, max_concurrency=2))
    worker_pid = next(pid for rank, pid, _ in scheduler.snapshot().ranks if rank == 1)
    loop_task = asyncio.create_task(scheduler.run())
    ids = tuple(scheduler.tokenizer.encode("Hello there"))
    events = []
    async for event in scheduler.submit(GenerationRequest("r", ids, SamplingParams(temperature=0.0, max_tokens=200))):
        events.append(event)
        if len(events) == 2:
            os.kill(worker_pid, signal.SIGKILL)
    assert isinstance(events[-1], Failed) and events[-1].failure.code == "engine_dead"
    assert "rank 1" in events[-1].failure.message or "collective" in events[-1].failure.message
    with pytest.raises(EngineDead):
        await asyncio.wait_for(loop_task, 60)
    status = Path(f"/proc/{worker_pid}/status")
    assert not status.exists() or "State:\tZ" in status.read_text()


def test_a_tp_size_that_does_not_divide_the_heads_is_refused_before_any_weight_loads(tiny_package) -> None:
    with pytest.raises(ValueError, match="must divide both the model's 4 attention heads and its 2 KV heads"):
        Scheduler.from_package(open_package(tiny_package), SchedulerOptions(tensor_parallel=3))


async def _structured_with_logprobs(package, **options) -> tuple[str, list]:
    import json

    from flare.scheduler.request import TextDelta
    from flare.structured import GrammarSpec

    schema = {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["colour", "count"],
        "additionalProperties": False,
    }
    async with running(package, **options) as scheduler:
        grammar = scheduler.grammars.compile(GrammarSpec.json_schema(schema, "response_format"))
        prompt = tuple(scheduler.tokenizer.encode("Tell me in JSON."))
        text, logprobs = "", []
        params = SamplingParams(temperature=0.7, seed=3, max_tokens=60)
        async for event in scheduler.submit(GenerationRequest("s", prompt, params, grammar=grammar, logprobs=2)):
            if isinstance(event, TextDelta):
                text += event.text
                logprobs += [(e.token_id, round(e.logprob, 4), tuple(t for t, _ in e.top)) for e in event.logprobs]
            else:
                assert isinstance(event, Finished), event
    assert set(json.loads(text)) == {"colour", "count"}
    return text, logprobs


async def test_tp2_structured_output_with_logprobs_and_speculation_equals_tp1(tiny_package) -> None:
    single = await _structured_with_logprobs(tiny_package)
    double = await _structured_with_logprobs(tiny_package, tensor_parallel=2)
    assert single[1], "the answer carries log-probabilities"
    assert double[0] == single[0]
    assert [(t, top) for t, _, top in double[1]] == [(t, top) for t, _, top in single[1]]
    assert all(abs(a[1] - b[1]) < 1e-3 for a, b in zip(double[1], single[1], strict=True))
