"""`flare run`: the daemon's life from start to exit.

Start: configure logging, bind the TCP listener first (so `/health` answers 503 while the
package loads), then open the package and load the scheduler off the event loop, warm it up,
and only then report ready (`/health` 200). One anyio task group on uvloop owns the scheduler
loop and the signal watcher; the HTTP site lives in an aiohttp runner beside them.

Stop (SIGTERM or SIGINT): /health turns 503, the scheduler admits nothing new (new requests get
503 with Retry-After), requests in flight get `drain_grace_s` to finish, the rest end with a
`shutdown` error event, every response is written out (for at most _FLUSH_TIMEOUT_S: a client
that does not read loses its answer), every connection still open is closed, and the process
exits 0, within `drain_grace_s + SHUTDOWN_MARGIN_S` whatever the clients do. A second signal
ends the grace period at once. A signal while loading exits at once: nothing was admitted yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import resource
import signal
import socket
import sqlite3
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import fields, replace
from functools import partial
from typing import TypeVar

import anyio
import structlog
import torch
from aiohttp import web

from flare.api.responses.store import FILE_NAME, ResponseStore, Retention
from flare.daemon.config import ConfigError, DaemonConfig, default_control_socket, default_state_dir, load_config
from flare.daemon.control import ControlSocketError, DaemonControl, serve_control
from flare.daemon.logging import LogControl, configure_logging
from flare.daemon.notify import SystemdNotifier, WatchdogHeartbeat, publish_status
from flare.package.chat_template import check_chat_template
from flare.package.directory import PackageError, open_package
from flare.parallel.failstop import EngineDead
from flare.parallel.launch import WorkerStartError
from flare.preparation.default_package import default_package_path
from flare.preparation.export import ExportError
from flare.preparation.source import SourceError
from flare.scheduler.metrics import SchedulerMetrics
from flare.scheduler.scheduler import Scheduler, SchedulerOptions
from flare.server.connections import ClientErrorLog, ConnectionGuard, ConnectionLimits, GuardedAppRunner
from flare.server.context import RESPONSE_STORE, SETTINGS
from flare.server.metrics import DaemonMetrics
from flare.server.routes import create_app
from flare.server.state import ServingState

log = structlog.get_logger("flare.daemon")

# systemd socket activation (sd_listen_fds(3)): passed sockets start at fd 3.
SD_LISTEN_FDS_START = 3
# How long finished handlers get to write their last bytes after the scheduler stopped.
_FLUSH_TIMEOUT_S = 5.0
# How long aiohttp's cleanup may wait for handlers once every connection has been aborted.
_CLOSE_TIMEOUT_S = 2.0
# Shutdown ends within drain_grace_s plus this: the flush, the close, and the interpreter's exit.
# flare.service's TimeoutStopSec= must exceed drain_grace_s + SHUTDOWN_MARGIN_S.
SHUTDOWN_MARGIN_S = 10.0
_POLL_S = 0.05
# What a reload (SIGHUP) changes in the running daemon; every other setting needs a restart.
RELOADABLE_SETTINGS = frozenset(
    {
        "log_level", "api_keys", "metrics_require_key", "max_waiting", "request_timeout_s", "drain_grace_s",
        "allowed_origins", "allowed_hosts", "prefix_cache_across_keys",
    }
)
# How often systemd's STATUS= line is refreshed (sent only when it changed).
STATUS_INTERVAL_S = 5.0

T = TypeVar("T")


class StartupError(Exception):
    """The daemon cannot start as configured; the message names the cause and the fix."""


def serve(
    config: DaemonConfig,
    environ: Mapping[str, str] | None = None,
    reload_config: Callable[[], DaemonConfig] | None = None,
) -> None:
    """Run the daemon until it is stopped. Raises StartupError when it cannot start.
    `reload_config` reads the settings again on SIGHUP (default: the environment and file only)."""
    daemon = Daemon(config, os.environ if environ is None else environ, reload_config)
    anyio.run(daemon.run, backend="asyncio", backend_options={"use_uvloop": True})
    # Every request has been answered ("stopped" is logged); what remains is interpreter
    # teardown, which can take a while on a loaded machine. A second SIGTERM or SIGINT in that
    # window (systemd, an impatient operator) must not turn a clean stop into death by signal.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _exit_now)


def _exit_now(signum: int, frame: object) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class Daemon:
    """Everything the running daemon owns, built once at start and passed down."""

    def __init__(
        self,
        config: DaemonConfig,
        environ: Mapping[str, str],
        reload_config: Callable[[], DaemonConfig] | None = None,
    ) -> None:
        self.config = config
        self.environ = environ
        self.reload_config = reload_config or partial(load_config, None, environ)
        self.notifier = SystemdNotifier(environ)
        self.metrics = DaemonMetrics.create()
        self.state = ServingState()
        self.connections = ConnectionGuard(ConnectionLimits.from_config(config), ClientErrorLog())
        self.app = create_app(config, self.state, self.metrics)
        self.log_control: LogControl | None = None
        self.response_store: ResponseStore | None = None
        self.scheduler: Scheduler | None = None
        self.address: tuple[str, int] | None = None  # (host, port) once listening
        self._stop_requested = anyio.Event()
        self._end_grace = anyio.Event()
        self._startup_error: StartupError | None = None
        self._engine_dead: EngineDead | None = None

    async def run(self) -> None:
        self.log_control = configure_logging(self.config.log_level, self.config.log_format, environ=self.environ)
        ensure_file_descriptors(self.connections.limits)
        self.response_store = self._open_response_store()
        if self.response_store is not None:
            self.app[RESPONSE_STORE] = self.response_store
        sock = self._listening_socket()
        runner = GuardedAppRunner(
            self.app, self.connections, handler_cancellation=True, access_log=None, shutdown_timeout=_CLOSE_TIMEOUT_S
        )
        await runner.setup()
        try:
            await web.SockSite(runner, sock).start()
            host, port = self.address = sock.getsockname()[:2]
            log.info("listening", host=host, port=port, max_connections=self.connections.limits.max_connections)
            self.state.loopback = _is_loopback(host)
            self._warn_if_exposed(host)
            if self.config.fault_injection:
                log.warning("fault_injection_enabled", message="X-Flare-Fault headers inject device statuses")
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(self._watch_signals, tasks.cancel_scope)
                tasks.start_soon(self._watch_reload)
                control = await self._start_control(tasks)
                await self._start_serving(tasks, control)
                await self._stop_requested.wait()
                await self._shut_down()
                tasks.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await runner.cleanup()
            sock.close()
            if self.response_store is not None:
                self.response_store.close()
        if self._startup_error is not None:
            raise self._startup_error
        if self._engine_dead is not None:
            log.error("stopped", reason=f"engine_dead: {self._engine_dead.reason}")
            raise self._engine_dead
        log.info("stopped")

    # --- start ---------------------------------------------------------------------------------

    def _open_response_store(self) -> ResponseStore | None:
        """The stored Responses' file under the state directory (none when the store is off)."""
        config = self.config
        if not config.responses_store:
            return None
        path = (config.state_dir or default_state_dir(self.environ)) / FILE_NAME
        try:
            store = ResponseStore(path, Retention(config.responses_store_max_age_s, config.responses_store_max_bytes))
        except (OSError, sqlite3.Error) as error:
            raise StartupError(
                f"responses store {path}: cannot open it ({error}); make its directory writable for the daemon's "
                "user, pass another --state-dir, or --responses-store off"
            ) from None
        use = store.use()
        log.info("responses_store_opened", path=str(path), responses=use.responses, bytes=use.bytes)
        return store

    def _listening_socket(self) -> socket.socket:
        """The socket systemd passed (socket activation), else one bound to --host/--port."""
        if self.environ.get("LISTEN_PID") == str(os.getpid()) and int(self.environ.get("LISTEN_FDS", "0") or 0) >= 1:
            sock = socket.socket(fileno=SD_LISTEN_FDS_START)
            sock.setblocking(False)
            return sock
        host, port = self.config.host, self.config.port
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            sock = socket.create_server((host, port), family=family, backlog=1024)
        except OSError as error:
            raise StartupError(
                f"cannot listen on {host}:{port} ({error.strerror or error}); "
                "choose another --port (0 picks a free one) or --host"
            ) from None
        sock.setblocking(False)
        return sock

    def _warn_if_exposed(self, host: str) -> None:
        if self.config.api_keys:
            return
        if not _is_loopback(host):
            log.warning(
                "listening_without_api_keys",
                host=host,
                message="anyone who can reach this address can use the model; set --api-key or --api-key-file",
            )

    async def _start_control(self, tasks: anyio.abc.TaskGroup) -> DaemonControl:
        """Serve `flare ctl` from the start (commands that need the model answer "loading" until
        it is ready). A socket that cannot be created is fatal only when it was configured."""
        assert self.log_control is not None
        control = DaemonControl(
            self.state, config=lambda: self.config, log_control=self.log_control, response_store=self.response_store
        )
        path = self.config.control_socket or default_control_socket(self.environ)
        try:
            await tasks.start(serve_control, control, path)
        except ControlSocketError as error:
            if self.config.control_socket is not None:
                raise StartupError(str(error)) from None
            log.warning("control_socket_unavailable", message=f"{error}; `flare ctl` cannot reach this daemon")
        return control

    async def _start_serving(self, tasks: anyio.abc.TaskGroup, control: DaemonControl) -> None:
        package = str(self.config.package) if self.config.package else "default"
        log.info("loading", package=package)
        self.notifier.status(f"loading {package}")
        try:
            scheduler = await _in_daemon_thread(self.load_scheduler)
        except StartupError as error:
            log.error("startup_failed", message=str(error))
            self._startup_error = error
            self._stop_requested.set()
            return
        self.scheduler = scheduler
        if isinstance(scheduler.observer, SchedulerMetrics) and scheduler.runner.rank_list():
            scheduler.observer.watch_ranks(scheduler.runner.rank_list)
        tasks.start_soon(self._run_scheduler, scheduler)
        await scheduler.warm_up()
        names = self.config.served_model_name or (scheduler.package.manifest.provenance.name,)
        self.state.ready(scheduler, names, accept_any_name=self.config.accept_any_model_name)
        log.info("ready", model=names[0], names=list(names), max_context=scheduler.max_context)
        self.notifier.ready()
        tasks.start_soon(publish_status, self.notifier, lambda: control.status().summary(), STATUS_INTERVAL_S)

    async def _run_scheduler(self, scheduler: Scheduler) -> None:
        """The scheduler's loop. A tensor-parallel group that lost a rank ends it (`EngineDead`:
        every request has ended with engine_dead): /health stops answering 200, the watchdog
        pings stop with the loop's heartbeats, and the daemon stops and exits non-zero, so that
        the supervisor restarts the whole group."""
        try:
            await scheduler.run()
        except EngineDead as error:
            self.state.stopping()
            self._engine_dead = error
            self._stop_requested.set()

    def load_scheduler(self) -> Scheduler:
        """Open and check the package, load its weights and size the KV cache (a worker thread)."""
        config = self.config
        try:
            path = config.package if config.package is not None else default_package_path(config.cache_dir)
            package = open_package(path)
        except (PackageError, SourceError, ExportError) as error:
            raise StartupError(str(error)) from None
        # The check export and inspect make too: a template that loops or explodes is refused here.
        unservable = check_chat_template(package.chat_template)
        if unservable is not None:
            raise StartupError(f"{path}: chat template: {unservable}")
        options = SchedulerOptions(
            max_concurrency=config.max_concurrency,
            max_waiting=config.max_waiting,
            max_batched_tokens=config.max_batched_tokens,
            oldest_prefill_share=config.oldest_prefill_share,
            prefix_cache=config.prefix_cache,
            kv_cache_memory=config.kv_cache_memory,
            draft_tokens=config.draft_tokens,
            drafter=config.drafter,
            draft_length=config.draft_length,  # type: ignore[arg-type]
            vocabulary_shards=config.vocabulary_shards,
            tensor_parallel=config.tensor_parallel,
            nnodes=config.nnodes,
            master_addr=config.master_addr,
            master_port=config.master_port,
            tensor_parallel_cpus=config.tensor_parallel_cpus,
            collective_timeout_s=config.collective_timeout_s,
            sampling_policy=config.sampling_policy,  # type: ignore[arg-type]
            on_invalid_speculation=config.on_invalid_speculation,  # type: ignore[arg-type]
            fault_injection=config.fault_injection,
            device=_device(config.device),
            weight_format=config.weight_format,
            activations=config.activations,
            kv_cache_dtype=config.kv_cache_dtype,
        )
        try:
            return Scheduler.from_package(
                package,
                options,
                observer=SchedulerMetrics(self.metrics.registry, max_draft_tokens=package.manifest.serving.draft_tokens),
                heartbeat=WatchdogHeartbeat(self.notifier),
            )
        except (PackageError, ValueError, WorkerStartError) as error:
            # The package's policy contradicts its sampler, or an option asks for more than the
            # package allows (--draft-tokens): the message names both and the fix.
            raise StartupError(str(error)) from None

    # --- stop ----------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Begin the orderly shutdown (what SIGTERM does once the daemon is ready)."""
        self._stop_requested.set()

    async def _watch_signals(self, scope: anyio.CancelScope) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("signal_received", signal=signal.Signals(signum).name)
                if self.scheduler is None:
                    self.notifier.stopping()
                    scope.cancel()  # still loading: nothing admitted, nothing to drain
                    return
                if self._stop_requested.is_set():
                    self._end_grace.set()
                self._stop_requested.set()

    async def _shut_down(self) -> None:
        self.notifier.stopping()
        scheduler = self.scheduler
        if scheduler is None:
            return
        self.state.stopping()
        scheduler.drain()
        in_flight = self.state.in_flight
        log.info("draining", in_flight=len(in_flight), grace_s=self.config.drain_grace_s)
        with anyio.move_on_after(self.config.drain_grace_s):
            while in_flight and not self._end_grace.is_set():
                await anyio.sleep(_POLL_S)
        if in_flight:
            log.warning("drain_grace_elapsed", ending=len(in_flight))
        # The loop ends after its current round and fails every request left with `shutdown`,
        # which their handlers write out as an error event (or body) before the connection closes.
        scheduler.stop()
        with anyio.move_on_after(_FLUSH_TIMEOUT_S):
            while in_flight:
                await anyio.sleep(_POLL_S)
        # What could not be written by now never will be (a client that does not read): close
        # every connection, so that aiohttp's cleanup has nothing left to wait for.
        aborted = self.connections.abort_all()
        if aborted:
            log.info("connections_closed", connections=aborted, unanswered=len(in_flight))

    # --- reload --------------------------------------------------------------------------------

    async def _watch_reload(self) -> None:
        with anyio.open_signal_receiver(signal.SIGHUP) as signals:
            async for _ in signals:
                await self.reload()

    async def reload(self) -> None:
        """Read the settings again and apply those that can change while running (SIGHUP).
        Settings that do not load are rejected whole: the running ones stay."""
        self.notifier.reloading()
        try:
            loaded = await anyio.to_thread.run_sync(self.reload_config)
        except ConfigError as error:
            log.error("reload_rejected", message=str(error))
        else:
            self._apply(loaded)
        finally:
            self.notifier.ready()

    def _apply(self, loaded: DaemonConfig) -> None:
        current = self.config
        needs_restart = [
            f.name
            for f in fields(DaemonConfig)
            if f.name not in RELOADABLE_SETTINGS and getattr(loaded, f.name) != getattr(current, f.name)
        ]
        applied = replace(loaded, **{name: getattr(current, name) for name in needs_restart})
        assert self.log_control is not None
        self.log_control.set_level(applied.log_level)
        self.app[SETTINGS].update(applied)
        if self.scheduler is not None:
            self.scheduler.options = replace(self.scheduler.options, max_waiting=applied.max_waiting)
        self.config = applied
        changed = sorted(name for name in RELOADABLE_SETTINGS if getattr(applied, name) != getattr(current, name))
        log.info("reloaded", changed=changed)  # names only, never a key
        if needs_restart:
            log.warning("reload_needs_restart", settings=needs_restart)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def ensure_file_descriptors(limits: ConnectionLimits) -> None:
    """Raise the soft file-descriptor limit so max_connections, plus a reserve for the control
    socket and the daemon's own files, fits under it; a hard limit too low is a startup error
    (without this, the connections could take every descriptor and starve `flare ctl`)."""
    needed = limits.file_descriptors_needed
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise StartupError(
            f"max_connections {limits.max_connections} needs {needed} file descriptors "
            f"(the connections plus a reserve of {needed - limits.max_connections}), but the limit is {hard}; "
            "lower --max-connections or raise the limit (LimitNOFILE= in flare.service, `ulimit -n`)"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def _device(choice: str) -> str:
    if choice != "auto":
        return choice
    return "cuda" if torch.cuda.is_available() else "cpu"


async def _in_daemon_thread(work: Callable[[], T]) -> T:
    """Run `work` in a daemon thread and await its result.

    Unlike anyio.to_thread, the thread does not hold the process open: a daemon stopped while
    it loads weights (or exports the default model) exits at once instead of after the load.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result, error = work(), None
        except BaseException as caught:  # handed to the awaiting task, which re-raises it
            result, error = None, caught
        with contextlib.suppress(RuntimeError):  # the loop is closed: the daemon has stopped
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="flare-load", daemon=True).start()
    return await future
