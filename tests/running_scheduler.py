"""A scheduler over a package, its loop running, for the length of an `async with`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from flare.package.directory import open_package
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
