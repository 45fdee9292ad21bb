"""The scheduler's decisions held equal to a recording: every round's plan (rows in order, the
blocks they write, the copies before the forward, drafts and head steps) and every choice's
output, for seeded workloads that exercise `n` > 1, a shared prefix, n-gram drafts, a draft head
beside them (`auto`) and preemption in a small KV pool.

The recording (`round_plans.json`) holds what the scheduler planned when it was last recorded
(after an intended change of plans, with the outputs unchanged wherever the change keeps them:
n-gram lookup's copy cursor changed the drafts, not a token of the answers); a change of what it
plans shows here as the first round and field that differ. Draft lengths are fixed (draft_length="fixed"):
the adaptive length chooses from measured round times, which differ from run to run.

To record again after an intended change of behaviour:
`FLARE_RECORD_ROUND_PLANS=1 python -m pytest tests/scheduler/test_round_plans_recorded.py`.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch
from tests.mtp_heads import repeat_head_state, write_head_package

from flare.engine.kv_cache import bytes_per_block
from flare.package.directory import open_package
from flare.policy.params import SamplingParams
from flare.scheduler.round.plan import PlannedRow, RoundPlan
from flare.scheduler.request import Finished, GenerationRequest, TextDelta
from flare.scheduler.scheduler import Scheduler, SchedulerOptions

RECORDING = Path(__file__).with_name("round_plans.json")
RECORD = os.environ.get("FLARE_RECORD_ROUND_PLANS") == "1"

SYSTEM = "You are a careful assistant. Answer briefly and cite nothing you cannot check. " * 2
KV_BLOCKS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=40)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, seed=7)
# Two waves: the second shares the first's preamble through the prefix cache.
FIRST_WAVE = [
    ("a", SYSTEM + "one two three four one two three four one two", GREEDY, 1),
    ("b", "The quick brown fox jumps over the lazy dog. The quick brown fox", SAMPLED, 3),
    ("c", "a b c d e f g a b c d e f g a b c", GREEDY, 1),
    ("d", "Hello, world! Hello, world! Hello, world!", SamplingParams(temperature=0.7, max_tokens=10, seed=11), 2),
]
SECOND_WAVE = [
    ("e", SYSTEM + "Question: name a colour.", GREEDY, 2),
    ("f", SYSTEM + "one two three four one two three four one two", GREEDY, 1),
]


def plan_record(plan: RoundPlan) -> dict[str, Any]:
    return {"index": plan.index, "copies": [list(copy) for copy in plan.copies], "rows": [row_record(row) for row in plan.rows]}


def row_record(row: PlannedRow) -> dict[str, Any]:
    """The row as the recording holds it: a part a row does not have reads as its zero values
    (the recording was made when every row carried every field)."""
    sampling, head = row.sampling, row.draft_head
    return {
        "request": row.request_id,
        "choice": row.choice,
        "tokens": list(row.token_ids),
        "start": row.start_position,
        "blocks": list(row.block_table),
        "samples": sampling is not None,
        "drafts": list(row.drafts.token_ids) if row.drafts is not None else [],
        "output_position": sampling.output_position if sampling is not None else 0,
        "vocabulary_parallel": sampling.vocabulary_parallel if sampling is not None else False,
        "head_steps": head.steps if head is not None else 0,
        "head_from": head.first_slot if head is not None else 0,
        "head_tokens": list(head.tokens) if head is not None else [],
    }


async def record_workload(package_path: Path, options: SchedulerOptions) -> dict[str, Any]:
    """Run both waves and return every round's plan, each choice's tokens and end, and the
    preemptions logged."""
    scheduler = Scheduler.from_package(open_package(package_path), options)
    plans: list[dict[str, Any]] = []
    execute = scheduler.runner.execute

    def spy(plan: RoundPlan):
        plans.append(plan_record(plan))
        return execute(plan)

    scheduler.runner.execute = spy
    outputs: dict[str, dict[str, Any]] = {}

    async def collect(stream, rid: str) -> None:
        async for event in stream:
            if isinstance(event, TextDelta):
                outputs.setdefault(f"{rid}/{event.index}", {"tokens": []})["tokens"].extend(event.token_ids)
            elif isinstance(event, Finished):
                outputs.setdefault(f"{rid}/{event.index}", {"tokens": []})["end"] = event.reason
            else:
                outputs[rid] = {"failed": event.failure.code}

    async def wave(requests) -> None:
        # Submitted together before the loop runs a round: the first round sees them all.
        streams = [
            (rid, scheduler.submit(GenerationRequest(rid, tuple(scheduler.tokenizer.encode(text)), params, n=n)))
            for rid, text, params, n in requests
        ]
        await asyncio.gather(*(collect(stream, rid) for rid, stream in streams))

    loop = asyncio.create_task(scheduler.run())
    with structlog.testing.capture_logs() as logs:
        try:
            await wave(FIRST_WAVE)
            await wave(SECOND_WAVE)
        finally:
            scheduler.stop()
            await loop
    preemptions = sum(1 for entry in logs if entry["event"] == "request_preempted")
    # Every block goes back to the pool (or the prefix cache) once the requests have ended.
    assert scheduler.snapshot().kv_blocks_used == 0
    return {"plans": plans, "outputs": dict(sorted(outputs.items())), "preemptions": preemptions}


@pytest.fixture(scope="module")
def head_package(make_package, package_parts):
    state = dict(package_parts["state_dict"])
    # Peaked logits make the tiny model repeat itself, so that drafts are accepted at times.
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"] * 5.0
    vocab = torch.arange(0, package_parts["config"].vocab_size, 3)
    head_state = repeat_head_state(package_parts["config"], state, vocab, mix=0.5, seed=2)
    return write_head_package(make_package, package_parts, head_state, draft_tokens=3, state_dict=state)


def check_against_recording(name: str, got: dict[str, Any]) -> None:
    recorded = json.loads(RECORDING.read_text()) if RECORDING.exists() else {}
    if RECORD:
        recorded[name] = got
        RECORDING.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
        return
    want = recorded[name]
    assert got["outputs"] == want["outputs"]
    assert len(got["plans"]) == len(want["plans"])
    for got_plan, want_plan in zip(got["plans"], want["plans"]):
        assert got_plan == want_plan, f"round {want_plan['index']} differs"
    assert got["preemptions"] == want["preemptions"]


async def test_ngram_rounds_with_choices_a_shared_prefix_and_preemption_plan_as_recorded(tiny_package, package_parts):
    # Too few blocks for the first wave at once: the newest sequences are preempted.
    pool = KV_BLOCKS * bytes_per_block(package_parts["config"], 16, torch.float32)
    options = SchedulerOptions(max_concurrency=6, kv_cache_memory=pool, draft_length="fixed")
    got = await record_workload(tiny_package, options)
    assert got["preemptions"] > 0
    assert any(row["drafts"] for plan in got["plans"] for row in plan["rows"])
    assert any(plan["copies"] for plan in got["plans"])
    check_against_recording("ngram", got)


async def test_rounds_with_a_draft_head_beside_ngram_lookup_plan_as_recorded(head_package):
    options = SchedulerOptions(max_concurrency=6, drafter="auto", draft_length="fixed")
    got = await record_workload(head_package, options)
    assert any(row["head_steps"] for plan in got["plans"] for row in plan["rows"])
    check_against_recording("auto", got)
