"""The control socket under hostile and ill-timed commands, end to end: every answer is JSON in the
documented error shape (never a plain-text 500), every command leaves its `control.command` audit
line, and `flare ctl resume` cannot re-open admission once a SIGTERM drain has begun."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from tests.reliability.reliability_daemon import Daemon, is_error_body, report

from flare.cli.ctl import call


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path) -> None:
        super().__init__("localhost", timeout=30)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(str(self._path))


def _raw_control(daemon: Daemon, method: str, path: str, body: bytes | None = None) -> tuple[int, str, bytes]:
    connection = _UnixConnection(daemon.control)
    try:
        connection.request(method, path, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.getheader("Content-Type", ""), response.read()
    finally:
        connection.close()


@pytest.fixture(scope="module")
def daemon(tiny_package: Path, daemon_factory: Callable[..., Daemon]) -> Daemon:
    return daemon_factory(tiny_package)


def test_hostile_control_commands_get_json_errors_and_an_audit_line_each(daemon: Daemon) -> None:
    depth = 20_000
    commands = [
        ("PUT", "/log-level", b"[" * depth + b"]" * depth, 400),  # the probe's plain-text 500
        ("PUT", "/log-level", b'{"level": "loud"}', 400),
        ("PUT", "/log-level", b'{"level": "info", "level": "debug"}', 400),
        ("GET", "/no-such-command", None, 404),
        ("DELETE", "/status", None, 405),
        ("PUT", "/log-level", b'{"level": "' + b"a" * 200_000 + b'"}', 413),
        ("POST", "/requests/nope/cancel", None, 404),
    ]
    before = len(daemon.process.events("control.command"))
    for method, path, body, status in commands:
        answered, content_type, raw = _raw_control(daemon, method, path, body)
        assert answered == status, (method, path, answered, raw[:200])
        assert content_type.startswith("application/json"), (path, content_type)
        assert is_error_body(json.loads(raw)), raw[:200]
    audit = daemon.process.wait_for_events("control.command", count=before + len(commands))[before:]
    assert [(line["method"], line["path"], line["status"]) for line in audit] == [
        (method, path, status) for method, path, _, status in commands
    ]
    assert all("peer_uid" in line for line in audit)
    assert call(daemon.control, "GET", "/status")[0] == 200
    report("control_hostile_commands", commands=len(commands), audit_lines=len(audit))


def test_resume_during_a_sigterm_drain_is_refused_and_admission_stays_closed(
    tiny_package: Path, daemon_factory: Callable[..., Daemon]
) -> None:
    stopping = daemon_factory(tiny_package, ["--drain-grace-s", "20"])
    body = {"model": stopping.model, "prompt": "Once upon a time", "max_tokens": 480}
    finished: dict = {}

    def long_request() -> None:
        finished["response"] = httpx.post(f"{stopping.url}/v1/completions", json=body, timeout=120)

    worker = threading.Thread(target=long_request)
    worker.start()
    deadline = time.monotonic() + 30
    while stopping.status()["running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    stopping.process.process.send_signal(signal.SIGTERM)
    while not stopping.process.events("draining") and time.monotonic() < deadline:
        time.sleep(0.05)

    code, answer = call(stopping.control, "POST", "/resume")
    assert code == 409 and answer["error"]["code"] == "shutting_down", answer
    refused = httpx.post(f"{stopping.url}/v1/completions", json={**body, "max_tokens": 2}, timeout=30)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
    assert httpx.get(f"{stopping.url}/health", timeout=30).status_code == 503
    # A second signal ends the grace at once; the daemon exits cleanly.
    stopping.process.process.send_signal(signal.SIGTERM)
    assert stopping.process.process.wait(60) == 0
    worker.join(60)
    assert finished["response"].status_code in (200, 503)
    [audit] = stopping.process.wait_for_events("control.command", where=lambda e: e["path"] == "/resume")
    assert audit["status"] == 409
