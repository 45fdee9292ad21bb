"""Connection limits' parts that need no server: the client-error log's rate limit, raw answers,
the file-descriptor check at start (the server behaviour is tested end to end in
tests/reliability/test_connections.py)."""

from __future__ import annotations

import json
import resource

import pytest
import structlog
from aiohttp.http_exceptions import BadStatusLine

from flare.daemon.config import DaemonConfig
from flare.server.connections import (
    CLIENT_ERROR_LINES,
    CLIENT_ERROR_WINDOW_S,
    ClientErrorLog,
    ConnectionLimits,
    raw_error_response,
)
from flare.daemon.lifecycle import StartupError, ensure_file_descriptors


def test_client_errors_are_rate_limited_and_report_what_was_suppressed() -> None:
    now = [0.0]
    errors = ClientErrorLog(clock=lambda: now[0])
    with structlog.testing.capture_logs() as lines:
        for _ in range(CLIENT_ERROR_LINES + 30):
            errors.exception("Error handling request", exc_info=BadStatusLine(error="garbage"))
        now[0] += CLIENT_ERROR_WINDOW_S
        errors.exception("Error handling request", exc_info=BadStatusLine(error="garbage"))
    assert len(lines) == CLIENT_ERROR_LINES + 1
    assert all(line["log_level"] == "info" and line["event"] == "client_protocol_error" for line in lines)
    assert all("exc_info" not in line for line in lines)
    assert lines[-1]["suppressed_before"] == 30


def test_the_daemons_own_faults_stay_errors_with_their_traceback() -> None:
    errors = ClientErrorLog()
    with structlog.testing.capture_logs() as lines:
        errors.exception("Unhandled exception", exc_info=KeyError("bug"))
    [line] = lines
    assert line["log_level"] == "error" and isinstance(line["exc_info"], KeyError)


def test_raw_error_responses_are_whole_http_answers_with_an_openai_body() -> None:
    raw = raw_error_response(503, "full", "too_many_connections", retry_after_s=1)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    assert b"Connection: close" in head and b"Retry-After: 1" in head
    assert b"Content-Length: %d" % len(body) in head
    assert json.loads(body)["error"] == {"message": "full", "type": "server_error", "param": None, "code": "too_many_connections"}


def test_a_connection_bound_beyond_the_hard_file_descriptor_limit_stops_the_start() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        pytest.skip("no hard file-descriptor limit here")
    limits = ConnectionLimits.from_config(DaemonConfig(max_connections=hard))
    with pytest.raises(StartupError, match="LimitNOFILE"):
        ensure_file_descriptors(limits)


def test_a_connection_bound_under_the_hard_limit_raises_the_soft_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        target = min(hard, 4096) if hard != resource.RLIM_INFINITY else 4096
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 300), hard))
        limits = ConnectionLimits.from_config(DaemonConfig(max_connections=target - 256))
        ensure_file_descriptors(limits)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= limits.file_descriptors_needed
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
