"""`flare run --tensor-parallel 2` on the tiny package: it serves the TP 1 answer, on one host or
two; it lives idle past its collective timeout with every socket on loopback; a worker killed
mid-stream ends the stream with engine_dead, and one killed while idle stops /health answering
200; either way the daemon exits non-zero with no process of the group left."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from tests.integration.daemon_process import DaemonProcess
from tests.integration.test_operations import NotifyListener
from tests.parallel.listening import listening_addresses


def _alive(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "State:\tZ" not in status.read_text()


def _completion(daemon: DaemonProcess, max_tokens: int) -> dict:
    body = {"model": daemon.model_name(), "prompt": "Hello there", "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{daemon.base_url}/v1/completions", json=body, timeout=120).json()


@pytest.fixture(scope="module")
def tp1_answer(tiny_daemon: DaemonProcess) -> str:
    """The tiny package's greedy answer from a daemon at tensor parallel 1 (both TP 2 layouts must give it)."""
    return _completion(tiny_daemon, 12)["choices"][0]["text"]


def test_tp2_serves_the_tp1_answer_and_a_killed_worker_stops_the_daemon_non_zero(tiny_package: Path, tp1_answer: str) -> None:
    daemon = DaemonProcess(tiny_package, "--tensor-parallel", "2")
    try:
        daemon.wait_ready()
        assert _completion(daemon, 12)["choices"][0]["text"] == tp1_answer
        (group,) = daemon.events("tensor_parallel_group")
        worker_pid = next(pid for rank, pid, _ in group["ranks"] if rank == 1)
        # End of text banned, so the stream is still going when the worker dies.
        body = {"model": daemon.model_name(), "prompt": "Hello there", "max_tokens": 400, "temperature": 0,
                "stream": True, "logit_bias": {"2": -100}}
        chunks = []
        with httpx.stream("POST", f"{daemon.base_url}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                chunks.append(line[6:])
                if len(chunks) == 2:
                    os.kill(worker_pid, signal.SIGKILL)
        errors = [json.loads(c) for c in chunks if c != "[DONE]" and "error" in json.loads(c)]
        assert errors and errors[-1]["error"]["code"] == "engine_dead", chunks[-3:]
        started = time.monotonic()
        assert daemon.process.wait(60) != 0
        assert time.monotonic() - started < 60
        assert not _alive(worker_pid)
        assert daemon.events("engine_dead")
        (lost,) = daemon.events("tensor_parallel_rank_lost")
        assert (lost["rank"], lost["pid"]) == (1, worker_pid)
        assert "Traceback" not in daemon.log(10_000), "a worker's death is one line, not a traceback"
    finally:
        daemon.stop()


def test_two_nodes_on_loopback_serve_the_tp1_answer_and_the_headless_node_stops_with_the_daemon(
    tiny_package: Path, tp1_answer: str
) -> None:
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    headless = subprocess.Popen(
        [sys.executable, "-m", "flare.cli.main", "run", str(tiny_package), "--tensor-parallel", "2",
         "--nnodes", "2", "--node-rank", "1", "--master-port", port, "--log-format", "json"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    daemon = DaemonProcess(tiny_package, "--tensor-parallel", "2", "--nnodes", "2", "--master-port", port)
    try:
        daemon.wait_ready()
        assert _completion(daemon, 12)["choices"][0]["text"] == tp1_answer
        assert daemon.stop() == 0
        assert headless.wait(60) == 0, f"the headless host's rank was stopped in order: {headless.stdout.read()[-3000:]}"
    finally:
        headless.kill()
        daemon.kill()


def _notified(tiny_package: Path, *flags: str) -> tuple[DaemonProcess, NotifyListener, Path]:
    """The daemon at TP 2 with a notify socket and a 2 s watchdog, as systemd would run it."""
    # AF_UNIX paths are limited to 108 bytes: a short directory rather than pytest's tmp_path.
    workdir = Path(tempfile.mkdtemp(prefix="flare-tp-", dir="/tmp"))
    notify = NotifyListener(workdir / "notify.sock")
    daemon = DaemonProcess(
        tiny_package, "--tensor-parallel", "2", *flags, env={"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "2000000"}
    )
    return daemon, notify, workdir


def test_an_idle_tp2_daemon_outlives_its_collective_timeout_on_loopback_and_a_rank_lost_while_idle_stops_it_non_zero(
    tiny_package: Path,
) -> None:
    """Idle past its collective timeout, with every socket on loopback, the daemon still serves;
    then a rank lost while idle stops /health answering 200 and the watchdog, and the daemon
    exits non-zero."""
    collective_timeout_s = 2
    daemon, notify, workdir = _notified(tiny_package, "--collective-timeout-s", str(collective_timeout_s))
    try:
        ready = notify.wait_for("READY=1")
        daemon.wait_ready()
        (group,) = daemon.events("tensor_parallel_group")
        pids = [pid for _, pid, _ in group["ranks"]]
        listening = listening_addresses(pids)
        assert listening and {address for address, _ in listening} == {"127.0.0.1"}, listening
        time.sleep(3 * collective_timeout_s)  # no traffic
        assert daemon.process.poll() is None and all(_alive(pid) for pid in pids), daemon.log()
        assert daemon.health() == 200
        answer = _completion(daemon, 4)
        assert answer["choices"][0]["finish_reason"] in ("length", "stop"), answer
        assert not daemon.events("engine_dead")
        notify.wait_for("WATCHDOG=1", after=ready, timeout_s=30)
        scraped = httpx.get(f"{daemon.base_url}/metrics", timeout=30).text
        assert 'flare_tensor_parallel_rank_cpu_seconds_total{rank="1"}' in scraped
        worker_pid = next(pid for rank, pid, _ in group["ranks"] if rank == 1)
        os.kill(worker_pid, signal.SIGKILL)
        # No request runs: the loop notices the lost rank between rounds (within its idle tick).
        deadline = time.monotonic() + 30
        while daemon.health() == 200:
            assert time.monotonic() < deadline, "/health still answers 200 with a rank lost"
            time.sleep(0.05)
        stopped_at = len(notify.messages)
        codes = []
        while daemon.process.poll() is None and time.monotonic() < deadline:
            codes.append(daemon.health())
            time.sleep(0.05)
        assert 200 not in codes
        assert daemon.process.wait(30) != 0
        # A ping already on its way when /health turned may land; none is sent after it.
        later = [m for m in notify.messages[stopped_at + 1 :] if "WATCHDOG=1" in m]
        assert not later, notify.messages[stopped_at:]
        assert not _alive(worker_pid)
        assert any("rank 1" in json.dumps(e) for e in daemon.events("stopped")), daemon.log()
    finally:
        daemon.kill()
        notify.close()
        shutil.rmtree(workdir)


def test_a_worker_that_fails_to_start_makes_the_daemon_exit_non_zero_before_ready_naming_the_rank(tiny_package: Path) -> None:
    # Rank 1 bound to a CPU this machine does not have: its pin fails before it loads.
    daemon, notify, workdir = _notified(tiny_package, "--tensor-parallel-cpus", "0|4095")
    try:
        assert daemon.process.wait(120) != 0
        daemon.stop()
        assert not any("READY=1" in m for m in notify.messages), notify.messages
        assert "tensor-parallel rank 1 failed to start" in daemon.log(200), daemon.log()
    finally:
        daemon.kill()
        notify.close()
        shutil.rmtree(workdir)
