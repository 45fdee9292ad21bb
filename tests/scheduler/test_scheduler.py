"""The scheduler on a tiny random model: continuous batching, stops, cancellation,
preemption, speculation, faults and admission, as a client of the scheduler sees them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
import structlog
from tests.running_scheduler import running

from flare.engine import precision
from flare.sampler.status import DeviceStatus
from flare.package.directory import open_package
from flare.policy.params import SamplingParams
from flare.scheduler.errors import Draining, PromptTooLong, QueueFull
from flare.scheduler.request import Failed, FaultSpec, Finished, GenerationRequest, TextDelta
from flare.scheduler.scheduler import Scheduler, SchedulerOptions

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
# Repetitive prompts give the n-gram drafter something to propose.
PROMPTS = [
    "one two three four one two three four one two three four one two",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "a b c d e f g a b c d e f g a b c",
    "Hello, world! Hello, world! Hello, world!",
]


@dataclass
class Outcome:
    text: str
    token_ids: list[int]
    end: Finished | Failed



async def collect(stream) -> Outcome:
    text, ids = [], []
    async for event in stream:
        if isinstance(event, TextDelta):
            text.append(event.text)
            ids.extend(event.token_ids)
        else:
            return Outcome("".join(text), ids, event)
    raise AssertionError("stream ended without a terminal event")


def request(scheduler: Scheduler, rid: str, prompt: str, params: SamplingParams = GREEDY, fault=None):
    ids = tuple(scheduler.tokenizer.encode(prompt))
    return GenerationRequest(rid, ids, params, fault)


async def generate_all(scheduler: Scheduler, requests: list[GenerationRequest]) -> dict[str, Outcome]:
    streams = {r.request_id: scheduler.submit(r) for r in requests}
    outcomes = await asyncio.gather(*(collect(s) for s in streams.values()))
    return dict(zip(streams, outcomes))


async def wait_idle(scheduler: Scheduler) -> None:
    for _ in range(200):
        if scheduler.idle:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("scheduler did not become idle")


async def test_a_request_streams_text_and_finishes_at_max_tokens(tiny_package):
    async with running(tiny_package) as scheduler:
        outcome = (await generate_all(scheduler, [request(scheduler, "r1", PROMPTS[0])]))["r1"]
    assert isinstance(outcome.end, Finished)
    assert outcome.end.reason in ("length", "stop")
    assert outcome.end.usage.completion_tokens == len(outcome.token_ids) <= GREEDY.max_tokens
    assert outcome.end.usage.prompt_tokens == len(scheduler.tokenizer.encode(PROMPTS[0]))
    assert outcome.text == scheduler.tokenizer.decode(outcome.token_ids)


async def test_more_requests_than_max_concurrency_all_complete_and_free_every_block(tiny_package):
    async with running(tiny_package, max_concurrency=3, draft_tokens=0) as scheduler:
        reqs = [request(scheduler, f"r{i}", PROMPTS[i % len(PROMPTS)]) for i in range(10)]
        outcomes = await generate_all(scheduler, reqs)
        snapshot = scheduler.snapshot()
    assert all(isinstance(o.end, Finished) for o in outcomes.values())
    assert snapshot.running == 0 and snapshot.waiting == 0
    assert snapshot.kv_blocks_used == 0


async def test_greedy_output_is_the_same_alone_and_inside_a_batch(tiny_package):
    async with running(tiny_package, draft_tokens=0) as scheduler:
        alone = {p: (await generate_all(scheduler, [request(scheduler, f"a{i}", p)]))[f"a{i}"] for i, p in enumerate(PROMPTS)}
        together = await generate_all(scheduler, [request(scheduler, f"b{i}", p) for i, p in enumerate(PROMPTS)])
    for i, prompt in enumerate(PROMPTS):
        assert together[f"b{i}"].token_ids == alone[prompt].token_ids


async def test_speculation_does_not_change_greedy_output(tiny_package):
    async with running(tiny_package, draft_tokens=0) as plain:
        expected = await generate_all(plain, [request(plain, f"r{i}", p) for i, p in enumerate(PROMPTS)])
    # Every n-gram proposal is verified (no adaptive cut), so rejected and accepted drafts both
    # go through the KV cache and the verify kernel; the real-model test shows acceptance.
    async with running(tiny_package, draft_length="fixed") as speculative:
        got = await generate_all(speculative, [request(speculative, f"r{i}", p) for i, p in enumerate(PROMPTS)])
    for rid, outcome in expected.items():
        assert got[rid].token_ids == outcome.token_ids


async def test_every_round_is_logged_with_what_the_draft_length_model_learns_from(tiny_package):
    with structlog.testing.capture_logs() as logs:
        async with running(tiny_package, draft_length="fixed") as scheduler:
            outcomes = await generate_all(scheduler, [request(scheduler, f"r{i}", p) for i, p in enumerate(PROMPTS)])
    rounds = [entry for entry in logs if entry["event"] == "round_completed"]
    assert [r["round"] for r in rounds] == sorted({r["round"] for r in rounds})
    assert all(r["seconds"] > 0 and r["tokens"] >= r["rows"] >= 1 for r in rounds)
    assert sum(r["generated"] for r in rounds) == sum(len(o.token_ids) for o in outcomes.values())
    assert any(r["drafts"] > 0 for r in rounds) and all(0 <= r["accepted"] <= r["drafts"] for r in rounds)


# (package dtype, CPU kind, the format asked for, the format its linear layers run in). An "avx2"
# CPU runs the float16 GEMM (native.float16_linear), and so does a "native-bf16" one (AVX512-BF16
# or AMX tiles) unless its operator asks for oneDNN's bfloat16; a "plain" one neither.
FORMAT_CHOICES = [
    ("float16", "avx2", "auto", "float16"),
    ("float16", "native-bf16", "auto", "float16"),
    ("float16", "native-bf16", "bfloat16", "bfloat16"),
    ("float16", "plain", "auto", "float32"),
    ("bfloat16", "avx2", "auto", "float16"),
    ("float32", "avx2", "auto", "float32"),
]


@pytest.mark.parametrize(
    "stored, cpu, asked, runs", FORMAT_CHOICES, ids=[f"{s}-on-{c}-{a}" for s, c, a, _ in FORMAT_CHOICES]
)
async def test_a_package_serves_in_the_format_its_cpu_runs_fastest_and_logs_it(
    make_package, monkeypatch, stored, cpu, asked, runs
):
    if cpu in ("avx2", "native-bf16") and not precision.cpu_has_float16_gemm():
        pytest.skip("float16 GEMMs do not run vectorised on this CPU")
    if runs == "bfloat16" and not precision.cpu_has_native_bf16():
        pytest.skip("oneDNN does not run bfloat16 natively on this CPU")
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: cpu == "native-bf16")
    monkeypatch.setattr(precision, "cpu_has_float16_gemm", lambda: cpu in ("avx2", "native-bf16"))
    package = make_package(serving={"dtype": stored})
    with structlog.testing.capture_logs() as logs:
        async with running(package, draft_tokens=0, weight_format=asked) as scheduler:
            outcome = (await generate_all(scheduler, [request(scheduler, "b", PROMPTS[0])]))["b"]
            snapshot = scheduler.snapshot()
    assert isinstance(outcome.end, Finished) and len(outcome.token_ids) == GREEDY.max_tokens
    (loaded,) = [entry for entry in logs if entry["event"] == "engine_loaded"]
    assert (loaded["weights_dtype"], loaded["weight_format"]) == (stored, runs)
    assert (snapshot.weights_dtype, snapshot.weight_format) == (stored, runs)


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
async def test_a_16_bit_kv_cache_holds_twice_the_blocks_serves_and_reports_its_dtype(make_package, kv_cache_dtype):
    package = make_package()
    budget = 1 << 20
    blocks = {}
    for dtype in ("float32", kv_cache_dtype):
        with structlog.testing.capture_logs() as logs:
            async with running(package, kv_cache_memory=budget, kv_cache_dtype=dtype) as scheduler:
                outcome = (await generate_all(scheduler, [request(scheduler, "k", PROMPTS[1])]))["k"]
                snapshot = scheduler.snapshot()
        assert isinstance(outcome.end, Finished) and len(outcome.token_ids) == GREEDY.max_tokens
        (loaded,) = [entry for entry in logs if entry["event"] == "engine_loaded"]
        assert loaded["kv_cache_dtype"] == snapshot.kv_cache_dtype == dtype
        blocks[dtype] = snapshot.kv_blocks_total
    assert blocks[kv_cache_dtype] == 2 * blocks["float32"]


async def test_a_weight_format_this_cpu_cannot_run_is_refused_at_load_naming_it(make_package, monkeypatch):
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    package = make_package(serving={"dtype": "float16"})
    with pytest.raises(precision.WeightFormatError, match="weight format bfloat16 needs a CPU that multiplies bfloat16"):
        Scheduler.from_package(open_package(package), SchedulerOptions(weight_format="bfloat16"))


@pytest.mark.skipif(not precision.cpu_has_float16_gemm(), reason="float16 GEMMs do not run vectorised on this CPU")
async def test_float16_gemms_give_the_greedy_answers_of_float32_on_weights_float16_holds(make_package):
    # The same float16 weights multiplied in float16 (float32 accumulation) and in float32:
    # only summation order differs, which the greedy choices of a random model do not feel.
    package = make_package(serving={"dtype": "float16"})
    answers = {}
    for weight_format in ("float32", "float16"):
        async with running(package, weight_format=weight_format, draft_tokens=0) as scheduler:
            outcomes = await generate_all(scheduler, [request(scheduler, f"r{i}", p) for i, p in enumerate(PROMPTS)])
        answers[weight_format] = {rid: o.token_ids for rid, o in outcomes.items()}
    assert answers["float16"] == answers["float32"]


@pytest.mark.parametrize(
    "weight_format",
    [
        "float32",
        pytest.param(
            "float16",
            marks=pytest.mark.skipif(not precision.cpu_has_float16_gemm(), reason="float16 GEMMs do not run vectorised here"),
        ),
    ],
)
async def test_seeded_sampling_gives_the_same_tokens_alone_and_in_a_batch(make_package, weight_format):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=10)
    package = make_package(serving={"dtype": "float16"})
    async with running(package, weight_format=weight_format) as scheduler:
        alone = (await generate_all(scheduler, [request(scheduler, "s", PROMPTS[1], seeded)]))["s"]
        others = [request(scheduler, f"o{i}", p, SamplingParams(temperature=1.0, max_tokens=10)) for i, p in enumerate(PROMPTS)]
        batch = await generate_all(scheduler, [*others, request(scheduler, "s", PROMPTS[1], seeded)])
    assert batch["s"].token_ids == alone.token_ids


async def test_stop_string_ends_the_request_and_is_not_emitted(tiny_package):
    async with running(tiny_package, draft_tokens=0) as scheduler:
        free = (await generate_all(scheduler, [request(scheduler, "free", PROMPTS[2])]))["free"]
        assert len(free.text) > 4
        stop = free.text[len(free.text) // 2 :][:3]
        cut = free.text.index(stop)
        params = SamplingParams(temperature=0.0, max_tokens=12, stop=(stop,))
        stopped = (await generate_all(scheduler, [request(scheduler, "stopped", PROMPTS[2], params)]))["stopped"]
    assert isinstance(stopped.end, Finished) and stopped.end.reason == "stop"
    assert stopped.text == free.text[:cut]


async def test_cancelling_a_running_request_ends_it_and_frees_its_blocks(tiny_package):
    async with running(tiny_package) as scheduler:
        long = SamplingParams(temperature=0.0, max_tokens=400)
        victim = scheduler.submit(request(scheduler, "victim", PROMPTS[0], long))
        bystander = scheduler.submit(request(scheduler, "bystander", PROMPTS[1]))
        first = await victim.__anext__()
        assert isinstance(first, TextDelta)
        assert scheduler.cancel("victim")
        outcome = await collect(victim)
        other = await collect(bystander)
        await wait_idle(scheduler)
        assert scheduler.snapshot().kv_blocks_used == 0
    assert isinstance(outcome.end, Failed) and outcome.end.failure.code == "cancelled"
    assert isinstance(other.end, Finished)
    assert not scheduler.cancel("victim")  # idempotent: already gone


async def test_kv_exhaustion_preempts_and_recomputes_with_unchanged_output(tiny_package):
    params = SamplingParams(temperature=0.0, max_tokens=40)
    async with running(tiny_package, draft_tokens=0) as roomy:
        expected = await generate_all(roomy, [request(roomy, f"r{i}", p, params) for i, p in enumerate(PROMPTS)])
    # 12 blocks of 16 tokens cannot hold four sequences of ~60 tokens at once.
    async with running(tiny_package, draft_tokens=0, kv_cache_memory=12 * _block_bytes(tiny_package)) as tight:
        got = await generate_all(tight, [request(tight, f"r{i}", p, params) for i, p in enumerate(PROMPTS)])
        assert tight.snapshot().kv_blocks_used == 0
    for rid, outcome in expected.items():
        assert got[rid].token_ids == outcome.token_ids


@pytest.mark.parametrize("status", [s for s in DeviceStatus if s is not DeviceStatus.OK])
async def test_a_device_status_fails_only_its_own_request(tiny_package, status):
    async with running(tiny_package, fault_injection=True, on_invalid_speculation="fail") as scheduler:
        expected = await generate_all(scheduler, [request(scheduler, f"r{i}", p) for i, p in enumerate(PROMPTS)])
        faulty = request(scheduler, "faulty", PROMPTS[0], fault=FaultSpec(status, round=2))
        got = await generate_all(scheduler, [faulty, *(request(scheduler, f"r{i}", p) for i, p in enumerate(PROMPTS))])
        await wait_idle(scheduler)
        assert scheduler.snapshot().kv_blocks_used == 0
    end = got["faulty"].end
    assert isinstance(end, Failed)
    assert end.failure.status is status and end.failure.code == status.name and end.failure.round is not None
    assert end.failure.http_status in (422, 502)
    for rid, outcome in expected.items():
        assert got[rid].token_ids == outcome.token_ids


@pytest.mark.parametrize("status", [DeviceStatus.INVALID_DRAFT_TOKEN, DeviceStatus.INVALID_DRAFT_PROBABILITY])
async def test_a_draft_fault_in_a_round_without_drafts_fails_nothing(tiny_package, status):
    # Round 0 samples right after the prompt, with no drafts: the status cannot arise there.
    async with running(tiny_package, fault_injection=True) as scheduler:
        expected = await generate_all(scheduler, [request(scheduler, f"r{i}", p) for i, p in enumerate(PROMPTS)])
        faulty = request(scheduler, "faulty", PROMPTS[0], fault=FaultSpec(status, round=0))
        got = await generate_all(scheduler, [faulty, *(request(scheduler, f"r{i}", p) for i, p in enumerate(PROMPTS))])
    assert isinstance(got["faulty"].end, Finished)
    for rid, outcome in expected.items():
        assert got[rid].token_ids == outcome.token_ids


async def test_invalid_speculation_falls_back_and_the_request_completes(tiny_package):
    async with running(tiny_package, fault_injection=True) as scheduler:
        clean = (await generate_all(scheduler, [request(scheduler, "clean", PROMPTS[3])]))["clean"]
        fault = FaultSpec(DeviceStatus.INVALID_SPECULATION, round=1)
        fell = (await generate_all(scheduler, [request(scheduler, "fell", PROMPTS[3], fault=fault)]))["fell"]
    assert isinstance(fell.end, Finished) and fell.end.fell_back
    assert fell.token_ids == clean.token_ids  # greedy: the fallback sampler picks the same tokens


async def test_fault_header_is_ignored_without_fault_injection(tiny_package):
    async with running(tiny_package) as scheduler:
        fault = FaultSpec(DeviceStatus.NONFINITE_LOGITS)
        outcome = (await generate_all(scheduler, [request(scheduler, "r", PROMPTS[0], fault=fault)]))["r"]
    assert isinstance(outcome.end, Finished)


async def test_admission_refuses_what_cannot_be_queued_or_served(tiny_package):
    async with running(tiny_package, max_concurrency=1, max_waiting=1) as scheduler:
        too_long = GenerationRequest("long", tuple([5] * scheduler.max_context), GREEDY)
        with pytest.raises(PromptTooLong):
            scheduler.submit(too_long)
        slow = SamplingParams(temperature=0.0, max_tokens=200)
        streams = [scheduler.submit(request(scheduler, "a", PROMPTS[0], slow))]
        while scheduler.snapshot().running == 0:  # let the loop admit the first one
            await asyncio.sleep(0.01)
        streams.append(scheduler.submit(request(scheduler, "b", PROMPTS[1], slow)))
        with pytest.raises(QueueFull) as full:
            for i in range(3):
                streams.append(scheduler.submit(request(scheduler, f"c{i}", PROMPTS[2], slow)))
        assert full.value.retry_after_s >= 1
        scheduler.drain()
        with pytest.raises(Draining):
            scheduler.submit(request(scheduler, "d", PROMPTS[0]))
        for s in streams:
            scheduler.cancel(s.request_id)


def _block_bytes(package_path) -> int:
    from flare.engine.kv_cache import bytes_per_block
    import torch

    return bytes_per_block(open_package(package_path).manifest.model, 16, torch.float32)


async def test_a_request_is_served_while_slots_are_free_even_with_no_waiting_room(tiny_package):
    async with running(tiny_package, max_concurrency=2, max_waiting=0) as scheduler:
        outcomes = await generate_all(scheduler, [request(scheduler, "a", PROMPTS[0]), request(scheduler, "b", PROMPTS[1])])
        with pytest.raises(QueueFull):
            slow = SamplingParams(temperature=0.0, max_tokens=200)
            for i in range(3):  # two take the free slots, the third has nowhere to wait
                scheduler.submit(request(scheduler, f"c{i}", PROMPTS[2], slow))
    assert all(isinstance(o.end, Finished) for o in outcomes.values())
