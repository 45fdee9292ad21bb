"""On the real default model, greedy output with speculation is token-for-token the output
without it, alone and eight at a time."""

from __future__ import annotations

import asyncio

import pytest

from flare.package.directory import open_package
from flare.policy.params import SamplingParams
from flare.scheduler.request import Finished, GenerationRequest, TextDelta
from flare.scheduler.scheduler import Scheduler, SchedulerOptions

pytestmark = pytest.mark.real_model

PASSAGE = (
    "The old harbour town woke slowly. Fishermen untied their boats, gulls circled above the market, "
    "and the baker on the corner opened his shutters to the smell of fresh bread."
)
CHATS = [
    f"Copy the following paragraph exactly:\n\n{PASSAGE}",
    f"Rewrite this text, replacing 'harbour' with 'river':\n\n{PASSAGE}",
    "What is the capital of France?",
    "List the days of the week.",
    "Write a short poem about the sea.",
    f"Quote this passage in full:\n\n{PASSAGE}",
    "Count from one to twenty in words.",
    "Explain what a verb is, with examples.",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48)


async def generate(package_path, options: SchedulerOptions, chats: list[str], concurrent: bool) -> tuple[list[list[int]], int]:
    scheduler = Scheduler.from_package(open_package(package_path), options)
    loop = asyncio.create_task(scheduler.run())

    async def one(i: int, chat: str) -> list[int]:
        prompt = tuple(scheduler.tokenizer.encode_chat([{"role": "user", "content": chat}]))
        ids: list[int] = []
        async for event in scheduler.submit(GenerationRequest(f"r{i}", prompt, GREEDY)):
            if isinstance(event, TextDelta):
                ids.extend(event.token_ids)
            else:
                assert isinstance(event, Finished), event
        return ids

    try:
        if concurrent:
            outputs = list(await asyncio.gather(*(one(i, c) for i, c in enumerate(chats))))
        else:
            outputs = [await one(i, c) for i, c in enumerate(chats)]
        row_forwards = scheduler.snapshot().device_statuses.get("OK", 0)
    finally:
        scheduler.stop()
        await loop
    return outputs, row_forwards


@pytest.mark.parametrize(("concurrent", "chats"), [(False, CHATS[:3]), (True, CHATS)], ids=["alone", "eight-at-once"])
async def test_greedy_speculation_is_token_for_token_the_plain_output(default_package, concurrent, chats):
    plain, plain_forwards = await generate(default_package, SchedulerOptions(draft_tokens=0), chats, concurrent)
    speculative, speculative_forwards = await generate(
        default_package, SchedulerOptions(draft_length="fixed"), chats, concurrent
    )
    assert speculative == plain
    # The quoting prompts accept drafts: fewer target forwards for the same tokens.
    assert speculative_forwards < plain_forwards
