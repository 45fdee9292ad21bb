"""Work the daemon may leave behind at exit: a call in a daemon thread of its own.

anyio's worker threads are joined when the interpreter exits, so a call stuck in one (a chat
template that runs long inside one C call, out of reach of its render budget) would keep the
process alive after SIGTERM, until systemd's SIGKILL. A call run here is awaited like any
other, but a cancelled request stops waiting for it (its limiter slot is given back: the work
itself must be bounded, as a render is by its budget), and nothing waits for it at exit.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

import anyio

T = TypeVar("T")


async def run_abandonable(function: Callable[[], T], *, limiter: anyio.CapacityLimiter, name: str) -> T:
    """`function()` in a new daemon thread; its result, or the exception it raised."""
    async with limiter:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()

        def settle(result: T | None, error: BaseException | None) -> None:
            if done.done():
                return
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)  # type: ignore[arg-type]

        def target() -> None:
            try:
                outcome: tuple[T | None, BaseException | None] = (function(), None)
            except BaseException as error:  # delivered to the awaiting task, raised there
                outcome = (None, error)
            try:
                loop.call_soon_threadsafe(settle, *outcome)
            except RuntimeError:
                pass  # the loop has closed: the daemon is exiting and nobody waits any more

        threading.Thread(target=target, name=name, daemon=True).start()
        return await done
