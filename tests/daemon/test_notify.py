"""sd_notify messages, read from a real datagram socket as systemd would."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from flare.daemon.notify import SystemdNotifier, WatchdogHeartbeat, publish_status


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = tmp_path / "notify.sock"
    sock.bind(str(path))
    sock.settimeout(5)
    yield sock, str(path)
    sock.close()


def received(sock: socket.socket) -> list[str]:
    return sock.recv(4096).decode().split("\n")


def test_ready_status_stopping_reach_the_socket(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    notifier = SystemdNotifier({"NOTIFY_SOCKET": path})
    assert notifier.enabled
    assert notifier.ready(status="serving smollm2")
    assert received(sock) == ["READY=1", "STATUS=serving smollm2"]
    notifier.status("2 running\n1 waiting")
    assert received(sock) == ["STATUS=2 running 1 waiting"]
    notifier.watchdog()
    assert received(sock) == ["WATCHDOG=1"]
    notifier.stopping()
    assert received(sock) == ["STOPPING=1"]
    notifier.close()


def test_reloading_carries_the_monotonic_time_systemd_253_expects(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    notifier = SystemdNotifier({"NOTIFY_SOCKET": path})
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    notifier.reloading()
    reloading, monotonic = received(sock)
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert reloading == "RELOADING=1"
    assert monotonic.startswith("MONOTONIC_USEC=")
    assert before <= int(monotonic.removeprefix("MONOTONIC_USEC=")) <= after
    notifier.close()


def test_abstract_socket_names_are_supported() -> None:
    name = f"flare-test-notify-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(5)
    try:
        notifier = SystemdNotifier({"NOTIFY_SOCKET": "@" + name})
        notifier.ready()
        assert received(sock) == ["READY=1"]
        notifier.close()
    finally:
        sock.close()


def test_without_notify_socket_every_call_is_a_no_op() -> None:
    notifier = SystemdNotifier({})
    assert not notifier.enabled
    assert not notifier.ready()
    assert not notifier.watchdog()
    assert notifier.watchdog_interval() is None


def test_a_vanished_socket_is_reported_not_raised(tmp_path: Path) -> None:
    notifier = SystemdNotifier({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})
    assert notifier.enabled
    assert not notifier.ready()


def test_unsupported_socket_family_disables_notification() -> None:
    assert not SystemdNotifier({"NOTIFY_SOCKET": "vsock:2:1234"}).enabled


def test_watchdog_interval_is_half_of_watchdog_usec(listener: tuple[socket.socket, str]) -> None:
    _, path = listener
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "30000000"}
    assert SystemdNotifier(env).watchdog_interval() == 15.0
    assert SystemdNotifier({**env, "WATCHDOG_PID": str(os.getpid())}).watchdog_interval() == 15.0


def test_watchdog_meant_for_another_process_is_ignored(listener: tuple[socket.socket, str]) -> None:
    _, path = listener
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}
    assert SystemdNotifier(env).watchdog_interval() is None
    assert SystemdNotifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "soon"}).watchdog_interval() is None


def test_heartbeat_pings_at_most_once_per_half_interval(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    now = [100.0]
    heartbeat = WatchdogHeartbeat(
        SystemdNotifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "10000000"}), clock=lambda: now[0]
    )
    assert heartbeat.interval == 5.0
    sock.setblocking(False)
    pings = 0
    for _ in range(40):  # 40 loop iterations, 0.5 s apart: 20 s of loop time
        heartbeat()
        now[0] += 0.5
        try:
            while sock.recv(64) == b"WATCHDOG=1":
                pings += 1
        except BlockingIOError:
            pass
    assert pings == 4  # at 0, 5, 10 and 15 s


def test_heartbeat_without_watchdog_sends_nothing(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    heartbeat = WatchdogHeartbeat(SystemdNotifier({"NOTIFY_SOCKET": path}))
    assert heartbeat.interval is None
    heartbeat()
    sock.setblocking(False)
    with pytest.raises(BlockingIOError):
        sock.recv(64)


async def test_status_is_published_when_the_summary_changes(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    summaries = iter(["serving p: 0 running", "serving p: 0 running", "serving p: 2 running"])
    sent: list[list[str]] = []
    notifier = SystemdNotifier({"NOTIFY_SOCKET": path})
    async with anyio.create_task_group() as tg:
        tg.start_soon(publish_status, notifier, lambda: next(summaries, "serving p: 2 running"), 0.001)
        sent.append(await anyio.to_thread.run_sync(received, sock))
        sent.append(await anyio.to_thread.run_sync(received, sock))
        tg.cancel_scope.cancel()
    assert sent == [["STATUS=serving p: 0 running"], ["STATUS=serving p: 2 running"]]
    notifier.close()


async def test_status_publisher_returns_without_a_service_manager() -> None:
    with anyio.fail_after(5):
        await publish_status(SystemdNotifier({}), lambda: "never sent", 0.001)
