"""`flare ctl`: steer a running daemon through its control socket.

    flare ctl [--socket PATH] [--json] status | requests | cancel ID | drain | resume
                                       | cache clear | responses clear | config | log-level LEVEL

Readable tables by default; `--json` prints the daemon's answer as JSON for scripts.

Exit codes:
    0  done
    1  the daemon refused the command (no such request, unknown log level); the reason is printed
    2  bad usage (argparse)
    3  the daemon cannot be reached: no socket, permission denied, nothing listening, no answer

The client is synchronous (http.client over an AF_UNIX socket): one request per run, and no
event loop to start. It imports neither torch nor aiohttp, so `flare ctl` answers at once.
"""

from __future__ import annotations

import argparse
import grp
import http.client
import json
import os
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import quote

from flare.daemon.config import SYSTEM_CONTROL_SOCKET, default_control_socket
from flare.daemon.logging import LOG_LEVELS

SOCKET_ENV = "FLARE_CONTROL_SOCKET"
EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_UNREACHABLE = 3
TIMEOUT_S = 10.0


class Unreachable(Exception):
    """The daemon cannot be reached; the message names the socket and the likely fix."""


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(os.fspath(self._path))
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def call(path: Path, method: str, url: str, body: Mapping[str, Any] | None = None) -> tuple[int, Any]:
    """One control request: (HTTP status, decoded JSON answer). Raises Unreachable."""
    connection = _UnixHTTPConnection(path, TIMEOUT_S)
    try:
        payload = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        connection.request(method, url, body=payload, headers=headers)
        response = connection.getresponse()
        raw = response.read()
    except FileNotFoundError:
        raise Unreachable(
            f"no control socket at {path}: is the daemon running (`systemctl status flare`)? "
            f"If it was started with --control-socket elsewhere, pass that path with --socket or {SOCKET_ENV}"
        ) from None
    except PermissionError:
        raise Unreachable(
            f"permission denied on {path}: the socket is mode 0660{_owner_group(path)}; run as root "
            "or as a member of that group (`sudo usermod -aG GROUP $USER`, then log in again)"
        ) from None
    except ConnectionRefusedError:
        raise Unreachable(
            f"nothing listens on {path}: the daemon that created it has exited; start it again "
            "(`systemctl start flare`) or remove the stale file"
        ) from None
    except TimeoutError:
        raise Unreachable(f"the daemon at {path} did not answer within {TIMEOUT_S:.0f}s") from None
    except (OSError, http.client.HTTPException) as error:
        raise Unreachable(f"control socket {path}: {error}") from None
    finally:
        connection.close()
    try:
        return response.status, json.loads(raw)
    except ValueError:
        raise Unreachable(f"control socket {path}: the answer is not JSON; is this a flare control socket?") from None


def _owner_group(path: Path) -> str:
    try:
        gid = path.stat().st_gid
    except OSError:
        return ""
    try:
        return f", group {grp.getgrgid(gid).gr_name}"
    except KeyError:
        return f", group id {gid}"


def resolve_socket(given: str | None, environ: Mapping[str, str]) -> Path:
    """--socket, else FLARE_CONTROL_SOCKET, else the system service's socket when it exists,
    else where a daemon started by this user would put it."""
    if given:
        return Path(given)
    if environ.get(SOCKET_ENV):
        return Path(environ[SOCKET_ENV])
    if SYSTEM_CONTROL_SOCKET.exists():
        return SYSTEM_CONTROL_SOCKET
    return default_control_socket(environ)


def add_ctl_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `ctl` to the `flare` command's subparsers; the parsed namespace carries
    `func=run_ctl`."""
    parser = subparsers.add_parser(
        "ctl",
        help="steer a running daemon through its control socket",
        description="Steer a running flare daemon through its UNIX control socket. "
        "Exit codes: 0 done, 1 refused by the daemon, 2 bad usage, 3 daemon unreachable.",
    )
    parser.add_argument(
        "--socket",
        metavar="PATH",
        help=f"the control socket (default: ${SOCKET_ENV}, else {SYSTEM_CONTROL_SOCKET} when it exists, "
        "else $XDG_RUNTIME_DIR/flare/control.sock)",
    )
    parser.add_argument("--json", action="store_true", help="print the daemon's answer as JSON")
    # --json is accepted after the command too (`flare ctl status --json`); SUPPRESS keeps an
    # absent one from resetting a --json given before the command.
    json_after = argparse.ArgumentParser(add_help=False)
    json_after.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")
    commands = parser.add_subparsers(dest="ctl_command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=help, parents=[json_after])

    command("status", "package, uptime, requests, KV blocks, draining, device statuses")
    command("requests", "waiting and running requests: id, state, age, tokens in and out")
    cancel = command("cancel", "end one request; its client gets a 'cancelled' error")
    cancel.add_argument("request_id", metavar="ID")
    command("drain", "stop admitting requests (503, /health 503); in-flight ones go on")
    command("resume", "admit requests again after a drain")
    cache = command("cache", "the prefix cache: `cache clear` drops every cached KV block no request uses")
    cache.add_argument("cache_action", choices=("clear",), metavar="clear")
    responses = command("responses", "the stored Responses: `responses clear` deletes every one")
    responses.add_argument("responses_action", choices=("clear",), metavar="clear")
    command("config", "the effective configuration, API keys redacted")
    level = command("log-level", "change the log level at run time")
    level.add_argument("level", choices=LOG_LEVELS, metavar="LEVEL", help=" | ".join(LOG_LEVELS))
    parser.set_defaults(func=run_ctl)
    return parser


_REQUESTS: dict[str, tuple[str, str]] = {
    "status": ("GET", "/status"),
    "requests": ("GET", "/requests"),
    "drain": ("POST", "/drain"),
    "resume": ("POST", "/resume"),
    "cache": ("POST", "/cache/clear"),
    "responses": ("POST", "/responses/clear"),
    "config": ("GET", "/config"),
}


def run_ctl(
    args: argparse.Namespace,
    *,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    environ: Mapping[str, str] | None = None,
) -> int:
    out = sys.stdout if stdout is None else stdout
    err = sys.stderr if stderr is None else stderr
    path = resolve_socket(args.socket, os.environ if environ is None else environ)
    command: str = args.ctl_command
    body: dict[str, Any] | None = None
    if command == "cancel":
        method, url = "POST", f"/requests/{quote(args.request_id, safe='')}/cancel"
    elif command == "log-level":
        method, url, body = "PUT", "/log-level", {"level": args.level}
    else:
        method, url = _REQUESTS[command]
    try:
        status, answer = call(path, method, url, body)
    except Unreachable as error:
        print(f"flare ctl: {error}", file=err)
        return EXIT_UNREACHABLE
    if status >= 400:
        message = answer.get("error", {}).get("message") if isinstance(answer, dict) else None
        if args.json:
            print(json.dumps(answer, indent=2), file=out)
        print(f"flare ctl {command}: {message or f'the daemon answered HTTP {status}'}", file=err)
        return EXIT_REFUSED
    print(json.dumps(answer, indent=2) if args.json else render(command, answer), file=out)
    return EXIT_OK


def render(command: str, answer: Any) -> str:
    """The readable form of a command's answer."""
    if command == "status":
        return render_status(answer)
    if command == "requests":
        return _render_requests(answer["requests"])
    if command == "config":
        return _table([(name, _scalar(value)) for name, value in answer.items()])
    if command == "cancel":
        return f"cancelled request {answer['cancelled']}; its client gets a 'cancelled' error"
    if command == "drain":
        return "draining: new requests get 503 and /health answers 503; in-flight requests go on"
    if command == "resume":
        return "admitting requests again"
    if command == "cache":
        dropped = f"dropped {answer['dropped_blocks']} cached KV blocks that no request was using"
        if "dropped_grammars" not in answer:  # a daemon older than its `flare ctl`
            return dropped
        return f"{dropped}, and {answer['dropped_grammars']} cached grammars ({_megabytes(answer['dropped_grammar_bytes'])})"
    if command == "responses":
        return f"deleted {answer['dropped_responses']} stored responses ({_megabytes(answer['dropped_bytes'])})"
    if command == "log-level":
        return f"log level is now {answer['log_level']}"
    raise ValueError(f"no rendering for {command!r}")


def _render_weight_types(types: Mapping[str, Mapping[str, int]]) -> str:
    """`Q4_1 210 tensors 87.1 MB, F32 61 tensors 0.1 MB`, largest first, as the daemon sent it."""
    return ", ".join(
        f"{kind} {total['tensors']} tensor{'s' if total['tensors'] != 1 else ''} {total['bytes'] / 1e6:,.1f} MB"
        for kind, total in types.items()
    ) or "unknown"


_FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})


def _render_weights(status: Mapping[str, Any]) -> str:
    """`float16 stored, float16 GEMMs`; a package that keeps ggml blocks names their types first,
    as `flare export` does: `Q4_1 Q8_0 blocks, the rest float32 stored, ...`."""
    blocks = [kind for kind in status.get("weight_types") or {} if kind not in _FLOAT_TYPES]
    stored = f"{' '.join(sorted(blocks))} blocks, the rest {status['weights_dtype']}" if blocks else status["weights_dtype"]
    activations = status.get("activations")
    products = f", {activations} activations" if blocks and activations else ""
    return f"{stored} stored, {status['weight_format']} GEMMs{products}"


def render_status(status: Mapping[str, Any]) -> str:
    statuses = status["device_statuses"]
    rows = [
        ("package", status["package"]),
        ("state", "draining" if status["draining"] else "serving"),
        ("uptime", _duration(status["uptime_s"])),
        ("running", str(status["running"])),
        ("waiting", str(status["waiting"])),
        ("kv blocks", f"{status['kv_blocks_used']} / {status['kv_blocks_total']} in use, {status['kv_cache_dtype']}"
                      + (f", {status['kv_bytes_per_token']} bytes a token" if "kv_bytes_per_token" in status else "")),
        ("weights", _render_weights(status)),
        ("weight types", _render_weight_types(status.get("weight_types") or {})),
        *([("layers", status["layer_calls"])] if status.get("layer_calls") else []),
        ("prefix cache", _render_prefix_cache(status)),
        ("grammar cache", _render_grammar_cache(status)),
        ("responses store", _render_responses_store(status.get("responses_store"))),
        ("tokens/s", f"{status['generated_tokens_per_s']:.1f}"),
        ("log level", status["log_level"]),
        ("pid", str(status["pid"])),
        *(
            [("ranks", "; ".join(f"{r['rank']}: pid {r['pid']}, cpus {_cpu_list(r['cpus'])}" for r in status["ranks"]))]
            if status.get("ranks")
            else []
        ),
        ("version", status["version"]),
        (
            "device statuses",
            ", ".join(f"{name} {count}" for name, count in statuses.items() if count) or "none",
        ),
    ]
    return _table(rows)


def _render_responses_store(store: Mapping[str, Any] | None) -> str:
    if store is None:
        return "off"
    oldest = store["oldest_created_at"]
    since = "" if oldest is None else f", oldest {_duration(max(0.0, time.time() - oldest))} old"
    return f"{store['responses']} responses, {_megabytes(store['bytes'])}{since} ({store['path']})"


def _cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for cpu in cpus:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _render_prefix_cache(status: Mapping[str, Any]) -> str:
    if not status.get("prefix_cache"):
        return "off"
    cached, computed = status["prompt_tokens_cached"], status["prompt_tokens_computed"]
    share = f" ({100 * cached / (cached + computed):.0f}%)" if cached + computed else ""
    return (
        f"{status['kv_blocks_cached']} blocks cached, {status['kv_blocks_evictable']} of them evictable; "
        f"prompt tokens {cached} from cache{share}, {computed} computed"
    )


def _render_grammar_cache(status: Mapping[str, Any]) -> str:
    # A daemon older than its `flare ctl` does not report it.
    if "grammar_cache_entries" not in status:
        return "-"
    return f"{status['grammar_cache_entries']} grammars, {_megabytes(status['grammar_cache_bytes'])}"


def _megabytes(count: int) -> str:
    return f"{count / 1e6:.1f} MB"


def _render_requests(rows: Sequence[Mapping[str, Any]]) -> str:
    if not rows:
        return "no waiting or running requests"
    header = ("ID", "STATE", "AGE", "TOKENS IN", "TOKENS OUT")
    body = [
        (r["request_id"], r["state"], _duration(r["age_s"]), str(r["prompt_tokens"]), str(r["completion_tokens"]))
        for r in rows
    ]
    widths = [max(len(row[i]) for row in (header, *body)) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in (header, *body))


def _table(rows: Sequence[tuple[str, str]]) -> str:
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name.ljust(width)}  {value}" for name, value in rows)


def _scalar(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d{hours:02d}h{minutes:02d}m"
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s"
