"""The one thread that runs a scheduler's torch work: loading the weights, then every round.

torch's CPU operators run their parallel regions on an OpenMP team that belongs to the thread
that calls them, and libgomp keeps a thread's team until that thread ends. Once two threads
hold teams, libgomp sees more of its threads than CPUs and throttles how long all of them spin
between regions, so every region of a round pays a futex wake-up (a one-row round was half as
slow again with the weights loaded on the main thread: docs/benchmarks.md, "One stream: where a
round goes"). So the weights load on the thread that then runs the rounds, and every round runs on it for
the scheduler's life: torch keeps native state per calling thread (an OpenMP team, MKL/oneDNN
buffers) that is not given back when the thread ends, and rounds on anyio's pooled threads, which
retire when idle and are replaced, grew resident memory with every request
(tests/reliability/test_disconnects.py).

The thread is a daemon thread, so a process stopped while it loads weights exits at once rather
than after the load; an idle one is ended before the interpreter finalizes (`shutdown`, or at
exit), because a thread that had run torch's operators and was still alive then made the
process abort as it exited (`terminate called without an active exception`, rc 134).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

# How long exit waits for a thread that is still working (loading weights): not for the load.
EXIT_WAIT_S = 1.0

# How long the event loop sleeps, the GIL released, after handing the thread a round
# (`submit_round`). A round begins with Python (the batch's tensors, the embedding) before its
# kernels release the GIL, and the loop's next work is the streams' HTTP writes: without the
# pause the loop held the GIL through them and the round started late (docs/benchmarks.md, "One
# stream: where a round goes"). The writes then overlap the layers, which run without the GIL;
# against a round of many rows the pause is noise.
ROUND_HEAD_START_S = 0.0002


class ModelThread:
    """A single daemon worker thread with a queue of jobs, run in order."""

    def __init__(self, name: str = "flare-model") -> None:
        self._jobs: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...]] | None]
        self._jobs = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()
        atexit.register(self._end_at_exit)

    def submit(self, work: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Queue `work(*args)`; its result or exception arrives through the future."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((future, work, args))
        return future

    def submit_round(self, work: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """`submit`, then sleep ROUND_HEAD_START_S with the GIL released (from the event loop:
        the round's Python prologue goes before the loop's next work)."""
        future = self.submit(work, *args)
        time.sleep(ROUND_HEAD_START_S)
        return future

    def run(self, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)` on the thread, waiting for it."""
        return self.submit(work, *args).result()

    def shutdown(self, *, wait: bool = False) -> None:
        """The thread ends after the jobs queued so far; `wait`: return once it has."""
        self._jobs.put(None)
        if wait:
            self._thread.join()

    def _end_at_exit(self) -> None:
        self._jobs.put(None)
        self._thread.join(EXIT_WAIT_S)

    def _serve(self) -> None:
        try:
            while (job := self._jobs.get()) is not None:
                future, work, args = job
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    future.set_result(work(*args))
                except BaseException as error:  # handed to the caller, who re-raises it
                    future.set_exception(error)
        finally:
            atexit.unregister(self._end_at_exit)
