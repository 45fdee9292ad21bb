"""The control API: HTTP over a UNIX socket, for `flare ctl`.

Control never listens on TCP: the only way in is a socket file of mode 0660, so the file's
owner and group decide who may steer the daemon, and every command is logged with the peer's
uid, gid and pid (SO_PEERCRED), which the kernel vouches for.

The server asks a `ControlTarget` for everything it does, so it is tested with a fake target
and wired to the scheduler and config by the daemon.

Endpoints (JSON in and out; errors in the API's `{"error": {...}}` shape):
    GET  /status                    DaemonStatus
    GET  /requests                  {"requests": [RequestRow, ...]}
    POST /requests/{id}/cancel      {"cancelled": id}      404 when no such request
    POST /drain                     {"draining": true}
    POST /resume                    {"draining": false}       409 once the daemon is stopping
    POST /cache/clear               {"dropped_blocks": N, "dropped_grammars": G, "dropped_grammar_bytes": B}
                                    unreferenced prefix-cache blocks and every cached grammar dropped
    POST /responses/clear           {"dropped_responses": N, "dropped_bytes": B}
                                    every stored Response deleted; 409 when the store is off
    GET  /config                    the effective config, API keys redacted
    PUT  /log-level  {"level": L}   {"log_level": L}       400 for an unknown level
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.metadata
import os
import re
import socket
import stat
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import anyio.abc
import structlog
from aiohttp import web

from flare.api.errors import INVALID_REQUEST, SERVER_ERROR, ApiError, error_body
from flare.api.json_body import parse_json_body
from flare.api.responses.store import ResponseStore, StoreUse
from flare.daemon.logging import LogControl
from flare.scheduler.failures import cancelled_failure
from flare.server.connections import ClientErrorLog, ConnectionGuard, ConnectionLimits, GuardedAppRunner
from flare.structured import CacheUse

if TYPE_CHECKING:
    from flare.daemon.config import DaemonConfig
    from flare.server.state import ServingState

log = structlog.get_logger(__name__)

SOCKET_MODE = 0o660
# Control commands carry a few bytes of JSON at most.
CONTROL_MAX_BODY_BYTES = 64 << 10
# A command is one short request from `flare ctl` (or a script): a head within 10 s, a few
# connections at once (within the file descriptors connections.FD_RESERVE keeps beside the HTTP
# server's), none idle for long. Each bound closes a connection that does not behave.
CONTROL_CONNECTION_LIMITS = ConnectionLimits(
    max_connections=64,
    header_timeout_s=10.0,
    keepalive_timeout_s=30.0,
    write_timeout_s=30.0,
    max_header_bytes=16 << 10,
)


@dataclass(frozen=True)
class DaemonStatus:
    """What `flare ctl status` shows, and what the systemd STATUS= line summarises."""

    package: str
    uptime_s: float
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_cache_dtype: str  # what the KV cache stores (`flare run --kv-cache-dtype`)
    kv_bytes_per_token: int  # what one cached token costs, all layers, in that dtype (each rank's pool under tensor parallel)
    draining: bool
    device_statuses: dict[str, int]  # rows per device status name since start
    weights_dtype: str  # what the package stores
    weight_format: str  # what the linear layers multiply in (`flare run --weight-format`)
    activations: str  # what ggml block weights multiply: int8 blocks or float32 (`flare run --activations`)
    generated_tokens_per_s: float  # over the last few seconds
    log_level: str
    pid: int
    version: str
    prefix_cache: bool = False
    kv_blocks_cached: int = 0  # in the prefix cache, in use or not
    kv_blocks_evictable: int = 0  # cached, used by no request: given up when requests need blocks
    prompt_tokens_cached: int = 0  # since start: served from the prefix cache
    prompt_tokens_computed: int = 0  # since start: prefilled
    grammar_cache_entries: int = 0  # compiled grammars kept for reuse
    grammar_cache_bytes: int = 0  # their estimated bytes
    weight_types: dict[str, dict[str, int]] = field(default_factory=dict)  # tensors and bytes by stored type
    ranks: list[dict[str, Any]] = field(default_factory=list)  # tensor parallel: rank, pid, cpus of this host's ranks
    # The stored Responses: {"path", "responses", "bytes", "oldest_created_at"}; None: the store is off.
    responses_store: dict[str, Any] | None = None
    layer_calls: str = ""  # "one call", or "steps: " and why (engine_loaded's `layer_calls`)

    def summary(self) -> str:
        """One line: `systemctl status` shows it under the unit."""
        state = "draining" if self.draining else "serving"
        return (
            f"{state} {self.package}: {self.running} running, {self.waiting} waiting, "
            f"{self.generated_tokens_per_s:.1f} tokens/s"
        )


@dataclass(frozen=True)
class RequestRow:
    """One request as `flare ctl requests` lists it."""

    request_id: str
    state: str  # "waiting" | "running"
    age_s: float
    prompt_tokens: int
    completion_tokens: int


class ControlTarget(Protocol):
    """What the control server steers: the daemon wires the scheduler and config to this."""

    def status(self) -> DaemonStatus: ...

    def requests(self) -> Sequence[RequestRow]: ...

    def cancel(self, request_id: str) -> bool:
        """End the request with an operator-cancel failure; False when there is no such request."""
        ...

    def drain(self) -> None: ...

    def resume(self) -> None:
        """Admit requests again; ApiError 409 once the daemon is shutting down."""
        ...

    def clear_prefix_cache(self) -> int:
        """Drop every prefix-cache block no request uses; returns how many."""
        ...

    def clear_grammar_cache(self) -> CacheUse:
        """Drop every cached grammar (running requests keep theirs); returns what was dropped."""
        ...

    async def clear_responses(self) -> StoreUse:
        """Delete every stored Response; returns what was dropped. ApiError 409 when the store is off."""
        ...

    def effective_config(self) -> Mapping[str, Any]: ...

    def set_log_level(self, level: str) -> None:
        """ValueError (naming the allowed levels) for a level that does not exist."""
        ...


class DaemonControl:
    """The ControlTarget of the running daemon: the scheduler (once loaded: until then every
    command that needs it answers 503 "still loading"), the current config (replaced on
    reload, hence a callable) and the log level."""

    def __init__(
        self,
        state: ServingState,
        *,
        config: Callable[[], DaemonConfig],
        log_control: LogControl,
        response_store: ResponseStore | None = None,
        started_at: float | None = None,
    ) -> None:
        self._state = state
        self._response_store = response_store
        self._config = config
        self._log_control = log_control
        self._started_at = time.monotonic() if started_at is None else started_at
        self._version = _flare_version()

    def status(self) -> DaemonStatus:
        scheduler = self._state.require_scheduler()
        snapshot = scheduler.snapshot()
        grammars = scheduler.grammars.use() if scheduler.grammars is not None else CacheUse(0, 0)
        return DaemonStatus(
            package=self._state.model_name or "",
            uptime_s=round(time.monotonic() - self._started_at, 3),
            running=snapshot.running,
            waiting=snapshot.waiting,
            kv_blocks_used=snapshot.kv_blocks_used,
            kv_blocks_total=snapshot.kv_blocks_total,
            kv_cache_dtype=snapshot.kv_cache_dtype,
            kv_bytes_per_token=snapshot.kv_bytes_per_token,
            draining=snapshot.draining,
            device_statuses=dict(snapshot.device_statuses),
            weights_dtype=snapshot.weights_dtype,
            weight_format=snapshot.weight_format,
            activations=snapshot.activations,
            generated_tokens_per_s=round(snapshot.tokens_per_second, 2),
            log_level=self._log_control.level,
            pid=os.getpid(),
            version=self._version,
            prefix_cache=snapshot.prefix_cache,
            kv_blocks_cached=snapshot.kv_blocks_cached,
            kv_blocks_evictable=snapshot.kv_blocks_evictable,
            prompt_tokens_cached=snapshot.prompt_tokens_cached,
            prompt_tokens_computed=snapshot.prompt_tokens_computed,
            grammar_cache_entries=grammars.entries,
            grammar_cache_bytes=grammars.bytes,
            weight_types=snapshot.weight_types,
            ranks=[{"rank": rank, "pid": pid, "cpus": list(cpus)} for rank, pid, cpus in snapshot.ranks],
            responses_store=self._responses_store_use(),
            layer_calls=snapshot.layer_calls,
        )

    def _responses_store_use(self) -> dict[str, Any] | None:
        store = self._response_store
        if store is None:
            return None
        return {"path": str(store.path), **store.use().to_json()}

    def requests(self) -> Sequence[RequestRow]:
        return [
            RequestRow(r.request_id, r.state, round(r.age_s, 3), r.prompt_tokens, r.completion_tokens)
            for r in self._state.require_scheduler().requests()
        ]

    def cancel(self, request_id: str) -> bool:
        scheduler = self._state.require_scheduler()
        return scheduler.cancel(request_id, cancelled_failure("by the operator (flare ctl cancel)"))

    def drain(self) -> None:
        self._state.require_scheduler().drain()

    def resume(self) -> None:
        scheduler = self._state.require_scheduler()
        if self._state.is_stopping:
            # A SIGTERM drain is the end of this process: admitting again would only stretch it.
            raise ApiError(
                409,
                "the daemon is shutting down (SIGTERM); resume applies to `flare ctl drain` only",
                code="shutting_down",
            )
        scheduler.resume()

    def clear_prefix_cache(self) -> int:
        return self._state.require_scheduler().clear_prefix_cache()

    def clear_grammar_cache(self) -> CacheUse:
        grammars = self._state.require_scheduler().grammars
        return grammars.clear() if grammars is not None else CacheUse(0, 0)

    async def clear_responses(self) -> StoreUse:
        if self._response_store is None:
            raise ApiError(409, "the responses store is off (responses_store = false): nothing is stored", code="store_off")
        return await self._response_store.clear()

    def effective_config(self) -> Mapping[str, Any]:
        return dataclasses.asdict(self._config())

    def set_log_level(self, level: str) -> None:
        self._log_control.set_level(level)


def _flare_version() -> str:
    try:
        return importlib.metadata.version("flare")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"  # run from a source tree without `pip install`


class ControlSocketError(Exception):
    """The control socket cannot be created; the message names the path and the fix."""


# Values of these settings never leave the daemon: `flare ctl config` shows how many there are.
_SECRET_SETTING = re.compile(r"(^|_)(api_keys?|secrets?|passwords?)$")
REDACTED = "<redacted>"


def redact_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config as JSON values, secrets replaced by "<redacted>" (one per key in a list)."""
    shown: dict[str, Any] = {}
    for name, value in config.items():
        if _SECRET_SETTING.search(name) and isinstance(value, (str, list, tuple)):
            shown[name] = REDACTED if isinstance(value, str) else [REDACTED] * len(value)
        else:
            shown[name] = _json_value(value)
    return shown


def _json_value(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, Mapping):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_json_value(v) for v in value]
    return value


def bind_control_socket(path: Path) -> socket.socket:
    """A bound, not yet listening, AF_UNIX stream socket at `path`, mode 0660.

    The mode is set between bind() and listen(): until listen() the kernel refuses every
    connection, so there is no moment in which a wider umask-derived mode lets anyone in.
    A stale socket left by a daemon that died is replaced; a live one is an error.
    """
    try:
        path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
    except OSError as error:
        raise ControlSocketError(
            f"control socket {path}: cannot create its directory {path.parent} ({error.strerror}); "
            "create it writable for the daemon's user, or pass another --control-socket"
        ) from None
    _remove_stale_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.bind(os.fspath(path))
        os.chmod(path, SOCKET_MODE)
    except OSError as error:
        sock.close()
        reason = error.strerror or str(error)
        raise ControlSocketError(
            f"control socket {path}: cannot bind ({reason}); the directory must be writable for the "
            "daemon's user and the path shorter than 108 bytes, or pass another --control-socket"
        ) from None
    return sock


def _remove_stale_socket(path: Path) -> None:
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ControlSocketError(
            f"control socket {path}: the path exists and is not a socket; remove it or pass another --control-socket"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(os.fspath(path))
    except ConnectionRefusedError:
        path.unlink(missing_ok=True)  # nobody listens: left by a daemon that died
        return
    except OSError:
        pass
    finally:
        probe.close()
    raise ControlSocketError(
        f"control socket {path}: another process is listening on it (another flare daemon?); "
        "stop it or pass another --control-socket"
    )


_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_credentials(request: web.Request) -> tuple[int, int, int] | None:
    """(pid, uid, gid) of the process at the other end of the control connection."""
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return None
    pid, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid, uid, gid


@web.middleware
async def _log_command(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every command, answered, refused or failed, is logged with who sent it (the audit line),
    and every answer that is not a success is a JSON error body."""
    creds = peer_credentials(request)
    peer = {"peer_pid": creds[0], "peer_uid": creds[1], "peer_gid": creds[2]} if creds else {}
    status = 499  # the client went away before its answer (the handler was cancelled)
    try:
        response = await _answer(request, handler)
        status = response.status
        return response
    finally:
        level = log.info if status < 400 else log.warning
        level("control.command", method=request.method, path=request.path, status=status, **peer)


async def _answer(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as error:
        return error.response()
    except web.HTTPException as error:
        if error.status < 400:
            raise
        response = web.json_response(
            error_body(_http_error_message(request, error), type=INVALID_REQUEST, param=None, code=None),
            status=error.status,
        )
        if isinstance(error, web.HTTPMethodNotAllowed):
            response.headers["Allow"] = ", ".join(sorted(error.allowed_methods))
        return response
    except Exception:
        log.exception("control.error", method=request.method, path=request.path)
        return web.json_response(
            error_body(
                "internal error while handling the command; the daemon log has the details",
                type=SERVER_ERROR,
                param=None,
                code="internal_error",
            ),
            status=500,
        )


def _http_error_message(request: web.Request, error: web.HTTPException) -> str:
    if isinstance(error, web.HTTPNotFound):
        return f"no such control command: {request.method} {request.path}"
    if isinstance(error, web.HTTPMethodNotAllowed):
        return f"{request.method} is not allowed on {request.path}; use {', '.join(sorted(error.allowed_methods))}"
    if isinstance(error, web.HTTPRequestEntityTooLarge):
        return f"the command's body is larger than the limit of {CONTROL_MAX_BODY_BYTES} bytes"
    return error.reason


def control_app(target: ControlTarget) -> web.Application:
    async def status(_request: web.Request) -> web.Response:
        return web.json_response(dataclasses.asdict(target.status()))

    async def requests(_request: web.Request) -> web.Response:
        return web.json_response({"requests": [dataclasses.asdict(row) for row in target.requests()]})

    async def cancel(request: web.Request) -> web.Response:
        request_id = request.match_info["request_id"]
        if not target.cancel(request_id):
            raise ApiError(
                404,
                f"no waiting or running request has id {request_id!r}; `flare ctl requests` lists them",
                param="request_id",
                code="request_not_found",
            )
        log.info("control.cancelled", request_id=request_id)
        return web.json_response({"cancelled": request_id})

    async def drain(_request: web.Request) -> web.Response:
        target.drain()
        return web.json_response({"draining": True})

    async def resume(_request: web.Request) -> web.Response:
        target.resume()
        return web.json_response({"draining": False})

    async def clear_cache(_request: web.Request) -> web.Response:
        grammars = target.clear_grammar_cache()
        return web.json_response(
            {
                "dropped_blocks": target.clear_prefix_cache(),
                "dropped_grammars": grammars.entries,
                "dropped_grammar_bytes": grammars.bytes,
            }
        )

    async def clear_responses(_request: web.Request) -> web.Response:
        dropped = await target.clear_responses()
        log.info("control.responses_cleared", responses=dropped.responses, bytes=dropped.bytes)
        return web.json_response({"dropped_responses": dropped.responses, "dropped_bytes": dropped.bytes})

    async def config(_request: web.Request) -> web.Response:
        return web.json_response(redact_config(target.effective_config()))

    async def log_level(request: web.Request) -> web.Response:
        try:
            body: Any = parse_json_body(await request.read())
        except ApiError:
            body = None  # the message below says what is expected
        level = body.get("level") if isinstance(body, dict) else None
        if not isinstance(level, str):
            raise ApiError(400, 'expected a JSON body {"level": "debug|info|warning|error"}', param="level")
        try:
            target.set_log_level(level)
        except ValueError as error:
            raise ApiError(400, str(error), type=INVALID_REQUEST, param="level", code="invalid_log_level") from None
        log.info("control.log_level", log_level=level.lower())
        return web.json_response({"log_level": level.lower()})

    app = web.Application(middlewares=[_log_command], client_max_size=CONTROL_MAX_BODY_BYTES)
    app.add_routes(
        [
            web.get("/status", status),
            web.get("/requests", requests),
            web.post("/requests/{request_id}/cancel", cancel),
            web.post("/drain", drain),
            web.post("/resume", resume),
            web.post("/cache/clear", clear_cache),
            web.post("/responses/clear", clear_responses),
            web.get("/config", config),
            web.put("/log-level", log_level),
        ]
    )
    return app


async def serve_control(
    target: ControlTarget, path: Path, *, task_status: anyio.abc.TaskStatus[Path] = anyio.TASK_STATUS_IGNORED
) -> None:
    """Serve the control API on `path` until cancelled, then remove the socket file.
    Run it in the daemon's task group: `await task_group.start(serve_control, target, path)`."""
    sock = bind_control_socket(path)
    bound = os.stat(path)
    # The HTTP server's guard (connections.py), with the control socket's own limits: malformed
    # requests get a JSON 400 and are a (local) client's mistake, logged at info, rate-limited;
    # a head that does not arrive whole (HTTP/0.9, a silent connection) is closed in time.
    guard = ConnectionGuard(CONTROL_CONNECTION_LIMITS, ClientErrorLog())
    runner = GuardedAppRunner(control_app(target), guard, access_log=None, handle_signals=False)
    try:
        await runner.setup()
        # SockSite, not UnixSite: UnixSite binds and listens at once, before the mode can be set.
        await web.SockSite(runner, sock).start()
        log.info("control.listening", control_socket=os.fspath(path))
        task_status.started(path)
        await anyio.sleep_forever()
    finally:
        with anyio.CancelScope(shield=True):
            await runner.cleanup()
        sock.close()
        _unlink_if_ours(path, bound)


def _unlink_if_ours(path: Path, bound: os.stat_result) -> None:
    # A second daemon may have replaced a socket we thought stale; only remove our own file.
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return
    if (now.st_dev, now.st_ino) == (bound.st_dev, bound.st_ino):
        path.unlink(missing_ok=True)
