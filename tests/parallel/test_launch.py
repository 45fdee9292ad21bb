"""Starting, meeting and stopping worker ranks: two processes on the CPU, gloo."""

from __future__ import annotations

import gc
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tests import REPOSITORY
from tests.parallel.listening import listening_addresses
from tests.parallel.rank_programs import (
    load_failing_on_rank_1,
    load_rank,
    serve_all_reduce_then_wait,
    serve_failing,
    serve_idle,
    serve_messages,
    serve_messages_read_late,
)

from flare.parallel.failstop import EngineDead
from flare.parallel.launch import RankGroup, WorkerSpec, WorkerStartError
from flare.parallel.layout import ParallelLayout

STARTUP = timedelta(seconds=120)
"""Generous: two interpreters importing torch on a shared 2-core machine."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for every purpose but the process table.
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "State:\tZ" not in status.read_text()


def _wait_until(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def _shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm"))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_two_ranks_meet_all_reduce_and_stop_leaving_nothing_behind() -> None:
    shm_before = _shm_entries()
    group = RankGroup(
        ParallelLayout(tensor_parallel=2),
        WorkerSpec(load_rank, serve_all_reduce_then_wait),
        torch.device("cpu"),
        STARTUP,
        timedelta(seconds=60),
    )
    groups = group.connect()
    assert groups is not None and groups.rank == 0 and groups.world_size == 2
    value = torch.tensor([1.0])
    dist.all_reduce(value, group=groups.device)
    assert value.item() == 3.0
    ranks = group.ranks
    assert [r.rank for r in ranks] == [0, 1]
    assert ranks[0].pid == os.getpid() and ranks[1].pid != os.getpid()
    assert all(r.cpus for r in ranks)
    port = group.master_port
    worker_pid = ranks[1].pid
    group.stop()
    assert not _alive(worker_pid)
    assert group.failstop.reason is None, "an orderly stop is not a failure"
    assert not dist.is_initialized()
    del groups  # the last reference to the store (through the process group)
    gc.collect()
    with socket.socket() as probe:  # the store no longer listens
        assert probe.connect_ex(("127.0.0.1", port)) != 0
    assert _shm_entries() <= shm_before


def test_an_idle_worker_waits_for_work_past_the_collective_timeout() -> None:
    from flare.engine.batch import ForwardRow
    from flare.parallel.round_command import RoundCommand, send_command

    collective = timedelta(seconds=2)
    group = RankGroup(
        ParallelLayout(tensor_parallel=2), WorkerSpec(load_rank, serve_messages), torch.device("cpu"), STARTUP, collective
    )
    groups = group.connect()
    assert groups is not None
    worker_pid = group.ranks[1].pid
    time.sleep(3 * collective.total_seconds())  # rank 0 sends nothing: an idle daemon
    assert group.failstop.reason is None and _alive(worker_pid)
    send_command(RoundCommand(0, (ForwardRow((1,), 0, (0,), 1),), (), None), groups.control)
    value = torch.tensor([1.0])
    dist.all_reduce(value, group=groups.device)
    assert value.item() == 2.0, "the worker took the command it waited for"
    send_command(None, groups.control)
    group.stop()
    assert group.failstop.reason is None


def test_a_stopped_worker_fails_the_liveness_check_within_its_timeout() -> None:
    group = RankGroup(
        ParallelLayout(tensor_parallel=2),
        WorkerSpec(load_rank, serve_messages),
        torch.device("cpu"),
        STARTUP,
        timedelta(seconds=60),
        liveness_timeout=timedelta(seconds=1.5),
    )
    assert group.connect() is not None
    time.sleep(2)
    assert group.failstop.reason is None, "a live idle worker answers its pings"
    worker_pid = group.ranks[1].pid
    os.kill(worker_pid, signal.SIGSTOP)  # alive to its sentinel, answering nothing
    stopped = time.monotonic()
    assert _wait_until(lambda: group.failstop.reason is not None, 10)
    assert time.monotonic() - stopped < 1.5 + 1.5 / 3 + 1, "found within the timeout and one ping"
    assert group.failstop.reason == f"rank 1 (pid {worker_pid}) answered no liveness check for 1.5 s"
    assert _wait_until(lambda: not _alive(worker_pid), 2), "a rank that stopped answering is killed at once"
    group.stop()
    assert not _alive(worker_pid)


def test_a_worker_that_fails_while_serving_is_one_failure_naming_its_error(capfd: pytest.CaptureFixture[str]) -> None:
    group = RankGroup(
        ParallelLayout(tensor_parallel=2), WorkerSpec(load_rank, serve_failing), torch.device("cpu"), STARTUP,
        timedelta(seconds=60),
    )
    group.connect()
    worker_pid = group.ranks[1].pid
    assert _wait_until(lambda: group.failstop.reason is not None, 30)
    assert group.failstop.reason == (
        f"rank 1 (pid {worker_pid}) exited with code 1: RuntimeError: Connection closed by peer [127.0.0.1]:1234"
    )
    group.stop()
    assert "Traceback" not in capfd.readouterr().err, "the worker prints no traceback"


def test_the_rendezvous_listens_on_the_master_address_only_and_stops_once_the_ranks_met() -> None:
    group = RankGroup(
        ParallelLayout(tensor_parallel=2), WorkerSpec(load_rank, serve_messages), torch.device("cpu"), STARTUP,
        timedelta(seconds=60),
    )
    store = ("127.0.0.1", group.master_port)
    assert store in listening_addresses([os.getpid()]), "the store listens where the operator said"
    groups = group.connect()
    assert groups is not None
    pids = [r.pid for r in group.ranks]
    listening = listening_addresses(pids)
    assert store not in listening, "no rank connects to the store after the groups met"
    assert {address for address, _ in listening} <= {"127.0.0.1"}, listening
    group.stop()


def test_a_worker_that_fails_to_load_fails_startup_naming_its_rank_and_error() -> None:
    group = RankGroup(
        ParallelLayout(tensor_parallel=2),
        WorkerSpec(load_failing_on_rank_1, serve_idle),
        torch.device("cpu"),
        STARTUP,
        timedelta(seconds=60),
    )
    worker_pid = group.ranks[1].pid
    with pytest.raises(WorkerStartError, match="rank 1 failed to start: FileNotFoundError: shard file") as caught:
        group.connect()
    assert caught.value.rank == 1
    assert not _alive(worker_pid)
    assert not dist.is_initialized()


def test_a_killed_worker_fails_the_group_naming_the_rank_and_collectives_raise() -> None:
    group = RankGroup(
        ParallelLayout(tensor_parallel=2),
        WorkerSpec(load_rank, serve_all_reduce_then_wait),
        torch.device("cpu"),
        STARTUP,
        timedelta(seconds=5),
    )
    groups = group.connect()
    assert groups is not None
    dist.all_reduce(torch.tensor([1.0]), group=groups.device)
    reasons: list[str] = []
    group.failstop.on_fail(reasons.append)
    os.kill(group.ranks[1].pid, signal.SIGKILL)
    assert _wait_until(lambda: bool(reasons), 10), "the dead worker was not noticed"
    assert reasons == [f"rank 1 (pid {group.ranks[1].pid}) exited with code -9"]
    with pytest.raises(EngineDead, match="rank 1"):
        group.failstop.check()
    started = time.monotonic()
    with pytest.raises(RuntimeError):
        dist.all_reduce(torch.tensor([1.0]), group=groups.device)
    assert time.monotonic() - started < 10
    group.stop()


def test_a_collective_a_stuck_rank_never_joins_times_out_and_stops_the_group() -> None:
    group = RankGroup(
        ParallelLayout(tensor_parallel=2),
        WorkerSpec(load_rank, serve_idle),
        torch.device("cpu"),
        STARTUP,
        timedelta(seconds=2),
    )
    groups = group.connect()
    assert groups is not None
    started = time.monotonic()
    with pytest.raises(RuntimeError) as caught:
        dist.all_reduce(torch.tensor([1.0]), group=groups.device)
    assert time.monotonic() - started < 10
    dead = group.failstop.collective_failed(caught.value)
    assert "a collective failed" in dead.reason
    group.stop()


def test_a_stop_command_a_worker_never_reads_gives_up_after_the_stop_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    from flare.parallel import round_command

    monkeypatch.setattr(round_command, "STOP_TIMEOUT", timedelta(seconds=1))
    group = RankGroup(
        ParallelLayout(tensor_parallel=2), WorkerSpec(load_rank, serve_idle), torch.device("cpu"), STARTUP, timedelta(seconds=60)
    )
    groups = group.connect()
    assert groups is not None
    started = time.monotonic()
    with pytest.raises(RuntimeError):
        round_command.send_command(None, groups.control)
    assert time.monotonic() - started < 30, "the stop waited for the collective timeout, not the stop's"
    group.stop()


def test_a_round_past_its_deadline_stops_the_group() -> None:
    group_stop = EngineDead  # the latch alone: no processes needed
    from flare.parallel.failstop import FailStop

    latch = FailStop()
    with latch.deadline(0.2):
        time.sleep(0.6)
    with pytest.raises(group_stop, match="past its deadline of 0.2 s"):
        latch.check()
    quick = FailStop()
    with quick.deadline(5):
        pass
    quick.check()


LAUNCHER = textwrap.dedent(
    """
    import sys, time
    from datetime import timedelta
    import torch
    sys.path.insert(0, {root!r})
    from tests.parallel.rank_programs import load_rank, {serve}
    from flare.parallel.launch import RankGroup, WorkerSpec
    from flare.parallel.layout import ParallelLayout

    layout = ParallelLayout({world}, nnodes={nnodes}, node_rank={node_rank}, master_port={port})
    group = RankGroup(layout, WorkerSpec(load_rank, {serve}), torch.device("cpu"),
                      timedelta(seconds=120), timedelta(seconds={collective_s}))
    group.connect()
    print(" ".join(str(r.pid) for r in group.ranks if r.rank != 0), flush=True)
    sys.exit(group.wait() if {node_rank} else time.sleep(600))
    """
)


def _launcher(
    world: int, nnodes: int, node_rank: int, port: int, collective_s: int = 60, serve: str = "serve_all_reduce_then_wait"
) -> subprocess.Popen[str]:
    """A launching process (host ``node_rank``) whose workers run rank_programs' ``serve``."""
    script = LAUNCHER.format(
        root=REPOSITORY, world=world, nnodes=nnodes, node_rank=node_rank, port=port,
        collective_s=collective_s, serve=serve,
    )
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)


def test_workers_exit_when_the_launcher_is_killed() -> None:
    launcher = _launcher(world=2, nnodes=1, node_rank=0, port=0)
    try:
        assert launcher.stdout is not None
        worker_pids = [int(p) for p in launcher.stdout.readline().split()]
        assert len(worker_pids) == 1 and _alive(worker_pids[0])
        launcher.kill()
        launcher.wait(30)
        assert _wait_until(lambda: not any(_alive(p) for p in worker_pids), 10), "a worker outlived rank 0"
    finally:
        launcher.kill()


def test_two_nodes_on_loopback_meet_and_the_headless_node_exits_non_zero_when_rank_0_goes() -> None:
    port = _free_port()
    node_1 = _launcher(world=2, nnodes=2, node_rank=1, port=port, collective_s=5)
    try:
        group = RankGroup(
            ParallelLayout(2, nnodes=2, node_rank=0, master_port=port),
            WorkerSpec(load_rank, serve_all_reduce_then_wait),
            torch.device("cpu"),
            STARTUP,
            timedelta(seconds=30),
        )
        assert [r.rank for r in group.ranks] == [0], "host 0 runs rank 0 alone"
        groups = group.connect()
        assert groups is not None and groups.world_size == 2
        value = torch.tensor([1.0])
        dist.all_reduce(value, group=groups.device)
        assert value.item() == 3.0
        assert node_1.stdout is not None
        worker_pids = [int(p) for p in node_1.stdout.readline().split()]
        assert len(worker_pids) == 1
        group.stop()
        # Rank 1 waits for a command that never comes: its collective times out (5 s here), it
        # exits, and its host's launcher with it, non-zero.
        assert node_1.wait(60) == 1
        assert not any(_alive(p) for p in worker_pids)
    finally:
        node_1.kill()


def test_the_headless_node_exits_0_when_rank_0_stops_in_order_while_its_worker_is_slow_to_read() -> None:
    from flare.engine.batch import ForwardRow
    from flare.parallel.round_command import RoundCommand, send_command

    port = _free_port()
    node_1 = _launcher(world=2, nnodes=2, node_rank=1, port=port, serve="serve_messages_read_late")
    try:
        group = RankGroup(
            ParallelLayout(2, nnodes=2, node_rank=0, master_port=port),
            WorkerSpec(load_rank, serve_messages_read_late),
            torch.device("cpu"),
            STARTUP,
            timedelta(seconds=30),
        )
        groups = group.connect()
        assert groups is not None
        send_command(RoundCommand(0, (ForwardRow((1,), 0, (0,), 1),), (), None), groups.control)
        value = torch.tensor([1.0])
        dist.all_reduce(value, group=groups.device)
        assert value.item() == 2.0, "the worker took the command it read late"
        # The worker reads the stop SLOW_READ_S after it was sent; rank 0 then leaves the groups
        # at once, as the daemon's close does.
        send_command(None, groups.control)
        group.stop()
        assert group.failstop.reason is None
        assert node_1.wait(60) == 0, "the headless host's worker took the stop: an orderly exit"
    finally:
        node_1.kill()


def test_a_worker_killed_between_rounds_makes_the_next_round_raise_and_fails_the_group_naming_it() -> None:
    from tests.parallel.rank_programs import (
        load_tiny_tensor_parallel,
        serve_tensor_parallel_rounds,
        tensor_parallel_round,
        tiny_tensor_parallel,
    )

    from flare.engine.batch import ForwardRow
    from flare.parallel.round_command import RoundCommand, send_command

    shm_before = _shm_entries()
    group = RankGroup(
        ParallelLayout(tensor_parallel=2),
        WorkerSpec(load_tiny_tensor_parallel, serve_tensor_parallel_rounds),
        torch.device("cpu"),
        STARTUP,
        timedelta(seconds=10),
    )
    model, cache = tiny_tensor_parallel(0, 2)
    groups = group.connect()
    assert groups is not None
    command = RoundCommand(0, (ForwardRow((3, 4, 5), 0, (0, 1), 1),), (), None)
    send_command(command, groups.control)
    tensor_parallel_round(groups, model, cache, command)
    worker_pid = group.ranks[1].pid
    os.kill(worker_pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(RuntimeError):
        send_command(RoundCommand(1, (ForwardRow((6,), 3, (0, 1), 1),), (), None), groups.control)
        tensor_parallel_round(groups, model, cache, command)
    assert time.monotonic() - started < 15, "the lost rank took a collective timeout to notice"
    assert _wait_until(lambda: group.failstop.reason is not None, 10)
    assert group.failstop.reason.startswith(f"rank 1 (pid {worker_pid}) exited")
    group.stop()
    assert not _alive(worker_pid)
    assert _shm_entries() <= shm_before
