"""The HTTP server's connections: how many may be open, how long a client may take to send a
request head or sit idle, how large a head may be, how long a write may wait for a client that
does not read, and how a client's protocol errors are logged.

aiohttp alone keeps an idle connection 3630 s, lets a request head trickle in for as long as
the connection stays idle-timed, buffers heads of up to 128 fields of 8 KiB each, waits for a
client that never reads for ever, and logs every malformed request with a traceback at error
level. A hostile or broken client could so hold file descriptors and memory without bound,
stretch shutdown past systemd's stop timeout, or flood the log. `GuardedAppRunner` serves the
app with `ConnectionLimits` applied to every connection:

- `max_connections`: a connection beyond it is answered 503 (JSON error body, `Connection:
  close`) and closed at once, with a rate-limited warning. The daemon checks at start that the
  bound, plus a reserve for everything else (the control socket above all), fits under the
  process's file-descriptor limit.
- `header_timeout_s`: from the moment a connection opens, or the first byte of a further request
  arrives on it, the whole request head must arrive within this time; else 408 and close.
- `keepalive_timeout_s`: an idle connection between requests is closed after this time.
- `max_header_bytes`: a request head larger than this is answered 431 and the connection closed.
- `write_timeout_s`: a write that cannot make progress (the client stopped reading) for this
  long fails with `ClientNotReading`; the request is cancelled and the connection aborted.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Protocol

import structlog
from aiohttp import web
from aiohttp.http_exceptions import BadStatusLine, HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError, _ErrInfo

from flare.api.answer import ClientNotReading
from flare.api.errors import INVALID_REQUEST, SERVER_ERROR, error_body
from flare.server.middlewares import EVERY_RESPONSE_HEADERS

log = structlog.get_logger("flare.daemon.connections")

# File descriptors kept free beyond max_connections: the control socket and its connections,
# the package's files, log output, the event loop's own descriptors, worker threads' pipes.
FD_RESERVE = 256
# At most this many client-error lines per window; the next line says how many were suppressed.
CLIENT_ERROR_LINES = 20
CLIENT_ERROR_WINDOW_S = 10.0
_HEAD_END = b"\r\n\r\n"


class ConnectionSettings(Protocol):
    """The settings the limits come from, named here so that the server imports nothing of the
    daemon above it; the daemon's config (daemon/config.py) has them."""

    @property
    def max_connections(self) -> int: ...

    @property
    def header_timeout_s(self) -> float: ...

    @property
    def keepalive_timeout_s(self) -> float: ...

    @property
    def write_timeout_s(self) -> float: ...

    @property
    def max_header_bytes(self) -> int: ...


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    header_timeout_s: float
    keepalive_timeout_s: float
    write_timeout_s: float
    max_header_bytes: int

    @classmethod
    def from_config(cls, config: ConnectionSettings) -> ConnectionLimits:
        return cls(
            max_connections=config.max_connections,
            header_timeout_s=config.header_timeout_s,
            keepalive_timeout_s=config.keepalive_timeout_s,
            write_timeout_s=config.write_timeout_s,
            max_header_bytes=config.max_header_bytes,
        )

    @property
    def file_descriptors_needed(self) -> int:
        return self.max_connections + FD_RESERVE


class ClientErrorLog:
    """Lines about clients' mistakes (malformed requests, timeouts, refused connections): at
    info level (warning for refused connections), without tracebacks, and at most
    CLIENT_ERROR_LINES per CLIENT_ERROR_WINDOW_S, so no client can flood the log. The daemon's
    own faults do not come here: they stay at error level with their traceback.

    It also stands in for aiohttp's server logger (`logger=` of the runner), which aiohttp
    calls with stdlib-style arguments: the errors of its HTTP parser are a client's, anything
    else it reports is the daemon's.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._window_start = -CLIENT_ERROR_WINDOW_S
        self._lines = 0
        self.suppressed = 0  # lines not written since the last one that was

    def client(self, event: str, *, level: str = "info", **fields: Any) -> None:
        now = self._clock()
        if now - self._window_start >= CLIENT_ERROR_WINDOW_S:
            self._window_start, self._lines = now, 0
        if self._lines >= CLIENT_ERROR_LINES:
            self.suppressed += 1
            return
        self._lines += 1
        if self.suppressed:
            fields["suppressed_before"] = self.suppressed
            self.suppressed = 0
        getattr(log, level)(event, **fields)

    # --- the logging.Logger methods aiohttp's server calls ---

    def exception(self, message: str, *args: Any, exc_info: Any = True, **_: Any) -> None:
        error = sys.exc_info()[1] if exc_info is True else exc_info
        if isinstance(error, HttpProcessingError):
            self.client("client_protocol_error", error=type(error).__name__, message=_one_line(error.message))
        elif isinstance(error, RequestPayloadError):
            # A body that does not match its framing, met again as the connection drains it.
            self.client("client_protocol_error", error=type(error).__name__, message=_one_line(error))
        elif isinstance(error, ConnectionError):
            self.client("client_connection_error", error=type(error).__name__, message=_one_line(str(error)))
        else:
            log.error("http_server_error", message=message % args if args else message, exc_info=error)

    def error(self, message: str, *args: Any, **kwargs: Any) -> None:
        log.error("http_server_error", message=message % args if args else message, exc_info=kwargs.get("exc_info"))

    def warning(self, message: str, *args: Any, **_: Any) -> None:
        log.warning("http_server_warning", message=message % args if args else message)

    def info(self, message: str, *args: Any, **_: Any) -> None:
        log.debug("http_server", message=message % args if args else message)

    def debug(self, message: str, *args: Any, **_: Any) -> None:
        log.debug("http_server", message=message % args if args else message)


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())[:200]


def raw_error_response(status: int, message: str, code: str, *, retry_after_s: int | None = None) -> bytes:
    """A whole HTTP/1.1 error response with OpenAI's error body, for answers given before aiohttp
    has a request (refused connection, head timeout, head too large); the connection closes."""
    kind = SERVER_ERROR if status >= 500 else INVALID_REQUEST
    body = json.dumps(error_body(message, type=kind, param=None, code=code)).encode()
    head = [
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
        "Content-Type: application/json; charset=utf-8",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{name}: {value}" for name, value in EVERY_RESPONSE_HEADERS.items()),
    ]
    if retry_after_s is not None:
        head.append(f"Retry-After: {retry_after_s}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class ConnectionGuard:
    """The open connections of the HTTP server and the limits they live under."""

    def __init__(self, limits: ConnectionLimits, client_errors: ClientErrorLog) -> None:
        self.limits = limits
        self.client_errors = client_errors
        self._open: set[GuardedRequestHandler] = set()
        self.refused = 0

    @property
    def open(self) -> int:
        return len(self._open)

    def admit(self, handler: GuardedRequestHandler) -> bool:
        if len(self._open) >= self.limits.max_connections:
            self.refused += 1
            self.client_errors.client(
                "connection_refused",
                level="warning",
                reason="max_connections reached",
                open=len(self._open),
                max_connections=self.limits.max_connections,
                refused_total=self.refused,
            )
            return False
        self._open.add(handler)
        return True

    def release(self, handler: GuardedRequestHandler) -> None:
        self._open.discard(handler)

    def abort_all(self) -> int:
        """Close every connection at once, unsent bytes dropped (the end of shutdown)."""
        handlers = list(self._open)
        for handler in handlers:
            if handler.transport is not None:
                handler.transport.abort()
        return len(handlers)


class GuardedRequestHandler(web.RequestHandler):  # type: ignore[type-arg]
    """aiohttp's per-connection protocol with the guard's limits. It reads aiohttp's parser
    queue (`_messages`, `_request_count`) and overrides `_drain_helper` (where every write
    waits for the client): the hooks aiohttp's RequestHandler offers for this (3.10 to 3.14)."""

    def __init__(self, manager: web.Server, *, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._admitted = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._head_tail = b""  # the last bytes of the head so far, to find its end across reads
        self._last_payload: Any = None  # the newest request's body; at EOF: the next bytes are a head

    # --- open and close ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._guard.admit(self):
            limit = self._guard.limits.max_connections
            transport.write(  # type: ignore[attr-defined]
                raw_error_response(
                    503,
                    f"the server has {limit} connections open, its limit; retry after the Retry-After seconds",
                    "too_many_connections",
                    retry_after_s=1,
                )
            )
            transport.close()
            return
        self._admitted = True
        super().connection_made(transport)
        self._arm_head_timer()  # the first request must arrive within header_timeout_s too

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self._admitted:
            return
        self._guard.release(self)
        self._disarm_head_timer()
        super().connection_lost(exc)

    # --- the request head: its size and its deadline ---

    def _between_requests(self) -> bool:
        """Whether the parser waits for a request head (the last request's body is complete)."""
        return self._last_payload is None or self._last_payload.is_eof()

    def data_received(self, data: bytes) -> None:
        if self._force_close or self._close:
            return
        in_head = self._between_requests()
        if in_head:
            if self._head_timer is None and not self._request_in_progress and not self._messages:
                self._arm_head_timer()
            if not self._count_head_bytes(data):
                limit = self._guard.limits.max_header_bytes
                self._guard.client_errors.client("request_head_too_large", limit=limit, peer=_peer(self))
                self._refuse(
                    431,
                    f"the request head (request line and headers) is larger than the limit of {limit} bytes",
                    "request_header_fields_too_large",
                )
                return
        parsed = self._request_count
        super().data_received(data)
        if self._request_count != parsed:
            # A head arrived whole: its deadline is met; from now the body's own limits apply.
            self._disarm_head_timer()
            self._head_bytes, self._head_tail = 0, b""
            if self._messages:
                self._last_payload = self._messages[-1][1]
            self._refuse_http_09()

    def _refuse_http_09(self) -> None:
        """A bare request line (`GET /health`, no version) is HTTP/0.9, whose answers have no
        status line: turned into the parser's 400, answered as HTTP/1.0, and the connection closed."""
        for index, (message, payload) in enumerate(self._messages):
            if not isinstance(message, _ErrInfo) and message.version < (1, 0):
                error = BadStatusLine(error="a request line without an HTTP version (HTTP/0.9) is not supported")
                self._messages[index] = (_ErrInfo(status=400, exc=error, message=error.message), payload)

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's answer to what its parser refused (and to a bug that escaped everything):
        OpenAI's error body instead of plain text; logged through ClientErrorLog."""
        self.log_exception("Error handling request", exc_info=exc)
        if request.writer.output_size > 0:
            raise ConnectionError("the answer had begun; no error can follow it")
        if status >= 500:
            text, code = "internal error while handling the request; the daemon log has the details", "internal_error"
        else:
            detail = exc.message if isinstance(exc, HttpProcessingError) else message or HTTPStatus(status).phrase
            text, code = f"not a valid HTTP request: {_one_line(detail)}", "invalid_http"
        kind = SERVER_ERROR if status >= 500 else INVALID_REQUEST
        # Answered before the app routes the request, so the app's response hook never sees it.
        response = web.json_response(
            error_body(text, type=kind, param=None, code=code), status=status, headers=EVERY_RESPONSE_HEADERS
        )
        response.force_close()
        return response

    def _count_head_bytes(self, data: bytes) -> bool:
        """Adds the head's bytes in `data`; False once the head exceeds max_header_bytes."""
        seen = self._head_tail + data
        end = seen.find(_HEAD_END)
        if end >= 0:
            self._head_bytes += end + len(_HEAD_END) - len(self._head_tail)
        else:
            self._head_bytes += len(data)
            self._head_tail = seen[-(len(_HEAD_END) - 1) :]
        return self._head_bytes <= self._guard.limits.max_header_bytes

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self._loop.call_later(self._guard.limits.header_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport is None or self._request_in_progress or self._messages:
            return  # a pipelined head behind a running request: keep-alive's timer covers it
        timeout = self._guard.limits.header_timeout_s
        self._guard.client_errors.client(
            "request_head_timeout", timeout_s=timeout, received_bytes=self._head_bytes, peer=_peer(self)
        )
        self._refuse(408, f"no complete request head arrived within {timeout:g} s", "request_timeout")

    def _refuse(self, status: int, message: str, code: str) -> None:
        if self.transport is not None:
            self.transport.write(raw_error_response(status, message, code))
        self.force_close()  # closes after the answer is flushed

    # --- writes: a client that does not read ---

    async def _drain_helper(self) -> None:
        try:
            async with asyncio.timeout(self._guard.limits.write_timeout_s):
                await super()._drain_helper()
        except TimeoutError:
            timeout = self._guard.limits.write_timeout_s
            self._guard.client_errors.client("client_not_reading", timeout_s=timeout, peer=_peer(self))
            if self.transport is not None:
                self.transport.abort()
            raise ClientNotReading(f"the client read nothing for {timeout:g} s") from None


def _peer(handler: web.RequestHandler) -> str | None:  # type: ignore[type-arg]
    peer = handler.transport.get_extra_info("peername") if handler.transport is not None else None
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else None


class _GuardedServer(web.Server):
    def __init__(self, guard: ConnectionGuard, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._guard = guard

    def __call__(self) -> GuardedRequestHandler:
        return GuardedRequestHandler(self, guard=self._guard, loop=self._loop, **self._kwargs)


class GuardedAppRunner(web.AppRunner):
    """An AppRunner whose connections live under the guard's limits. Bodies reach handlers as
    sent: a Content-Encoding is the handler's to decode (body_encoding.py says why)."""

    def __init__(self, app: web.Application, guard: ConnectionGuard, **kwargs: Any) -> None:
        limits = guard.limits
        super().__init__(
            app,
            logger=guard.client_errors,
            keepalive_timeout=limits.keepalive_timeout_s,
            auto_decompress=False,
            **kwargs,
        )
        self.guard = guard

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        return _GuardedServer(
            self.guard,
            server.request_handler,
            request_factory=server.request_factory,
            handler_cancellation=server.handler_cancellation,
            loop=asyncio.get_running_loop(),
            **server._kwargs,
        )
