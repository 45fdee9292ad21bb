"""Starting, watching and stopping the worker ranks of a tensor-parallel group.

Rank 0 (the daemon) creates the rendezvous store, starts this host's other ranks with
torch.multiprocessing's ``spawn`` context (a fresh interpreter: no forked torch threads or
locks), and waits for each to report that its shard loaded before anyone joins the process
groups. A worker that fails to load reports its rank and error, and startup fails with both,
before the daemon announces READY; a worker that dies before reporting is named with its exit
code. Loading happens before the rendezvous so that a failed load is never a collective hung
until its timeout.

Each worker holds one end of a pipe to its launcher and watches it on a thread: end of file
means the launcher died (however: SIGKILL included), and the worker exits at once, even from
inside a collective. A worker waits for its next command without a deadline (an idle daemon
sends nothing); liveness is checked apart from the work, over the same pipe: the launcher pings
every ``liveness_timeout / 3`` and the worker's thread answers. The launcher fails the group
(failstop.py) when a worker exits (at once, by its process sentinel) or has not answered for
``liveness_timeout`` (a stopped or frozen process). Nothing else is shared between the
processes: no shared memory, and the sockets (store, gloo pairs) close with the processes.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import structlog
import torch
import torch.multiprocessing

from flare.parallel.failstop import FailStop
from flare.parallel.group import ProcessGroups, join_groups, rendezvous_listener, rendezvous_store, stop_listening
from flare.parallel.layout import ParallelLayout
from flare.parallel.threads import RankThreads, available_cpus, pin, split_cpus

log = structlog.get_logger("flare.parallel")

STOP_GRACE_S = 10.0
"""How long a stopped worker may take to exit before it is killed."""
LIVENESS_TIMEOUT = timedelta(seconds=15)
"""A worker that answers no liveness ping for this long is lost (its pings go every third of it)."""
PING = b"ping"
FAILED = b"failed:"
"""A serving worker's last words on its pipe, before it exits: its error, for the launcher's log."""


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker rank runs: module-level functions (they are pickled into the new process).

    ``load(rank, world_size)`` builds the rank's state (its shard) before the rendezvous;
    ``serve(groups, state)`` then runs until rank 0 stops the group."""

    load: Callable[[int, int], Any]
    serve: Callable[[ProcessGroups, Any], None]


@dataclass(frozen=True)
class RankInfo:
    """One rank as `flare ctl status` shows it."""

    rank: int
    pid: int
    cpus: tuple[int, ...]


class WorkerStartError(RuntimeError):
    """A worker rank did not load: startup fails naming it."""

    def __init__(self, rank: int, error: str) -> None:
        super().__init__(f"tensor-parallel rank {rank} failed to start: {error}")
        self.rank = rank
        self.error = error


@dataclass
class _Worker:
    rank: int
    process: multiprocessing.process.BaseProcess
    connection: multiprocessing.connection.Connection
    threads: RankThreads


class RankGroup:
    """This host's side of the group: the workers it started and, on rank 0, its own groups."""

    def __init__(
        self,
        layout: ParallelLayout,
        spec: WorkerSpec,
        device: torch.device,
        startup_timeout: timedelta,
        collective_timeout: timedelta,
        bind: str | None = None,
        liveness_timeout: timedelta = LIVENESS_TIMEOUT,
    ) -> None:
        """Start this host's workers (they begin loading at once); ``connect`` finishes startup.
        On rank 0's host this process is rank 0 and creates the store."""
        self.layout = layout
        self.device = device
        self.startup_timeout = startup_timeout
        self.collective_timeout = collective_timeout
        self.liveness_timeout = liveness_timeout
        self.failstop = FailStop()
        self.groups: ProcessGroups | None = None
        self._workers: list[_Worker] = []
        self._stopping = False
        self._wake_read, self._wake_write = os.pipe()
        self._watcher: threading.Thread | None = None
        plan = split_cpus(layout.local_ranks, available_cpus(), bind)
        self.own_threads = plan[0] if layout.node_rank == 0 else None
        self._store = None
        self._listener = None
        port = layout.master_port
        if layout.node_rank == 0:
            self._listener = rendezvous_listener(layout.master_addr, port)
            self._store = rendezvous_store(
                0, layout.tensor_parallel, layout.master_addr, port, startup_timeout, self._listener
            )
            port = self._store.port
        self.master_port = port
        context = torch.multiprocessing.get_context("spawn")
        try:
            for threads in plan:
                if threads.rank == 0:
                    continue
                parent_end, child_end = context.Pipe(duplex=True)
                process = context.Process(
                    target=_worker_main,
                    args=(threads, layout, port, spec, child_end, str(device), startup_timeout, collective_timeout),
                    name=f"flare-rank-{threads.rank}",
                )
                process.start()
                child_end.close()
                self._workers.append(_Worker(threads.rank, process, parent_end, threads))
        except BaseException:
            self.stop()
            raise

    @property
    def ranks(self) -> list[RankInfo]:
        """This host's ranks, with their PIDs and CPUs."""
        own = [RankInfo(0, os.getpid(), self.own_threads.cpus)] if self.own_threads is not None else []
        return own + [RankInfo(w.rank, w.process.pid or 0, w.threads.cpus) for w in self._workers]

    def pin_own(self) -> None:
        """Pin the calling thread (rank 0's: the daemon's model thread) to rank 0's CPU list, as
        the workers pin themselves; sched_setaffinity binds one thread, so the daemon's event
        loop stays unpinned, and the OpenMP threads the caller starts inherit the list."""
        if self.own_threads is not None:
            pin(self.own_threads)

    def connect(self) -> ProcessGroups | None:
        """Wait until every local worker has loaded (WorkerStartError names the first that did
        not), then, on rank 0's host, join the groups as rank 0 and watch the workers."""
        try:
            self._await_loaded()
            if self.layout.node_rank == 0:
                assert self._store is not None
                self.groups = join_groups(
                    0, self.layout.tensor_parallel, self._store, self.device, self.collective_timeout,
                    self.layout.master_addr,
                )
                # Every rank has met: nothing connects to the store again.
                assert self._listener is not None
                stop_listening(self._listener)
                self._listener = None
        except BaseException:
            self.stop()
            raise
        self._watcher = threading.Thread(target=self._watch, name="flare-rank-watch", daemon=True)
        self._watcher.start()
        return self.groups

    def _await_loaded(self) -> None:
        pending = {w.connection: w for w in self._workers}
        sentinels = {w.process.sentinel: w for w in self._workers}
        deadline = self.startup_timeout.total_seconds()
        while pending:
            ready = multiprocessing.connection.wait(list(pending) + list(sentinels), timeout=deadline)
            if not ready:
                first = min(w.rank for w in pending.values())
                raise WorkerStartError(first, f"did not load within {deadline:g} s")
            for item in ready:
                if item in pending:
                    worker = pending[item]
                    try:
                        message = item.recv()
                    except EOFError:
                        worker.process.join(STOP_GRACE_S)
                        raise WorkerStartError(worker.rank, f"exited with code {worker.process.exitcode}") from None
                    if message[0] == "failed":
                        raise WorkerStartError(worker.rank, message[1])
                    del pending[item]
                elif sentinels[item].connection in pending:
                    worker = sentinels[item]
                    raise WorkerStartError(worker.rank, f"exited with code {worker.process.exitcode} before it loaded")

    def _watch(self) -> None:
        """Fail the group when a worker exits, or answers no ping for ``liveness_timeout``, while
        it should be serving."""
        sentinels = {w.process.sentinel: w for w in self._workers}
        answers = {w.connection: w for w in self._workers}
        timeout = self.liveness_timeout.total_seconds()
        answered = {w.rank: time.monotonic() for w in self._workers}
        errors: dict[int, str] = {}
        next_ping = time.monotonic()
        while True:  # one pass at least after stop() wakes it: see below
            now = time.monotonic()
            if now >= next_ping:
                for connection in answers:
                    try:
                        connection.send_bytes(PING)
                    except OSError:
                        pass  # the worker is exiting: its sentinel says so
                next_ping = now + timeout / 3
            ready = multiprocessing.connection.wait(
                [*sentinels, *answers, self._wake_read], timeout=max(0.0, next_ping - now)
            )
            now = time.monotonic()
            for item in ready:
                if item in sentinels:
                    worker = sentinels[item]
                    worker.process.join(STOP_GRACE_S)
                    if worker.process.exitcode == 0:
                        return  # it took rank 0's stop command: the group is stopping in order
                    error = self._last_words(worker, errors)
                    self._lost(worker, f"exited with code {worker.process.exitcode}{error}")
                    return
                if item in answers:
                    try:
                        message = answers[item].connection.recv_bytes()
                    except (EOFError, OSError):
                        del answers[item]  # the worker is exiting: its sentinel says so
                        continue
                    answered[answers[item].rank] = now
                    if message.startswith(FAILED):
                        errors[answers[item].rank] = message[len(FAILED) :].decode(errors="replace")
            # A worker that died is named even when the group is stopping by then: its death
            # failed a collective, and the daemon stopped the group before this thread woke.
            # (stop() closes no pipe before this thread has returned, so none exited for it.)
            if self._stopping:
                return
            for worker in self._workers:
                if now - answered[worker.rank] > timeout:
                    self._lost(worker, f"answered no liveness check for {timeout:g} s")
                    return

    @staticmethod
    def _last_words(worker: _Worker, errors: dict[int, str]) -> str:
        """The error an exited worker sent before it exited (read now if not yet), as ": error"."""
        try:
            while worker.rank not in errors and worker.connection.poll():
                message = worker.connection.recv_bytes()
                if message.startswith(FAILED):
                    errors[worker.rank] = message[len(FAILED) :].decode(errors="replace")
        except (EOFError, OSError):
            pass
        return f": {errors[worker.rank]}" if worker.rank in errors else ""

    def _lost(self, worker: _Worker, why: str) -> None:
        """One line for the lost rank, then the group's failure. A rank that stopped answering
        is killed now: it cannot stop in order, and the group's stop would wait for it."""
        log.error("tensor_parallel_rank_lost", rank=worker.rank, pid=worker.process.pid, reason=why)
        if worker.process.is_alive():
            worker.process.kill()
        self.failstop.fail(f"rank {worker.rank} (pid {worker.process.pid}) {why}")

    def wait(self) -> int:
        """Headless hosts: block until one of this host's workers exits, stop the others, and
        return the exit status for the supervisor (non-zero: the group is lost)."""
        sentinels = {w.process.sentinel: w for w in self._workers}
        while not (ready := multiprocessing.connection.wait(list(sentinels), timeout=1.0)):
            if self.failstop.reason is not None:  # a worker answers no liveness check
                self.stop()
                return 1
        worker = sentinels[ready[0]]
        # The watcher thread may be reaping this worker right now: stop() waits for it before it
        # reaps the workers itself. Two threads reaping one process race, and the loser reads
        # no exit code (None), which an orderly stop must never turn into a failure.
        self.stop()
        return 0 if worker.process.exitcode == 0 else 1

    def stop(self) -> None:
        """Stop the workers (they see their pipe close), kill any that outlive STOP_GRACE_S, and
        leave the groups. Safe to call more than once."""
        self._stopping = True
        if self._wake_write >= 0:
            os.write(self._wake_write, b"x")
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(STOP_GRACE_S)  # before the pipes it reads close
            self._watcher = None
        for worker in self._workers:
            worker.connection.close()
        for worker in self._workers:
            worker.process.join(STOP_GRACE_S)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(STOP_GRACE_S)
        if self.groups is not None:
            self.groups.close()
            self.groups = None
        if self._listener is not None:
            stop_listening(self._listener)
            self._listener = None
        self._store = None
        if self._wake_write >= 0:
            os.close(self._wake_read)
            os.close(self._wake_write)
            self._wake_read = self._wake_write = -1


def _worker_main(
    threads: RankThreads,
    layout: ParallelLayout,
    port: int,
    spec: WorkerSpec,
    connection: multiprocessing.connection.Connection,
    device: str,
    startup_timeout: timedelta,
    collective_timeout: timedelta,
) -> None:
    """A worker rank: pin, load, report, watch the launcher, meet the others, serve. A failure
    goes to the launcher, which logs it in one line with the rank's exit (no traceback)."""
    try:
        pin(threads)
        state = spec.load(threads.rank, layout.tensor_parallel)
    except Exception as error:
        connection.send(("failed", f"{type(error).__name__}: {error}"))
        os._exit(1)
    connection.send(("loaded", os.getpid()))
    sending = threading.Lock()
    threading.Thread(
        target=_exit_with_launcher, args=(connection, sending), name="flare-launcher-watch", daemon=True
    ).start()
    try:
        store = rendezvous_store(threads.rank, layout.tensor_parallel, layout.master_addr, port, startup_timeout)
        groups = join_groups(
            threads.rank, layout.tensor_parallel, store, torch.device(device), collective_timeout, layout.master_addr
        )
        spec.serve(groups, state)
    except Exception as error:
        try:
            with sending:
                connection.send_bytes(FAILED + f"{type(error).__name__}: {error}".encode())
        except OSError:
            pass  # the launcher is gone, and with it whoever would log this
        os._exit(1)
    # The stop command came: the stop is orderly whatever leaving the groups does, and rank 0
    # (another host's, for a headless node) may already be gone with the store it listened on.
    try:
        groups.close()
    except Exception:
        pass
    os._exit(0)


def _exit_with_launcher(connection: multiprocessing.connection.Connection, sending: threading.Lock) -> None:
    """Answer the launcher's liveness pings; end of file on its pipe: the launcher stopped the
    group or died, and either way this rank has nothing left to serve."""
    try:
        while True:
            ping = connection.recv_bytes()
            with sending:
                connection.send_bytes(ping)
    except (EOFError, OSError):
        pass
    os._exit(0)
