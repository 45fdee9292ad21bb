"""Compressed request bodies and the control socket's connections (issue 29, item 9), through
the real daemon: an undecodable deflate body is a client's error (a 400, no error-level line, no
traceback), a deflate body cut short is a 400 at once (not a 408 after 30 s), a body that is
not gzip says so, a decompression bomb stops at the body limit; on the control socket a
malformed request gets a JSON 400, and HTTP/0.9 and silent connections are closed in time."""

from __future__ import annotations

import gzip
import json
import socket
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from tests.reliability.reliability_daemon import Daemon, exchange, is_error_body, port_of, report

from flare.daemon.control import CONTROL_CONNECTION_LIMITS

MAX_BODY_BYTES = 65536


@pytest.fixture(scope="module")
def daemon(tiny_package: Path, daemon_factory: Callable[..., Daemon]) -> Daemon:
    return daemon_factory(tiny_package, ["--max-body-bytes", str(MAX_BODY_BYTES)])


def _post(daemon: Daemon, body: bytes, encoding: str) -> tuple[int, dict, float]:
    """A whole request with a complete Content-Length; (status, JSON body, seconds to the answer)."""
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Encoding: {encoding}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    seen = exchange(port_of(daemon), head + body, wait_s=40)
    assert seen.status is not None, seen
    return seen.status, seen.json(), seen.answered_s or seen.seconds


def _request(daemon: Daemon) -> bytes:
    return json.dumps({"model": daemon.model, "prompt": "hello " * 200, "max_tokens": 2}).encode()


def _error_lines(daemon: Daemon) -> list[str]:
    return [
        line
        for line in daemon.process.lines
        if '"level": "error"' in line or "Traceback" in line or "http_server_error" in line
    ]


def test_an_undecodable_deflate_body_is_a_400_logged_as_the_clients_error(daemon: Daemon) -> None:
    before = len(_error_lines(daemon))
    for _ in range(30):  # more than the client-error log's lines per window: nothing floods
        status, body, _ = _post(daemon, b"this is not compressed data at all", "deflate")
        assert status == 400 and is_error_body(body), body
    assert body["error"]["code"] == "invalid_body_encoding" and "not valid deflate data" in body["error"]["message"]
    time.sleep(0.5)
    assert _error_lines(daemon)[before:] == []
    assert daemon.serves()


def test_a_truncated_deflate_body_is_a_400_at_once(daemon: Daemon) -> None:
    whole = zlib.compress(_request(daemon))
    status, body, seconds = _post(daemon, whole[: len(whole) // 2], "deflate")
    report("truncated_deflate", status=status, seconds=round(seconds, 2))
    assert status == 400 and seconds < 5, (status, body, seconds)
    assert "truncated" in body["error"]["message"]
    # Bare deflate (no zlib wrapper), as some clients send it, decodes too.
    bare = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    status, body, _ = _post(daemon, bare.compress(_request(daemon)) + bare.flush(), "deflate")
    assert status == 200, body


def test_a_body_that_is_not_gzip_says_so(daemon: Daemon) -> None:
    status, body, _ = _post(daemon, b"this is not compressed data at all", "gzip")
    assert status == 400 and "empty" not in body["error"]["message"], body
    assert "gzip" in body["error"]["message"] and "magic" in body["error"]["message"]
    status, body, _ = _post(daemon, gzip.compress(_request(daemon))[:-4], "gzip")
    assert status == 400 and "truncated" in body["error"]["message"], body
    status, body, _ = _post(daemon, gzip.compress(_request(daemon)), "gzip")
    assert status == 200, body


def test_a_decompression_bomb_stops_at_the_body_limit(daemon: Daemon) -> None:
    bomb = zlib.compress(b"[" + b" " * (64 * MAX_BODY_BYTES) + b"]")
    assert len(bomb) < MAX_BODY_BYTES
    status, body, _ = _post(daemon, bomb, "deflate")
    assert status == 413 and body["error"]["code"] == "request_too_large", body
    status, body, _ = _post(daemon, b"x", "br")
    assert status == 415 and body["error"]["code"] == "unsupported_content_encoding", body


def _control_exchange(path: Path, data: bytes, wait_s: float) -> tuple[bytes, bool, float]:
    """Send `data` on the control socket; (the answer, whether the daemon closed, seconds)."""
    started = time.monotonic()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(wait_s)
        sock.connect(str(path))
        if data:
            sock.sendall(data)
        chunks, closed = [], False
        while time.monotonic() - started < wait_s:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                closed = True
                break
            chunks.append(chunk)
    return b"".join(chunks), closed, time.monotonic() - started


def test_the_control_socket_answers_malformed_http_in_json_and_closes_silent_connections(daemon: Daemon) -> None:
    answer, closed, _ = _control_exchange(daemon.control, b"GARBAGE\x01 /status HTTP/1.1\r\n\r\n", 10)
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith((b"HTTP/1.0 400", b"HTTP/1.1 400")) and b"application/json" in head, answer
    assert is_error_body(json.loads(payload)) and closed
    limit = CONTROL_CONNECTION_LIMITS.header_timeout_s
    # A request head left unfinished and a connection that sends nothing, side by side: each
    # waits out the header timeout on its own connection, so the test waits it out once.
    with ThreadPoolExecutor(2) as pool:
        partial, silent = pool.map(lambda data: _control_exchange(daemon.control, data, limit + 10), [b"GET /status\r\n", b""])
    answer, closed, seconds = partial
    assert closed and seconds < limit + 5, (answer, seconds)
    answer, closed, seconds = silent
    report("control_socket_silent", closed=closed, seconds=round(seconds, 1), header_timeout_s=limit)
    assert closed and seconds < limit + 5, (answer, seconds)
    assert daemon.status()["running"] == 0
