"""Every device status injected into random requests of busy rounds (all slots taken, a queue
waiting): each affected request gets its structured error, every other one the exact output of a
fault-free run (greedy), and afterwards every KV block is free."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path

import httpx
from tests.reliability.reliability_daemon import Daemon, Outcome, generate, report
from tests.integration.test_daemon import FAULT_STATUSES  # the documented (HTTP status, error type) of each row status

from flare.sampler.status import DeviceStatus

TOPICS = (
    "the sea",
    "mountains",
    "bread",
    "rivers",
    "the moon",
    "cats",
    "trains",
    "winter",
    "bees",
    "clocks",
    "salt",
    "paper",
    "glass",
    "owls",
    "rain",
    "maps",
    "copper",
    "tea",
    "wolves",
    "sand",
    "ink",
    "bridges",
    "snow",
    "whales",
)
REQUESTS = 48  # 32 running (the tiny package's max_concurrency) and 16 waiting
FAULTED = 18
MAX_TOKENS = 16


def _request(index: int, daemon: Daemon) -> tuple[str, dict]:
    """The index-th request: chat or completions, streaming or not, on its own prompt."""
    topic = TOPICS[index % len(TOPICS)]
    body = {"model": daemon.model, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": index % 3 != 0}
    if index % 2:
        return "/v1/completions", {**body, "prompt": f"A few words about {topic}:"}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": f"Tell me about {topic}."}]}


async def _run(daemon: Daemon, faults: dict[int, str]) -> list[Outcome]:
    limits = httpx.Limits(max_connections=REQUESTS)
    async with httpx.AsyncClient(base_url=daemon.url, timeout=120, limits=limits) as http:
        return await asyncio.gather(
            *(
                generate(http, *_request(i, daemon), headers={"X-Flare-Fault": faults[i]} if i in faults else None)
                for i in range(REQUESTS)
            )
        )


async def test_faults_fail_only_their_requests_and_free_every_block(
    tiny_package: Path, daemon_factory: Callable[..., Daemon]
) -> None:
    daemon = daemon_factory(tiny_package, ["--fault-injection"])
    assert daemon.status()["kv_blocks_total"] > 0
    baseline = await _run(daemon, {})
    assert all(o.status == 200 and o.complete and o.finish_reason for o in baseline)

    chooser = random.Random(6)
    statuses = [s.name for s in DeviceStatus if s is not DeviceStatus.OK]
    faulted = chooser.sample(range(REQUESTS), FAULTED)
    # Every status at least twice, in rounds 0-3 of the request's own sampling.
    faults = {i: f"{statuses[n % len(statuses)]}@{chooser.randint(0, 3)}" for n, i in enumerate(faulted)}
    outcomes = await _run(daemon, faults)

    took_effect = fell_back = 0
    for i, (outcome, expected) in enumerate(zip(outcomes, baseline, strict=True)):
        name = faults.get(i, "@").split("@")[0]
        if outcome.error is not None:
            assert name and name != "INVALID_SPECULATION", (
                i,
                outcome,
                [o.error for o in outcomes if o.error],
                daemon.process.log(200),
            )
            took_effect += 1
            http_status, error_type = FAULT_STATUSES[name]
            assert (outcome.error["code"], outcome.error["type"]) == (name, error_type), outcome.error
            assert outcome.error["flare"]["status_name"] == name and outcome.error["flare"]["round"] is not None
            # Non-streaming: the documented status; streaming: 200, the error event, then [DONE].
            assert outcome.status == (200 if _request(i, daemon)[1]["stream"] else http_status)
            assert outcome.complete or not _request(i, daemon)[1]["stream"]
            continue
        # Unaffected (or a fault in a round the request never reached, or INVALID_SPECULATION
        # retried without drafts): exactly the fault-free output.
        assert outcome.status == 200 and outcome.complete, (i, outcome)
        assert (outcome.text, outcome.finish_reason) == (expected.text, expected.finish_reason), (i, faults.get(i))
        fell_back += name == "INVALID_SPECULATION"
    idle = daemon.wait_idle()
    report(
        "faults",
        requests=2 * REQUESTS,
        concurrency=32,
        faults_injected=len(faults),
        faults_took_effect=took_effect,
        invalid_speculation_fell_back=fell_back,
        unaffected_identical=REQUESTS - took_effect,
        server_errors_unexplained=0,
        leaked_blocks=idle["kv_blocks_used"],
        running=idle["running"],
    )
    assert took_effect >= FAULTED // 2
    assert idle["kv_blocks_used"] == 0 and idle["running"] == 0 and idle["waiting"] == 0
    assert daemon.serves()
