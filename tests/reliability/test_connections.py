"""Slow, idle, oversized, too many and non-reading connections, end to end: each is bounded (closed
with a JSON answer where one can still be given, or refused), logged without flooding the log, and
never starves `/health`, other clients or `flare ctl`; shutdown fits its stop timeout whatever the
clients do."""

from __future__ import annotations

import json
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from tests.reliability.reliability_daemon import Daemon, exchange, is_error_body, port_of, report

from flare.cli.ctl import call
from flare.daemon.lifecycle import SHUTDOWN_MARGIN_S
from flare.server.connections import CLIENT_ERROR_LINES

HEADER_TIMEOUT_S = 2.0
KEEPALIVE_TIMEOUT_S = 3.0
MAX_HEADER_BYTES = 16384
MAX_CONNECTIONS = 12
# A served model name this long makes every SSE chunk about 40 KB, so a client that does not read
# fills the socket buffers (up to 4 MiB on Linux) within about a hundred tokens.
LONG_MODEL_NAME = "m" * 40000


@pytest.fixture(scope="module")
def strict(tiny_package: Path, daemon_factory: Callable[..., Daemon]) -> Daemon:
    return daemon_factory(
        tiny_package,
        [
            "--header-timeout-s", str(HEADER_TIMEOUT_S),
            "--keepalive-timeout-s", str(KEEPALIVE_TIMEOUT_S),
            "--max-header-bytes", str(MAX_HEADER_BYTES),
        ],
    )


def _get(path: str = "/health", extra: bytes = b"") -> bytes:
    return b"GET " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n" + extra + b"\r\n"


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(strict: Daemon) -> None:
    silent = exchange(port_of(strict), wait_s=HEADER_TIMEOUT_S + 8)
    assert silent.closed, "the daemon kept a connection that never sent a request"
    assert HEADER_TIMEOUT_S - 0.5 <= silent.seconds <= HEADER_TIMEOUT_S + 5
    assert silent.status == 408 and silent.json()["error"]["code"] == "request_timeout"
    report("silent_connection", header_timeout_s=HEADER_TIMEOUT_S, closed_after_s=round(silent.seconds, 2))


def test_a_client_that_trickles_its_request_head_is_cut_off(strict: Daemon) -> None:
    # One byte every 0.2 s: the head would take 8 s, four times the header timeout.
    trickle = exchange(port_of(strict), _get(extra=b"X-Slow: " + b"a" * 30 + b"\r\n"), drip_s=0.2, wait_s=15)
    assert trickle.closed and trickle.seconds <= HEADER_TIMEOUT_S + 5, trickle
    assert trickle.status == 408
    *_, timed_out = strict.process.events("request_head_timeout")
    assert timed_out["level"] == "info" and timed_out["received_bytes"] > 0
    report("trickling_head", closed_after_s=round(trickle.seconds, 2))


def test_an_idle_keep_alive_connection_is_closed_after_the_keep_alive_timeout(strict: Daemon) -> None:
    with socket.create_connection(("127.0.0.1", port_of(strict)), timeout=30) as sock:
        sock.sendall(_get())
        answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200")
        answered = time.monotonic()
        sock.settimeout(KEEPALIVE_TIMEOUT_S + 8)
        assert sock.recv(65536) == b"", "an idle keep-alive connection got data instead of a close"
        idle_s = time.monotonic() - answered
    assert KEEPALIVE_TIMEOUT_S - 0.5 <= idle_s <= KEEPALIVE_TIMEOUT_S + 5
    report("idle_keep_alive", keepalive_timeout_s=KEEPALIVE_TIMEOUT_S, closed_after_s=round(idle_s, 2))


def test_a_request_head_over_the_limit_gets_431_and_the_connection_closes(strict: Daemon) -> None:
    # 40 headers of 1 KiB: each is within aiohttp's per-line limit, the whole far over max_header_bytes.
    lines = [b"X-Pad-%02d: %s\r\n" % (i, b"a" * 1024) for i in range(40)]
    fields = b"".join(lines)
    oversized = exchange(port_of(strict), _get(extra=fields), wait_s=10)
    assert oversized.status == 431 and oversized.closed, oversized.answer[:200]
    assert oversized.json()["error"]["code"] == "request_header_fields_too_large"
    # Just under the limit is still served.
    under = b"Connection: close\r\n" + b"".join(lines[: MAX_HEADER_BYTES // len(lines[0]) - 1])
    fits = exchange(port_of(strict), _get(extra=under), wait_s=10)
    assert fits.status == 200, fits.answer[:200]


def test_a_malformed_request_flood_is_logged_at_info_level_and_rate_limited(strict: Daemon) -> None:
    before = len(strict.process.lines)
    garbage = [b"GARBAGE\r\n\r\n", b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n"]
    answers = [exchange(port_of(strict), garbage[i % 3], wait_s=10) for i in range(300)]
    assert all(a.status == 400 and is_error_body(a.json()) for a in answers), answers[0].answer[:300]
    assert strict.process.health() == 200
    lines = [json.loads(line) for line in strict.process.lines[before:]]
    errors = [line for line in lines if line["level"] in ("error", "critical")]
    protocol = [line for line in lines if line["event"] == "client_protocol_error"]
    assert errors == [], errors[:3]
    assert all("exception" not in line for line in protocol)
    # The 300 errors arrive within one rate-limit window (on this machine: about a second).
    assert 1 <= len(protocol) <= CLIENT_ERROR_LINES + 1
    report("protocol_error_flood", malformed_requests=300, log_lines=len(protocol), error_lines=len(errors))


@pytest.fixture(scope="module")
def bounded(tiny_package: Path, daemon_factory: Callable[..., Daemon]) -> Daemon:
    return daemon_factory(tiny_package, ["--max-connections", str(MAX_CONNECTIONS), "--header-timeout-s", "60"])


def test_connections_beyond_the_bound_are_refused_and_flare_ctl_still_answers(bounded: Daemon) -> None:
    port = port_of(bounded)
    held = []
    try:
        # Connections held open by a client that never sends a request (they count as soon as accepted).
        for _ in range(MAX_CONNECTIONS):
            held.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        time.sleep(0.5)
        refused = exchange(port, _get(), wait_s=10)
        assert refused.status == 503 and refused.closed, refused.answer[:300]
        assert refused.json()["error"]["code"] == "too_many_connections"
        # The control socket is never starved by the HTTP side.
        code, status = call(bounded.control, "GET", "/status")
        assert code == 200 and status["running"] == 0
        [warning, *_] = bounded.process.wait_for_events("connection_refused")
        assert warning["level"] == "warning" and warning["max_connections"] == MAX_CONNECTIONS
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while bounded.process.health() != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert bounded.process.health() == 200
    report("connection_bound", max_connections=MAX_CONNECTIONS, held=len(held), refused_status=refused.status)


def _non_reading_clients(port: int, count: int) -> list[socket.socket]:
    """Clients that send a streaming request and never read a byte of the answer."""
    body = json.dumps(
        {"model": LONG_MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 400, "stream": True}
    ).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body
    )
    clients = []
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.sendall(request)
        clients.append(sock)
    return clients


def test_a_client_that_does_not_read_has_its_request_cancelled_after_the_write_timeout(
    tiny_package: Path, daemon_factory: Callable[..., Daemon]
) -> None:
    daemon = daemon_factory(tiny_package, ["--served-model-name", LONG_MODEL_NAME, "--write-timeout-s", "2"])
    clients = _non_reading_clients(port_of(daemon), 2)
    try:
        daemon.process.wait_for_events("client_not_reading", count=2, timeout_s=60)
        cancelled = daemon.process.wait_for_events(
            "generation_cancelled", count=2, where=lambda e: "not reading" in e["reason"]
        )
        assert len(cancelled) == 2, daemon.process.log()
        idle = daemon.wait_idle()
        assert idle["running"] == 0 and idle["kv_blocks_used"] == 0
        assert daemon.process.health() == 200
    finally:
        for sock in clients:
            sock.close()
    report("non_reading_client", write_timeout_s=2, cancelled=len(cancelled))


def test_sigterm_with_clients_that_do_not_read_exits_within_the_grace_plus_the_stated_margin(
    tiny_package: Path, daemon_factory: Callable[..., Daemon]
) -> None:
    grace_s = 2.0
    # A write timeout longer than the whole shutdown: the shutdown itself must end the stuck writes.
    daemon = daemon_factory(
        tiny_package,
        ["--served-model-name", LONG_MODEL_NAME, "--write-timeout-s", "300", "--drain-grace-s", str(grace_s)],
    )
    clients = _non_reading_clients(port_of(daemon), 4)
    try:
        # All four admitted (seen running together), then long enough for their 40 kB chunks to
        # fill the socket buffers: every stream is now stuck in a write, whether or not its
        # generation has finished (a fast CPU generates the tiny model's 400 tokens in about a
        # second, so "still running after 3 s" is not something to wait for).
        seen, deadline = 0, time.monotonic() + 30
        while seen < 4 and time.monotonic() < deadline:
            seen = max(seen, daemon.status()["running"])
            time.sleep(0.01)
        assert seen == 4, daemon.process.log()
        time.sleep(2)
        written_out = [e for e in daemon.process.events("access") if e.get("path") == "/v1/completions"]
        assert not written_out, written_out  # every stream is still being written
        with httpx.Client(base_url=daemon.url, timeout=30) as http:
            assert http.get("/health").status_code == 200
        started = time.monotonic()
        daemon.process.process.send_signal(signal.SIGTERM)
        code = daemon.process.process.wait(60)
        exit_s = time.monotonic() - started
    finally:
        for sock in clients:
            sock.close()
    assert code == 0, daemon.process.log()
    assert exit_s <= grace_s + SHUTDOWN_MARGIN_S, exit_s
    report("shutdown_with_non_reading_clients", clients=4, grace_s=grace_s, exit_s=round(exit_s, 2),
           margin_s=SHUTDOWN_MARGIN_S)
