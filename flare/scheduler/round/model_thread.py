"""The one thread that runs a scheduler's torch work: loading the weights, then every round.

torch's CPU operators run their parallel regions on an OpenMP team that belongs to the thread
that calls them, and libgomp keeps a thread's team until that thread ends. Once two threads
hold teams, libgomp sees more of its threads than CPUs and throttles how long all of them spin
between regions, so every region of a round pays a futex wake-up. Measured on 2 cores of an AMD
EPYC (Zen 5, `avx2 avx512f avx512_bf16 f16c fma`, 2 threads), `ModelRunner.execute` of one
decode row of the default model at context 150 on a worker thread, medians of 35 rounds: 7.3 ms
when the weights had been loaded on that worker, 11.2 ms when they had been loaded on the main
thread, which kept its team (an event-loop thread lives as long as the process).
So the weights load on the thread that then runs the rounds, and every round runs on it for
the scheduler's life: torch keeps native state per calling thread (an OpenMP team, MKL/oneDNN
buffers) that is not given back when the thread ends, and rounds on anyio's pooled threads, which
retire after 10 s idle and are replaced, grew resident memory by ~0.4 MiB per request
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
# pause the loop held the GIL through them and the round started 0.35-0.6 ms after it was queued,
# against 0.06 ms with it (medians at one stream of greedy chat, 2 cores of an AMD EPYC). The
# writes then overlap the layers, which run without the GIL. At 32 rows a round takes tens of
# milliseconds: the pause is noise there.
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
