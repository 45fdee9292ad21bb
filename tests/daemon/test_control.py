"""The control socket and `flare ctl`, over a real UNIX socket, against a fake target."""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog

from flare.daemon.config import DaemonConfig
from flare.daemon.control import (
    ControlSocketError,
    ControlTarget,
    DaemonControl,
    DaemonStatus,
    RequestRow,
    bind_control_socket,
    redact_config,
    serve_control,
)
from flare.cli.ctl import (
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_UNREACHABLE,
    add_ctl_parser,
    call,
    resolve_socket,
    run_ctl,
)
from flare.api.errors import ApiError
from flare.daemon.logging import configure_logging
from flare.scheduler.request import RequestFailure
from flare.server.state import ServingState
from flare.structured import CacheUse


@dataclass
class FakeTarget:
    draining: bool = False
    log_level: str = "info"
    cache_cleared: int = 0
    cancelled: list[str] = field(default_factory=list)
    rows: list[RequestRow] = field(
        default_factory=lambda: [
            RequestRow("chatcmpl-a", "running", 12.5, 40, 17),
            RequestRow("chatcmpl-b", "waiting", 0.4, 1200, 0),
        ]
    )

    def status(self) -> DaemonStatus:
        return DaemonStatus(
            package="smollm2-135m",
            uptime_s=3725.0,
            running=1,
            waiting=1,
            kv_blocks_used=7,
            kv_blocks_total=64,
            kv_cache_dtype="float16",
            kv_bytes_per_token=1024,
            draining=self.draining,
            device_statuses={"OK": 90, "INVALID_SPECULATION": 2},
            weights_dtype="float32",
            weight_format="float16",
            activations="int8x2",
            generated_tokens_per_s=41.25,
            log_level=self.log_level,
            pid=1234,
            version="0.1.0",
            prefix_cache=True,
            kv_blocks_cached=20,
            kv_blocks_evictable=12,
            prompt_tokens_cached=3000,
            prompt_tokens_computed=1000,
            grammar_cache_entries=2,
            grammar_cache_bytes=14_200_000,
            weight_types={"Q4_1": {"tensors": 210, "bytes": 69_672_960}, "Q8_0": {"tensors": 1, "bytes": 30_081_024},
                          "F32": {"tensors": 61, "bytes": 140_544}},
            layer_calls="one call",
        )

    def requests(self) -> Sequence[RequestRow]:
        return [r for r in self.rows if r.request_id not in self.cancelled]

    def cancel(self, request_id: str) -> bool:
        if request_id not in {r.request_id for r in self.requests()}:
            return False
        self.cancelled.append(request_id)
        return True

    def drain(self) -> None:
        self.draining = True

    def resume(self) -> None:
        self.draining = False

    def clear_prefix_cache(self) -> int:
        self.cache_cleared += 1
        return 12

    def clear_grammar_cache(self) -> CacheUse:
        return CacheUse(3, 45_000_000)

    def effective_config(self) -> Mapping[str, Any]:
        return {
            "host": "127.0.0.1",
            "port": 8000,
            "package": Path("/var/lib/flare/smollm2"),
            "api_keys": ("sk-secret-one", "sk-secret-two"),
            "metrics_require_key": True,
            "request_timeout_s": None,
        }

    def set_log_level(self, level: str) -> None:
        if level.lower() not in ("debug", "info", "warning", "error"):
            raise ValueError(f"log level {level!r} is not one of debug, info, warning, error")
        self.log_level = level.lower()


@asynccontextmanager
async def control_server(target: ControlTarget, path: Path) -> AsyncIterator[Path]:
    async with anyio.create_task_group() as tg:
        await tg.start(serve_control, target, path)
        yield path
        tg.cancel_scope.cancel()


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="flare")
    add_ctl_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


@dataclass
class CtlResult:
    code: int
    out: str
    err: str


async def ctl(*argv: str) -> CtlResult:
    """Run `flare ctl ARGV` in a thread: the client is synchronous, the server is on this loop."""
    out, err = io.StringIO(), io.StringIO()
    args = parse(["ctl", *argv])
    code = await anyio.to_thread.run_sync(lambda: run_ctl(args, stdout=out, stderr=err, environ={}))
    return CtlResult(code, out.getvalue(), err.getvalue())


@pytest.fixture
def socket_path() -> Iterator[Path]:
    # AF_UNIX paths are limited to 108 bytes and pytest's tmp_path can be longer.
    short = Path(tempfile.mkdtemp(prefix="flare-ctl-", dir="/tmp"))
    yield short / "run" / "control.sock"
    shutil.rmtree(short)


async def test_status_json_has_the_documented_keys(socket_path: Path) -> None:
    async with control_server(FakeTarget(), socket_path):
        result = await ctl("--socket", str(socket_path), "--json", "status")
    assert result.code == EXIT_OK
    status = json.loads(result.out)
    for key in ("package", "uptime_s", "running", "waiting", "kv_blocks_used", "kv_blocks_total", "draining"):
        assert key in status
    assert status["device_statuses"] == {"OK": 90, "INVALID_SPECULATION": 2}
    assert status["package"] == "smollm2-135m" and status["kv_blocks_total"] == 64


async def test_status_table_is_readable(socket_path: Path) -> None:
    async with control_server(FakeTarget(), socket_path):
        result = await ctl("--socket", str(socket_path), "status")
    assert result.code == EXIT_OK
    lines = result.out.splitlines()
    assert "package          smollm2-135m" in lines
    assert "state            serving" in lines
    assert "uptime           1h02m05s" in lines
    assert "kv blocks        7 / 64 in use, float16, 1024 bytes a token" in lines
    assert "weights          Q4_1 Q8_0 blocks, the rest float32 stored, float16 GEMMs, int8x2 activations" in lines
    assert "weight types     Q4_1 210 tensors 69.7 MB, Q8_0 1 tensor 30.1 MB, F32 61 tensors 0.1 MB" in lines
    assert "layers           one call" in lines
    assert (
        "prefix cache     20 blocks cached, 12 of them evictable; prompt tokens 3000 from cache (75%), 1000 computed"
        in lines
    )
    assert "grammar cache    2 grammars, 14.2 MB" in lines
    assert "device statuses  OK 90, INVALID_SPECULATION 2" in lines


async def test_requests_lists_id_state_age_and_tokens(socket_path: Path) -> None:
    async with control_server(FakeTarget(), socket_path):
        table = await ctl("--socket", str(socket_path), "requests")
        as_json = await ctl("--socket", str(socket_path), "--json", "requests")
    assert table.out.splitlines() == [
        "ID          STATE    AGE    TOKENS IN  TOKENS OUT",
        "chatcmpl-a  running  12.5s  40         17",
        "chatcmpl-b  waiting  0.4s   1200       0",
    ]
    assert json.loads(as_json.out)["requests"][0] == {
        "request_id": "chatcmpl-a",
        "state": "running",
        "age_s": 12.5,
        "prompt_tokens": 40,
        "completion_tokens": 17,
    }


async def test_cancel_ends_the_named_request_and_refuses_an_unknown_one(socket_path: Path) -> None:
    target = FakeTarget()
    async with control_server(target, socket_path):
        done = await ctl("--socket", str(socket_path), "cancel", "chatcmpl-a")
        again = await ctl("--socket", str(socket_path), "--json", "cancel", "chatcmpl-a")
        remaining = await ctl("--socket", str(socket_path), "--json", "requests")
    assert done.code == EXIT_OK
    assert "cancelled request chatcmpl-a" in done.out
    assert target.cancelled == ["chatcmpl-a"]
    assert again.code == EXIT_REFUSED
    assert "no waiting or running request has id 'chatcmpl-a'" in again.err
    assert json.loads(again.out)["error"]["code"] == "request_not_found"
    assert [r["request_id"] for r in json.loads(remaining.out)["requests"]] == ["chatcmpl-b"]


async def test_drain_and_resume_toggle_admission(socket_path: Path) -> None:
    target = FakeTarget()
    async with control_server(target, socket_path):
        drained = await ctl("--socket", str(socket_path), "drain")
        assert target.draining
        status = await ctl("--socket", str(socket_path), "--json", "status")
        assert json.loads(status.out)["draining"] is True
        resumed = await ctl("--socket", str(socket_path), "--json", "resume")
    assert drained.code == EXIT_OK and "draining" in drained.out
    assert json.loads(resumed.out) == {"draining": False}
    assert not target.draining


async def test_cache_clear_drops_the_unused_cached_blocks(socket_path: Path) -> None:
    target = FakeTarget()
    async with control_server(target, socket_path):
        cleared = await ctl("--socket", str(socket_path), "cache", "clear")
        as_json = await ctl("--socket", str(socket_path), "cache", "clear", "--json")
    assert cleared.code == EXIT_OK and cleared.out.strip() == (
        "dropped 12 cached KV blocks that no request was using, and 3 cached grammars (45.0 MB)"
    )
    assert json.loads(as_json.out) == {"dropped_blocks": 12, "dropped_grammars": 3, "dropped_grammar_bytes": 45_000_000}
    assert target.cache_cleared == 2


async def test_config_is_shown_with_api_keys_redacted(socket_path: Path) -> None:
    async with control_server(FakeTarget(), socket_path):
        as_json = await ctl("--socket", str(socket_path), "--json", "config")
        table = await ctl("--socket", str(socket_path), "config")
    config = json.loads(as_json.out)
    assert config["api_keys"] == ["<redacted>", "<redacted>"]
    assert config["package"] == "/var/lib/flare/smollm2"
    assert config["metrics_require_key"] is True
    assert "sk-secret" not in as_json.out + table.out
    assert "request_timeout_s    -" in table.out.splitlines()


def test_redaction_covers_secret_names_but_not_flags_about_them() -> None:
    shown = redact_config({"api_key": "sk-1", "db_password": "pw", "metrics_require_key": False, "api_keys": []})
    assert shown == {"api_key": "<redacted>", "db_password": "<redacted>", "metrics_require_key": False, "api_keys": []}


async def test_log_level_changes_and_an_unknown_level_is_refused(socket_path: Path) -> None:
    target = FakeTarget()
    async with control_server(target, socket_path):
        changed = await ctl("--socket", str(socket_path), "log-level", "debug")
        status, answer = await anyio.to_thread.run_sync(
            lambda: call(socket_path, "PUT", "/log-level", {"level": "verbose"})
        )
        missing_body = await anyio.to_thread.run_sync(lambda: call(socket_path, "PUT", "/log-level", {}))
    assert changed.code == EXIT_OK and changed.out.strip() == "log level is now debug"
    assert target.log_level == "debug"
    assert status == 400
    assert answer["error"]["param"] == "level" and "debug, info, warning, error" in answer["error"]["message"]
    assert missing_body[0] == 400


def test_ctl_refuses_an_unknown_level_before_calling_the_daemon(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse(["ctl", "log-level", "verbose"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'verbose'" in capsys.readouterr().err


async def test_socket_is_mode_0660_in_a_created_directory_and_removed_at_stop(socket_path: Path) -> None:
    assert not socket_path.parent.exists()
    async with control_server(FakeTarget(), socket_path):
        mode = socket_path.stat().st_mode
        assert stat.S_ISSOCK(mode)
        assert stat.S_IMODE(mode) == 0o660
    assert not socket_path.exists()


async def test_every_command_is_logged_with_the_peer_credentials(socket_path: Path) -> None:
    with structlog.testing.capture_logs() as logs:
        async with control_server(FakeTarget(), socket_path):
            await ctl("--socket", str(socket_path), "drain")
            await ctl("--socket", str(socket_path), "cancel", "nope")
    commands = [entry for entry in logs if entry["event"] == "control.command"]
    assert [(c["method"], c["path"], c["status"]) for c in commands] == [
        ("POST", "/drain", 200),
        ("POST", "/requests/nope/cancel", 404),
    ]
    for command in commands:
        assert (command["peer_pid"], command["peer_uid"], command["peer_gid"]) == (
            os.getpid(),
            os.geteuid(),
            os.getegid(),
        )


async def test_missing_socket_names_the_path_and_the_fix(socket_path: Path) -> None:
    result = await ctl("--socket", str(socket_path), "status")
    assert result.code == EXIT_UNREACHABLE
    assert f"no control socket at {socket_path}" in result.err
    assert "is the daemon running" in result.err
    assert result.out == ""


async def test_stale_socket_is_reported_by_ctl_and_replaced_by_the_daemon(socket_path: Path) -> None:
    socket_path.parent.mkdir(parents=True)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(socket_path))
    dead.close()  # the file stays; nothing listens: what a killed daemon leaves behind
    result = await ctl("--socket", str(socket_path), "status")
    assert result.code == EXIT_UNREACHABLE and f"nothing listens on {socket_path}" in result.err
    async with control_server(FakeTarget(), socket_path):
        assert (await ctl("--socket", str(socket_path), "status")).code == EXIT_OK


async def test_a_second_daemon_cannot_take_a_live_socket(socket_path: Path) -> None:
    async with control_server(FakeTarget(), socket_path):
        with pytest.raises(ControlSocketError, match="another process is listening"):
            bind_control_socket(socket_path)
        assert (await ctl("--socket", str(socket_path), "status")).code == EXIT_OK


def test_a_path_that_is_not_a_socket_is_refused(socket_path: Path) -> None:
    socket_path.parent.mkdir(parents=True)
    socket_path.write_text("not a socket")
    with pytest.raises(ControlSocketError, match="exists and is not a socket"):
        bind_control_socket(socket_path)


def ctl_as_nobody(argv: list[str]) -> CtlResult:
    """Run `flare ctl ARGV` in a child process with uid/gid nobody (tests run as root in CI)."""
    args = parse(["ctl", *argv])
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to nobody, run, report, exit without running any cleanup
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            out, err = io.StringIO(), io.StringIO()
            code = run_ctl(args, stdout=out, stderr=err, environ={})
            os.write(write_end, json.dumps([code, out.getvalue(), err.getvalue()]).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        code, out, err = json.loads(pipe.read())
    os.waitpid(pid, 0)
    return CtlResult(code, out, err)


async def test_permission_denied_names_the_path_and_the_group_to_join(socket_path: Path) -> None:
    async with control_server(FakeTarget(), socket_path):
        if os.geteuid() == 0:
            result = await anyio.to_thread.run_sync(ctl_as_nobody, ["--socket", str(socket_path), "status"])
        else:
            os.chmod(socket_path, 0o060)  # an owner gets the owner's bits only: no access
            result = await ctl("--socket", str(socket_path), "status")
    assert result.code == EXIT_UNREACHABLE
    assert f"permission denied on {socket_path}" in result.err
    assert "member of that group" in result.err


def test_socket_resolution_prefers_flag_then_environment() -> None:
    assert resolve_socket("/x/flag.sock", {"FLARE_CONTROL_SOCKET": "/x/env.sock"}) == Path("/x/flag.sock")
    assert resolve_socket(None, {"FLARE_CONTROL_SOCKET": "/x/env.sock"}) == Path("/x/env.sock")


@dataclass(frozen=True)
class SchedulerSnapshot:  # the fields of flare.scheduler.stats.SchedulerSnapshot that control reads
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    draining: bool
    device_statuses: dict[str, int]
    tokens_per_second: float
    weights_dtype: str
    weight_format: str
    kv_cache_dtype: str
    activations: str
    kv_bytes_per_token: int
    prefix_cache: bool = True
    kv_blocks_cached: int = 5
    kv_blocks_evictable: int = 3
    prompt_tokens_cached: int = 160
    prompt_tokens_computed: int = 40
    weight_types: dict[str, dict[str, int]] = field(default_factory=lambda: {"F32": {"tensors": 3, "bytes": 12}})
    ranks: tuple[tuple[int, int, tuple[int, ...]], ...] = ((0, 4242, (0, 1)), (1, 4243, (2, 3)))
    layer_calls: str = "steps: a tensor-parallel rank sums each sublayer across the ranks"


@dataclass(frozen=True)
class RequestInfo:  # flare.scheduler.stats.RequestInfo
    request_id: str
    state: str
    age_s: float
    prompt_tokens: int
    completion_tokens: int


class FakeScheduler:
    """The scheduler's control surface (snapshot, requests, cancel, drain, resume, grammars)."""

    grammars = None  # a server without structured output

    def __init__(self) -> None:
        self.draining = False
        self.cancelled: dict[str, RequestFailure] = {}

    def snapshot(self) -> SchedulerSnapshot:
        return SchedulerSnapshot(
            running=2,
            waiting=0,
            kv_blocks_used=9,
            kv_blocks_total=128,
            draining=self.draining,
            device_statuses={"OK": 14},
            tokens_per_second=12.345,
            weights_dtype="float16",
            weight_format="float32",
            kv_cache_dtype="float32",
            activations="int8x2",
            kv_bytes_per_token=2048,
        )

    def requests(self) -> list[RequestInfo]:
        return [RequestInfo("r1", "running", 1.23456, 5, 6)]

    def cancel(self, request_id: str, failure: RequestFailure | None = None) -> bool:
        assert failure is not None
        self.cancelled[request_id] = failure
        return request_id == "r1"

    def drain(self) -> None:
        self.draining = True

    def resume(self) -> None:
        self.draining = False


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.reset_defaults()


@pytest.mark.usefixtures("restore_logging")
def test_daemon_control_reports_the_scheduler_and_cancels_with_an_operator_error() -> None:
    scheduler = FakeScheduler()
    log_control = configure_logging("warning", "json", stream=io.StringIO())
    state = ServingState()
    control = DaemonControl(state, config=lambda: DaemonConfig(api_keys=("sk-1",)), log_control=log_control)
    with pytest.raises(ApiError, match="still loading"):
        control.status()
    state.ready(scheduler, ("smollm2",))  # type: ignore[arg-type]
    status = control.status()
    assert (status.package, status.running, status.kv_blocks_used, status.kv_blocks_total) == ("smollm2", 2, 9, 128)
    assert status.generated_tokens_per_s == 12.35 and status.log_level == "warning"
    assert (status.weights_dtype, status.weight_format, status.kv_cache_dtype) == ("float16", "float32", "float32")
    assert status.activations == "int8x2"
    assert status.weight_types == {"F32": {"tensors": 3, "bytes": 12}}
    assert status.layer_calls == "steps: a tensor-parallel rank sums each sublayer across the ranks"
    assert status.summary() == "serving smollm2: 2 running, 0 waiting, 12.3 tokens/s"
    assert control.requests() == [RequestRow("r1", "running", 1.235, 5, 6)]
    assert control.cancel("r1")
    failure = scheduler.cancelled["r1"]
    assert failure.code == "cancelled" and "flare ctl cancel" in failure.message
    assert failure.http_status != 500
    control.drain()
    assert control.status().draining and control.status().summary().startswith("draining smollm2")
    control.resume()
    assert not scheduler.draining
    control.set_log_level("debug")
    assert log_control.level == "debug"
    assert redact_config(control.effective_config())["api_keys"] == ["<redacted>"]


@pytest.mark.usefixtures("restore_logging")
async def test_while_the_model_loads_ctl_says_so_and_config_still_answers(socket_path: Path) -> None:
    log_control = configure_logging("info", "json", stream=io.StringIO())
    control = DaemonControl(ServingState(), config=DaemonConfig, log_control=log_control)
    async with control_server(control, socket_path):
        status = await ctl("--socket", str(socket_path), "status")
        config = await ctl("--socket", str(socket_path), "--json", "config")
    assert status.code == EXIT_REFUSED
    assert "the model is still loading" in status.err
    assert config.code == EXIT_OK and json.loads(config.out)["port"] == 8000


def test_ctl_imports_neither_torch_nor_aiohttp() -> None:
    code = "import sys, flare.cli.ctl; print(sorted({'torch', 'aiohttp'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert result.stdout.strip() == "[]"


def test_json_is_accepted_after_the_command_too() -> None:
    from flare.cli.main import build_parser

    after = build_parser().parse_args(["ctl", "--socket", "/x", "status", "--json"])
    before = build_parser().parse_args(["ctl", "--json", "--socket", "/x", "status"])
    neither = build_parser().parse_args(["ctl", "status"])
    assert after.json and before.json and not neither.json


def test_ctl_status_shows_each_rank_with_its_pid_and_cpus() -> None:
    from flare.cli.ctl import render_status

    status = {
        "package": "p", "draining": False, "uptime_s": 1.0, "running": 0, "waiting": 0, "kv_blocks_used": 0,
        "kv_blocks_total": 8, "kv_cache_dtype": "float32", "weights_dtype": "float32", "weight_format": "float32",
        "generated_tokens_per_s": 0.0, "log_level": "info", "pid": 10, "version": "0", "device_statuses": {},
        "ranks": [{"rank": 0, "pid": 10, "cpus": [0, 1, 2, 5]}, {"rank": 1, "pid": 11, "cpus": [6, 7]}],
    }
    assert "0: pid 10, cpus 0-2,5; 1: pid 11, cpus 6-7" in render_status(status)
    del status["ranks"]
    assert "ranks" not in render_status(status)
