"""Structured logging: structlog configured once at start, stdlib logging routed through it.

Every log line goes through one stdlib handler whose formatter renders it: JSON lines (one
object per line, the journal keeps them) when stdout is not a terminal, when systemd connected
it to the journal (`JOURNAL_STREAM`), or when asked; a readable console renderer on a
terminal. structlog events and stdlib records (aiohttp's) meet in the same formatter, so both
come out in the same shape. The level lives on the root logger, so changing it at run time
(`flare ctl log-level`, SIGHUP) takes effect for every logger at once.

Request context: the HTTP handler binds `request_id` with `structlog.contextvars.bound_contextvars`
and every line logged in that task carries it; code that runs in another thread (the scheduler's
worker) logs through a logger bound with `request_id` explicitly.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import Literal, TextIO

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

LogFormat = Literal["auto", "json", "console"]
LOG_LEVELS: tuple[str, ...] = ("debug", "info", "warning", "error")
LOG_FORMATS: tuple[str, ...] = ("auto", "json", "console")


def parse_log_level(name: str) -> int:
    """The stdlib level number for a level name; ValueError naming the allowed names."""
    normalized = name.strip().lower()
    if normalized not in LOG_LEVELS:
        raise ValueError(f"log level {name!r} is not one of {', '.join(LOG_LEVELS)}")
    return logging.getLevelNamesMapping()[normalized.upper()]


def resolve_log_format(log_format: str, stream: TextIO, environ: Mapping[str, str]) -> Literal["json", "console"]:
    """JSON or console; "auto" means JSON under systemd (JOURNAL_STREAM) or off a terminal."""
    if log_format == "json" or log_format == "console":
        return log_format
    if log_format != "auto":
        raise ValueError(f"log format {log_format!r} is not one of {', '.join(LOG_FORMATS)}")
    if environ.get("JOURNAL_STREAM") or not stream.isatty():
        return "json"
    return "console"


# C0 and C1 control characters and DEL, rendered as \xNN so a request field (a path, a
# model name) cannot forge a line or move the cursor on an operator's terminal. JSON output
# escapes them already.
_CONTROL_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}


def _escape_control_characters(_logger: WrappedLogger, _name: str, event_dict: EventDict) -> EventDict:
    for key, value in event_dict.items():
        if isinstance(value, str):
            event_dict[key] = value.translate(_CONTROL_ESCAPES)
    return event_dict


# Processors that run on every structlog event before it becomes a stdlib record, and on
# every foreign stdlib record before rendering: both end up with the same keys.
_SHARED_PROCESSORS: tuple[Processor, ...] = (
    structlog.contextvars.merge_contextvars,
    structlog.stdlib.add_log_level,
    structlog.stdlib.add_logger_name,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
)


class _FlareHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Marks the one handler this module installs, so configuring again replaces it."""


class LogControl:
    """The installed logging set-up: change the level at run time."""

    def __init__(self, root: logging.Logger, output_format: Literal["json", "console"]) -> None:
        self._root = root
        self.format = output_format

    @property
    def level(self) -> str:
        return logging.getLevelName(self._root.level).lower()

    def set_level(self, name: str) -> None:
        """Set the level of every logger; ValueError (naming the allowed levels) for a bad name."""
        self._root.setLevel(parse_log_level(name))


def configure_logging(
    level: str = "info",
    log_format: str = "auto",
    *,
    stream: TextIO | None = None,
    environ: Mapping[str, str] | None = None,
) -> LogControl:
    """Configure structlog and stdlib logging for the whole process; call once at start
    (calling again replaces the previous set-up, which tests rely on)."""
    out = sys.stdout if stream is None else stream
    output_format = resolve_log_format(log_format, out, os.environ if environ is None else environ)
    root = logging.getLogger()
    root.setLevel(parse_log_level(level))

    renderer: list[Processor]
    if output_format == "json":
        renderer = [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        renderer = [
            _escape_control_characters,
            structlog.dev.ConsoleRenderer(
                colors=out.isatty(),
                # Plain tracebacks: the rich formatter prints local variables, which can hold secrets.
                exception_formatter=structlog.dev.plain_traceback,
            ),
        ]
    handler = _FlareHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=list(_SHARED_PROCESSORS),
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *renderer],
        )
    )
    for old in [h for h in root.handlers if isinstance(h, _FlareHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)

    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *_SHARED_PROCESSORS,
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        # Not cached: a logger created before configure_logging must follow the final set-up.
        cache_logger_on_first_use=False,
    )
    return LogControl(root, output_format)
