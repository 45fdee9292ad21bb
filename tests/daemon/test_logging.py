"""Log lines as an operator reads them: JSON in the journal, readable on a terminal."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import structlog

from flare.daemon.logging import configure_logging, resolve_log_format
from flare.server.access_log import log_access


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.reset_defaults()


def json_lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_carry_event_level_time_and_fields() -> None:
    out = io.StringIO()
    configure_logging("info", "json", stream=out)
    structlog.get_logger("flare.test").info("package.loaded", package="smollm2", layers=30)
    [line] = json_lines(out)
    assert line["event"] == "package.loaded"
    assert line["level"] == "info"
    assert line["package"] == "smollm2" and line["layers"] == 30
    assert line["logger"] == "flare.test"
    assert line["timestamp"].endswith("Z")


def test_stdlib_records_such_as_aiohttps_come_out_as_the_same_json() -> None:
    out = io.StringIO()
    configure_logging("info", "json", stream=out)
    logging.getLogger("aiohttp.server").error("Error handling request from %s", "127.0.0.1")
    [line] = json_lines(out)
    assert line["event"] == "Error handling request from 127.0.0.1"
    assert line["level"] == "error"
    assert line["logger"] == "aiohttp.server"


def test_every_line_logged_while_handling_a_request_carries_its_id() -> None:
    out = io.StringIO()
    configure_logging("info", "json", stream=out)
    log = structlog.get_logger("flare.daemon")
    with structlog.contextvars.bound_contextvars(request_id="chatcmpl-1"):
        log.info("request.admitted")
        logging.getLogger("aiohttp.server").warning("slow client")
    log.info("idle")
    admitted, slow, idle = json_lines(out)
    assert admitted["request_id"] == "chatcmpl-1"
    assert slow["request_id"] == "chatcmpl-1"
    assert "request_id" not in idle


def test_exceptions_stay_on_one_json_line() -> None:
    out = io.StringIO()
    configure_logging("info", "json", stream=out)
    try:
        raise RuntimeError("round failed")
    except RuntimeError:
        structlog.get_logger("flare.test").exception("scheduler.round_failed")
    [line] = json_lines(out)
    assert "RuntimeError: round failed" in line["exception"]


def test_console_renderer_is_readable_and_escapes_control_characters() -> None:
    out = io.StringIO()  # not a terminal: no colour codes of the renderer's own
    control = configure_logging("info", "console", stream=out)
    assert control.format == "console"
    structlog.get_logger("flare.test").info("http.request", path="/v1/\x1b[31mred\nforged")
    text = out.getvalue()
    assert text.count("\n") == 1  # the request's newline did not start a second line
    assert "\x1b" not in text  # nor did its escape sequence reach the terminal
    assert "http.request" in text and "path=/v1/\\x1b[31mred\\x0aforged" in text
    with pytest.raises(ValueError):
        json.loads(text)


@pytest.mark.parametrize(
    ("stream", "environ", "expected"),
    [
        (Terminal(), {}, "console"),
        (Terminal(), {"JOURNAL_STREAM": "8:12345"}, "json"),
        (io.StringIO(), {}, "json"),
    ],
)
def test_auto_format_is_json_under_systemd_or_without_a_terminal(
    stream: io.StringIO, environ: dict[str, str], expected: str
) -> None:
    assert resolve_log_format("auto", stream, environ) == expected
    assert resolve_log_format("console", io.StringIO(), {"JOURNAL_STREAM": "8:1"}) == "console"


def test_level_changes_at_run_time_for_every_logger() -> None:
    out = io.StringIO()
    control = configure_logging("info", "json", stream=out)
    log = structlog.get_logger("flare.test")
    log.debug("hidden")
    logging.getLogger("aiohttp.web").debug("hidden too")
    control.set_level("debug")
    assert control.level == "debug"
    log.debug("shown")
    logging.getLogger("aiohttp.web").debug("shown too")
    control.set_level("WARNING")
    log.info("hidden again")
    assert [line["event"] for line in json_lines(out)] == ["shown", "shown too"]


def test_an_unknown_level_is_refused_naming_the_allowed_ones() -> None:
    control = configure_logging("info", "json", stream=io.StringIO())
    with pytest.raises(ValueError, match="debug, info, warning, error"):
        control.set_level("verbose")
    assert control.level == "info"
    with pytest.raises(ValueError, match="log format 'xml'"):
        configure_logging("info", "xml", stream=io.StringIO())


def test_configuring_again_replaces_the_handler_instead_of_doubling_lines() -> None:
    first, second = io.StringIO(), io.StringIO()
    configure_logging("info", "json", stream=first)
    configure_logging("info", "json", stream=second)
    structlog.get_logger("flare.test").info("once")
    assert first.getvalue() == ""
    assert len(json_lines(second)) == 1


def test_access_line_has_method_path_status_id_tokens_and_timings() -> None:
    out = io.StringIO()
    configure_logging("info", "json", stream=out)
    log = structlog.get_logger("flare.access")
    log_access(
        log,
        method="POST",
        path="/v1/chat/completions",
        status=200,
        request_id="chatcmpl-7",
        duration_s=1.23456,
        prompt_tokens=12,
        completion_tokens=34,
        ttft_s=0.0504,
    )
    log_access(log, method="GET", path="/health", status=200, request_id=None, duration_s=0.0002)
    chat, health = json_lines(out)
    assert chat["event"] == "access"
    assert {k: chat[k] for k in ("method", "path", "status", "request_id")} == {
        "method": "POST",
        "path": "/v1/chat/completions",
        "status": 200,
        "request_id": "chatcmpl-7",
    }
    assert (chat["prompt_tokens"], chat["completion_tokens"]) == (12, 34)
    assert chat["ttft_ms"] == 50.4 and chat["duration_ms"] == 1234.6
    assert "ttft_ms" not in health and "prompt_tokens" not in health
