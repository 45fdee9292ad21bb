"""The reliability suite's helpers: the real daemon (tests/integration/daemon_process.py) with a
control socket, its `flare ctl status`, its resident memory, and a one-line figures summary."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

# The daemon helper lives with the integration tests; running tests/reliability alone must find it.

from tests.integration.daemon_process import DaemonProcess, start_daemon

from flare.cli.ctl import call

CHAT = [{"role": "user", "content": "Write a short poem about the sea."}]
ERROR_FIELDS = {"message", "type", "param", "code"}


class Daemon:
    """A started daemon with its control socket, its model name and the figures a test reports."""

    def __init__(self, process: DaemonProcess, control: Path) -> None:
        self.process = process
        self.control = control
        self.url = process.base_url
        flags = process.process.args
        # With --api-key, the model list needs the key too.
        self.headers = {"Authorization": f"Bearer {flags[flags.index('--api-key') + 1]}"} if "--api-key" in flags else {}
        self.model = httpx.get(f"{self.url}/v1/models", headers=self.headers, timeout=30).json()["data"][0]["id"]

    @property
    def pid(self) -> int:
        return self.process.process.pid

    def status(self) -> dict[str, Any]:
        """`flare ctl status --json`, through the same client function the command uses."""
        code, answer = call(self.control, "GET", "/status")
        assert code == 200, answer
        return answer

    def rss_kib(self) -> int:
        """The daemon's resident memory (VmRSS, KiB)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS line")

    def wait_idle(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """The status once nothing runs or waits (cancelled rows are freed within a round)."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.status()
            if status["running"] == 0 and status["waiting"] == 0 and status["kv_blocks_used"] == 0:
                return status
            if time.monotonic() > deadline:
                return status
            time.sleep(0.05)

    def body(self, **fields: Any) -> dict[str, Any]:
        return {
            "model": self.model,
            "messages": CHAT,
            "max_tokens": 8,
            "temperature": 0,
            **fields,
        }

    def serves(self) -> bool:
        """A normal request still succeeds."""
        response = httpx.post(f"{self.url}/v1/chat/completions", json=self.body(max_tokens=2), timeout=60)
        return response.status_code == 200 and response.json()["choices"][0]["finish_reason"] in ("stop", "length")


def launch(package: Path, tmp_path: Path, flags: Sequence[str] = ()) -> Daemon:
    control = tmp_path / "control.sock"
    process = start_daemon(package, ["--control-socket", str(control), *flags])
    try:
        return Daemon(process, control)
    except BaseException:
        process.kill()
        raise


def report(test: str, **figures: Any) -> None:
    """One line of figures per test (pytest -s shows it; docs/reliability.md quotes them)."""
    print(
        f"\nRELIABILITY {test}: " + " ".join(f"{k}={v}" for k, v in figures.items()),
        flush=True,
    )


def is_error_body(body: Any) -> bool:
    return isinstance(body, dict) and isinstance(body.get("error"), dict) and ERROR_FIELDS <= set(body["error"])


@dataclass
class Outcome:
    """What one client saw: the status line, the text, how it ended, and whether the answer was whole
    (a non-streaming JSON body that parsed; a stream that ended with `data: [DONE]`)."""

    status: int
    text: str = ""
    finish_reason: str | None = None
    error: dict[str, Any] | None = None
    complete: bool = False
    events: int = 0
    headers: dict[str, str] = field(default_factory=dict)


def _delta_text(chunk: dict[str, Any]) -> str:
    choice = chunk["choices"][0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def generate(
    http: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    drop_after_events: int | None = None,
) -> Outcome:
    """One request as a client sees it. `drop_after_events`: a streaming client that closes the
    connection after that many SSE events (0: before reading any)."""
    if not body.get("stream"):
        response = await http.post(path, json=body, headers=headers)
        outcome = Outcome(response.status_code, headers=dict(response.headers))
        answer = response.json()
        if response.status_code == 200:
            outcome.text = _delta_text(answer) or answer["choices"][0].get("message", {}).get("content", "")
            outcome.finish_reason = answer["choices"][0]["finish_reason"]
            outcome.complete = True
        else:
            outcome.error = answer.get("error")
        return outcome
    async with http.stream("POST", path, json=body, headers=headers) as response:
        outcome = Outcome(response.status_code, headers=dict(response.headers))
        if response.status_code != 200:
            outcome.error = json.loads(await response.aread()).get("error")
            return outcome
        texts = []
        async for line in response.aiter_lines():
            if not line:
                continue
            if drop_after_events is not None and outcome.events >= drop_after_events:
                return outcome  # leaving the block closes the connection mid-stream
            outcome.events += 1
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                outcome.complete = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                outcome.error = chunk["error"]
            elif chunk.get("choices"):
                texts.append(_delta_text(chunk))
                outcome.finish_reason = chunk["choices"][0].get("finish_reason") or outcome.finish_reason
        outcome.text = "".join(texts)
        return outcome


@dataclass
class Exchange:
    """What a raw client saw: the bytes answered, and whether (and after how long) the daemon
    closed the connection before the client gave up waiting."""

    answer: bytes
    closed: bool
    seconds: float
    answered_s: float | None = None  # when the first byte of the answer arrived

    @property
    def status(self) -> int | None:
        if not self.answer.startswith(b"HTTP/1."):
            return None
        return int(self.answer.split(b" ", 2)[1])

    def json(self) -> Any:
        return json.loads(self.answer.partition(b"\r\n\r\n")[2])


def whole_response(answer: bytes) -> bool:
    """Whether `answer` holds a whole HTTP response: its head and the Content-Length bytes after it."""
    head, separator, body = answer.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:] if separator else []:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return False


def exchange(
    port: int,
    data: bytes = b"",
    *,
    half_close: bool = False,
    wait_s: float = 30.0,
    drip_s: float = 0.0,
    until: Callable[[bytes], bool] | None = None,
) -> Exchange:
    """Send `data` on a fresh loopback connection (byte by byte every `drip_s` when given: a
    client that trickles), optionally half-close (SHUT_WR), and read until the daemon closes
    the connection, `wait_s` passes, or what has come answers `until` (e.g. `whole_response`:
    for a test about the answer, not about when the daemon closes)."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as sock:
        if drip_s:
            for index in range(len(data)):
                try:
                    sock.sendall(data[index : index + 1])
                except (BrokenPipeError, ConnectionResetError):
                    break
                time.sleep(drip_s)
                if time.monotonic() - started > wait_s:
                    break
        elif data:
            sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        chunks = []
        closed = False
        answered_s = None
        while True:
            sock.settimeout(max(0.01, wait_s - (time.monotonic() - started)))
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            except ConnectionResetError:
                closed = True
                break
            if not chunk:
                closed = True
                break
            if answered_s is None:
                answered_s = time.monotonic() - started
            chunks.append(chunk)
            if until is not None and until(b"".join(chunks)):
                break
    return Exchange(b"".join(chunks), closed, time.monotonic() - started, answered_s)


def port_of(daemon: Daemon) -> int:
    return int(daemon.url.rsplit(":", 1)[1])
