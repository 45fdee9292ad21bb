"""The scheduler at tensor-parallel 2 samples from per-shard statistics across the ranks: what a
client sees (tokens, log-probabilities, how each request ends) equals tensor-parallel 1, and the
logits of unfiltered rows never travel whole."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch.distributed as dist
from prometheus_client import CollectorRegistry
from tests.running_scheduler import running

from flare.sampler.status import DeviceStatus
from flare.package.directory import open_package
from flare.policy.params import SamplingParams
from flare.scheduler.metrics import SchedulerMetrics
from flare.scheduler.request import (
    Failed,
    FaultSpec,
    Finished,
    GenerationRequest,
    TextDelta,
)


@pytest.fixture(scope="module")
def peaked_package(make_package, package_parts):
    """The tiny model with its logits scaled 5x (its tied embedding): a few tokens carry the
    mass, so it repeats itself and the n-gram drafter's drafts get accepted."""
    state = dict(package_parts["state_dict"])
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"] * 5.0
    return make_package(state_dict=state)


LOGPROB_TOLERANCE = 1e-3
"""TP 2's logits differ from TP 1's in float32 rounding (the row-parallel all-reduce)."""


@dataclass(frozen=True)
class Case:
    name: str
    prompt: str
    params: SamplingParams
    logprobs: int | None = None
    raw_logprobs: bool = False
    prompt_logprobs: int | None = None
    fault: FaultSpec | None = None


@dataclass(frozen=True)
class Seen:
    """One request as its client sees it."""

    tokens: tuple[int, ...]
    logprobs: tuple[tuple[int, float, tuple[int, ...]], ...]
    prompt_logprobs: tuple[tuple[int, float, tuple[int, ...]], ...]
    end: str


def _entries(entries) -> tuple[tuple[int, float, tuple[int, ...]], ...]:
    return tuple((e.token_id, e.logprob, tuple(t for t, _ in e.top)) for e in entries or ())


async def _seen(package, cases: list[Case], **options) -> dict[str, Seen]:
    """Each case's request as its client sees it, and under "drafts" (tokens of the ngram
    drafter's drafts accepted) that speculation ran."""
    # A fixed draft length: drafts (and so which seeded draws happen) must not follow round times.
    async with running(package, max_concurrency=len(cases), draft_length="fixed", **options) as scheduler:
        registry = CollectorRegistry()
        scheduler.observer = SchedulerMetrics(registry)

        async def one(case: Case) -> tuple[str, Seen]:
            request = GenerationRequest(
                case.name,
                tuple(scheduler.tokenizer.encode(case.prompt)),
                case.params,
                fault=case.fault,
                logprobs=case.logprobs,
                raw_logprobs=case.raw_logprobs,
                prompt_logprobs=case.prompt_logprobs,
            )
            tokens: list[int] = []
            logprobs, prompt_logprobs, end = (), (), ""
            async for event in scheduler.submit(request):
                if isinstance(event, TextDelta):
                    tokens += event.token_ids
                    logprobs += _entries(event.logprobs)
                    prompt_logprobs += _entries(event.prompt_logprobs)
                elif isinstance(event, Finished):
                    end = f"finished fell_back={event.fell_back}"
                elif isinstance(event, Failed):
                    end = f"failed {event.failure.code}"
            return case.name, Seen(tuple(tokens), logprobs, prompt_logprobs, end)

        seen = dict(await asyncio.gather(*(one(case) for case in cases)))
        accepted = registry.get_sample_value("flare_draft_tokens_accepted_total", {"drafter": "ngram"})
        return {**seen, "drafts": Seen((int(accepted or 0),), (), (), "")}


def _assert_same(double: dict[str, Seen], single: dict[str, Seen]) -> None:
    assert double.keys() == single.keys()
    for name, one in single.items():
        if name == "drafts":
            continue
        two = double[name]
        assert (two.tokens, two.end) == (one.tokens, one.end), name
        for kind in ("logprobs", "prompt_logprobs"):
            got, want = getattr(two, kind), getattr(one, kind)
            assert [(t, top) for t, _, top in got] == [(t, top) for t, _, top in want], (name, kind)
            assert all(abs(a[1] - b[1]) < LOGPROB_TOLERANCE for a, b in zip(got, want, strict=True)), (name, kind)


CASES = [
    Case(
        "greedy",
        "one two three four one two three four one two",
        SamplingParams(temperature=0.0, max_tokens=16),
        logprobs=2,
    ),
    Case(
        "seeded",
        "one two three four one two three four",
        SamplingParams(temperature=0.3, seed=7, max_tokens=16),
        logprobs=3,
    ),
    Case(
        "raw",
        "Tell me a story about",
        SamplingParams(temperature=0.7, seed=11, max_tokens=8),
        logprobs=1,
        raw_logprobs=True,
    ),
    Case(
        "penalized",
        "one two one two one two",
        SamplingParams(
            temperature=0.8, seed=5, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4, max_tokens=10
        ),
    ),
    # A bias that overrides the model: greedy then emits the biased token, whichever rank holds it.
    Case(
        "biased",
        "The weather today",
        SamplingParams(temperature=0.0, logit_bias=((5, 4.0), (1000, 100.0)), max_tokens=6),
    ),
    Case(
        "filtered",
        "Once upon a time",
        SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=3, max_tokens=8),
        logprobs=1,
    ),
    Case("echo", "Score every word of this prompt", SamplingParams(temperature=0.0, max_tokens=3), prompt_logprobs=2),
]


async def test_tp2_gives_tp1s_tokens_logprobs_and_ends_for_every_sampler_input(peaked_package) -> None:
    single = await _seen(peaked_package, CASES)
    double = await _seen(peaked_package, CASES, tensor_parallel=2)
    assert all(len(seen.tokens) > 0 for seen in single.values())
    assert single["drafts"].tokens[0] > 0 and double["drafts"].tokens[0] > 0, "n-gram drafts were verified and accepted"
    assert single["biased"].tokens == (1000,) * 6, "the +100 bias decides every token"
    assert len(single["echo"].prompt_logprobs) > 3 and len(single["greedy"].logprobs) == 16
    _assert_same(double, single)


FAULTS = [
    Case(
        "fell",
        "Tell me a story about",
        SamplingParams(temperature=0.0, max_tokens=10),
        fault=FaultSpec(DeviceStatus.INVALID_SPECULATION, round=1),
    ),
    Case(
        "nan",
        "Hello there, how are",
        SamplingParams(temperature=0.0, max_tokens=10),
        fault=FaultSpec(DeviceStatus.NONFINITE_LOGITS, round=1),
    ),
    Case(
        "bad-draft",
        "one two one two one two",
        SamplingParams(temperature=0.0, max_tokens=10),
        fault=FaultSpec(DeviceStatus.INVALID_DRAFT_PROBABILITY, round=2),
    ),
    Case("clean", "one two one two one two", SamplingParams(temperature=0.0, max_tokens=10)),
]


@pytest.mark.parametrize("on_invalid", ["fallback", "fail"])
async def test_tp2_ends_faulted_rows_as_tp1_and_falls_back_after_invalid_speculation(
    peaked_package, on_invalid
) -> None:
    options = {"fault_injection": True, "on_invalid_speculation": on_invalid}
    single = await _seen(peaked_package, FAULTS, **options)
    double = await _seen(peaked_package, FAULTS, tensor_parallel=2, **options)
    expected_fell = "finished fell_back=True" if on_invalid == "fallback" else "failed INVALID_SPECULATION"
    assert single["fell"].end == expected_fell
    assert single["nan"].end == "failed NONFINITE_LOGITS" and single["clean"].end == "finished fell_back=False"
    assert single["bad-draft"].end == "failed INVALID_DRAFT_PROBABILITY"
    _assert_same(double, single)


async def test_tp2_gathers_per_shard_statistics_not_logit_rows_except_for_filtered_rows(
    peaked_package, monkeypatch
) -> None:
    vocab_size = open_package(peaked_package).manifest.model.vocab_size
    gathered: list[int] = []  # values per rank, per gather on rank 0
    real_gather = dist.gather

    def counting_gather(tensor, gather_list=None, dst=0, group=None, async_op=False):
        if gather_list is not None:
            gathered.append(tensor.numel())
        return real_gather(tensor, gather_list, dst=dst, group=group, async_op=async_op)

    monkeypatch.setattr(dist, "gather", counting_gather)
    unfiltered = [c for c in CASES if c.name != "filtered"]
    await _seen(peaked_package, unfiltered, tensor_parallel=2)
    assert gathered, "sampling across ranks gathers statistics"
    # A round's statistics: a few values per position and rank (max, sum, argmax, top-k ...),
    # far from one row's V / 2 logits per rank.
    assert max(gathered) < vocab_size // 8, (max(gathered), vocab_size)

    # With a row that has filters among them: that row's positions (1 + its drafts, at most 5)
    # are gathered whole for the single-shard sampler, and only they.
    gathered.clear()
    await _seen(peaked_package, CASES, tensor_parallel=2)
    half = -(-vocab_size // 2)
    assert half <= max(gathered) <= 5 * half


def _pinned_threads(pid: int, cpu: int) -> int:
    """How many of ``pid``'s threads may run only on ``cpu``."""
    tasks = Path(f"/proc/{pid}/task")
    return sum(os.sched_getaffinity(int(task.name)) == {cpu} for task in tasks.iterdir())


async def test_per_rank_cpu_lists_pin_each_worker_and_rank_0s_model_thread(tiny_package) -> None:
    import torch

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    first, second = cpus[0], cpus[1]
    threads = torch.get_num_threads()
    try:
        async with running(tiny_package, tensor_parallel=2, tensor_parallel_cpus=f"{second}|{first}") as scheduler:
            ranks = {rank: (pid, cpus) for rank, pid, cpus in scheduler.snapshot().ranks}
            assert ranks[0] == (os.getpid(), (second,)) and ranks[1][1] == (first,)
            # The thread that loads and runs rank 0's rounds is pinned; the event loop is not.
            assert _pinned_threads(os.getpid(), second) >= 1 and os.sched_getaffinity(0) == set(cpus)
            assert os.sched_getaffinity(ranks[1][0]) == {first}
    finally:  # this test process is rank 0: give the next tests their threads back
        torch.set_num_threads(threads)


def test_a_cpu_list_per_rank_of_the_wrong_count_is_refused_naming_both(tiny_package) -> None:
    from flare.scheduler.scheduler import Scheduler, SchedulerOptions

    with pytest.raises(ValueError, match="gives 3 CPU lists for 2 ranks"):
        Scheduler.from_package(
            open_package(tiny_package), SchedulerOptions(tensor_parallel=2, tensor_parallel_cpus="0|1|0")
        )


async def test_each_ranks_cpu_seconds_are_a_metric_labelled_by_rank(tiny_package) -> None:
    registry = CollectorRegistry()
    async with running(tiny_package, tensor_parallel=2) as scheduler:
        metrics = SchedulerMetrics(registry)
        metrics.watch_ranks(scheduler.runner.rank_list)
        ids = tuple(scheduler.tokenizer.encode("Hello there"))
        async for _ in scheduler.submit(GenerationRequest("r", ids, SamplingParams(temperature=0.0, max_tokens=8))):
            pass
        seconds = {
            rank: registry.get_sample_value("flare_tensor_parallel_rank_cpu_seconds_total", {"rank": rank})
            for rank in ("0", "1")
        }
    assert all(value is not None and value > 0 for value in seconds.values()), seconds
