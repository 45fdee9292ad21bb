"""A scheduler over a package, its loop running, for the length of an `async with`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from flare.package.directory import open_package
from flare.policy.params import SamplingParams
from flare.scheduler.request import Finished, GenerationRequest, TextDelta
from flare.scheduler.scheduler import Scheduler, SchedulerOptions


@contextlib.asynccontextmanager
async def running(package_path, **options) -> AsyncIterator[Scheduler]:
    """`Scheduler.from_package(package_path, SchedulerOptions(**options))`, run until the block ends."""
    scheduler = Scheduler.from_package(open_package(package_path), SchedulerOptions(**options))
    loop_task = asyncio.create_task(scheduler.run())
    try:
        yield scheduler
    finally:
        scheduler.stop()
        await loop_task


async def greedy_tokens(scheduler: Scheduler, request_id: str, text: str, max_tokens: int) -> list[int]:
    """The greedy answer's token ids to `text` (encoded without a template), failing on a failed request."""
    request = GenerationRequest(request_id, tuple(scheduler.tokenizer.encode(text)), SamplingParams(temperature=0.0, max_tokens=max_tokens))
    tokens: list[int] = []
    async for event in scheduler.submit(request):
        if isinstance(event, TextDelta):
            tokens += event.token_ids
        else:
            assert isinstance(event, Finished), event
    return tokens
