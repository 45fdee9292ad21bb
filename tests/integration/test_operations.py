"""The real daemon operated as systemd and an operator would: readiness, watchdog and status
over a notify socket, `flare ctl` over the control socket, reload on SIGHUP, metrics, stop."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.integration.daemon_process import DaemonProcess

from flare.cli import ctl

EOS = 2  # <|im_end|>: SmolLM2's end of text, and so the tiny package's

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 90.0


class NotifyListener:
    """What systemd would receive on NOTIFY_SOCKET, in order."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(path))
        self._sock.settimeout(0.2)
        self.messages: list[list[str]] = []
        self._changed = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while not self._closed:
            try:
                data = self._sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            with self._changed:
                self.messages.append(data.decode().split("\n"))
                self._changed.notify_all()

    def wait_for(self, assignment: str, after: int = 0, timeout_s: float = TIMEOUT_S) -> int:
        """The index of the first message at or after `after` with a line starting with `assignment`."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                for index in range(after, len(self.messages)):
                    if any(line.startswith(assignment) for line in self.messages[index]):
                        return index
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {assignment} on the notify socket; got {self.messages}")
                self._changed.wait(left)

    def close(self) -> None:
        self._closed = True
        self._thread.join(5)
        self._sock.close()


class Operated:
    def __init__(self, daemon: DaemonProcess, notify: NotifyListener, control: Path, config: Path) -> None:
        self.daemon = daemon
        self.notify = notify
        self.control = control
        self.config = config

    def model(self) -> str:
        """The served model name, as /v1/models lists it."""
        status, body = self.get("/v1/models")
        assert status == 200, body
        return str(json.loads(body)["data"][0]["id"])

    def ctl(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "flare.cli.main", "ctl", "--socket", str(self.control), *argv],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            check=False,
        )

    def ctl_json(self, *argv: str) -> Any:
        result = self.ctl("--json", *argv)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.daemon.base_url + path, timeout=30) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    def chat(self, content: str = "Hello", max_tokens: int = 8) -> tuple[int, dict[str, Any]]:
        body = {"model": self.model(), "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
        request = urllib.request.Request(
            self.daemon.base_url + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    def stream(self, max_tokens: int, fault: str | None = None, **fields: Any) -> Any:
        """An open SSE response of a streamed chat completion (read it line by line); `fields`
        join the request body."""
        body = {
            "model": self.model(),
            "messages": [{"role": "user", "content": "Tell me a long story"}],
            "max_tokens": max_tokens,
            "stream": True,
            **fields,
        }
        headers = {"Content-Type": "application/json", **({"X-Flare-Fault": fault} if fault else {})}
        request = urllib.request.Request(
            self.daemon.base_url + "/v1/chat/completions", data=json.dumps(body).encode(), headers=headers
        )
        return urllib.request.urlopen(request, timeout=120)

    def last_event(self, name: str, after: int = 0, **fields: Any) -> dict[str, Any]:
        """The latest log event `name` with these fields, past the first `after` of its kind
        (another thread reads the log: wait for it)."""
        deadline = time.monotonic() + 10
        while True:
            events = self.daemon.events(name)[after:]
            if matching := [e for e in events if all(e.get(k) == v for k, v in fields.items())]:
                return matching[-1]
            assert time.monotonic() < deadline, f"no {name} event with {fields}"
            time.sleep(0.05)

    def metric(self, name: str, **labels: str) -> float:
        _, text = self.get("/metrics")
        wanted = name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
        for line in text.splitlines():
            if line.startswith(wanted + " "):
                return float(line.split()[-1])
        return 0.0


@pytest.fixture(scope="module")
def operated(tiny_package: Path) -> Iterator[Operated]:
    # AF_UNIX paths are limited to 108 bytes: a short directory rather than pytest's tmp_path.
    workdir = Path(tempfile.mkdtemp(prefix="flare-ops-", dir="/tmp"))
    notify = NotifyListener(workdir / "notify.sock")
    control = workdir / "run" / "control.sock"
    config = workdir / "flare.toml"
    config.write_text('log_level = "info"\n')
    daemon = DaemonProcess(
        tiny_package,
        "--fault-injection",
        "--config",
        str(config),
        "--control-socket",
        str(control),
        env={"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "2000000"},
    )
    try:
        yield Operated(daemon, notify, control, config)
    finally:
        daemon.kill()
        notify.close()
        shutil.rmtree(workdir)


def test_ready_is_notified_only_once_health_answers_200(operated: Operated) -> None:
    ready = operated.notify.wait_for("READY=1")
    assert operated.get("/health")[0] == 200
    loading = operated.notify.wait_for("STATUS=loading", timeout_s=0)
    assert loading < ready
    serving = operated.notify.wait_for(
        f"STATUS=serving {operated.model()}: 0 running, 0 waiting", after=ready, timeout_s=10
    )
    assert serving > ready


def test_watchdog_is_pinged_from_the_scheduler_loop(operated: Operated) -> None:
    ready = operated.notify.wait_for("READY=1")
    first = operated.notify.wait_for("WATCHDOG=1", after=ready, timeout_s=30)
    operated.notify.wait_for("WATCHDOG=1", after=first + 1, timeout_s=30)


def test_status_json_has_the_documented_keys_and_the_socket_is_0660(operated: Operated) -> None:
    operated.notify.wait_for("READY=1")
    status = operated.ctl_json("status")
    for key in (
        "package",
        "uptime_s",
        "running",
        "waiting",
        "kv_blocks_used",
        "kv_blocks_total",
        "kv_cache_dtype",
        "draining",
        "device_statuses",
    ):
        assert key in status
    assert status["running"] == 0 and status["draining"] is False and status["kv_blocks_total"] > 0
    assert status["kv_cache_dtype"] == "float32"  # the default
    assert stat.S_IMODE(operated.control.stat().st_mode) == 0o660
    table = operated.ctl("status")
    assert table.returncode == 0 and "kv blocks" in table.stdout


def test_drain_refuses_new_requests_and_resume_admits_them_again(operated: Operated) -> None:
    operated.notify.wait_for("READY=1")
    assert operated.ctl_json("drain") == {"draining": True}
    try:
        assert operated.get("/health")[0] == 503
        status, body = operated.chat()
        assert status == 503 and body["error"]["code"] == "draining"
        assert operated.ctl_json("status")["draining"] is True
    finally:
        assert operated.ctl_json("resume") == {"draining": False}
    assert operated.get("/health")[0] == 200
    assert operated.chat()[0] == 200


def test_requests_config_and_unknown_cancel(operated: Operated) -> None:
    operated.notify.wait_for("READY=1")
    assert operated.ctl_json("requests") == {"requests": []}
    config = operated.ctl_json("config")
    assert config["control_socket"] == str(operated.control)
    missing = operated.ctl("cancel", "no-such-request")
    assert missing.returncode == 1 and "no-such-request" in missing.stderr


def test_metrics_move_as_requests_run(operated: Operated) -> None:
    operated.notify.wait_for("READY=1")
    generated = operated.metric("flare_generated_tokens_total")
    answered = operated.metric("flare_http_requests_total", endpoint="/v1/chat/completions", outcome="success")
    status, body = operated.chat(max_tokens=4)
    assert status == 200
    assert operated.metric("flare_generated_tokens_total") == generated + body["usage"]["completion_tokens"]
    assert (
        operated.metric("flare_http_requests_total", endpoint="/v1/chat/completions", outcome="success") == answered + 1
    )
    assert operated.metric("flare_kv_blocks_total") > 0
    access = operated.last_event("access", path="/v1/chat/completions")
    assert access["status"] == 200 and access["method"] == "POST" and access["request_id"]
    assert access["completion_tokens"] == body["usage"]["completion_tokens"]
    assert access["prompt_tokens"] == body["usage"]["prompt_tokens"]
    assert access["ttft_ms"] <= access["duration_ms"]


def sse_events(response: Any) -> list[Any]:
    events = []
    for raw in response:
        line = raw.decode().strip()
        if line.startswith("data: "):
            events.append(line.removeprefix("data: "))
    return events


def test_cancel_ends_a_running_stream_with_a_cancelled_error(operated: Operated) -> None:
    operated.notify.wait_for("READY=1")
    cancelled_before = operated.metric(
        "flare_http_requests_total", endpoint="/v1/chat/completions", outcome="cancelled"
    )
    # 400 tokens with the end-of-text token forbidden: a second or more of generation on the
    # fastest CPU here (the tiny random model otherwise ends some answers after a few dozen
    # tokens). The listing is read through the socket in this process, as `flare ctl requests`
    # reads and renders it, so that only the cancel pays for starting a `flare ctl` process. On a
    # loaded machine even that can outlast the answer: the CLI then says the id is gone, and the
    # test sends another request, up to three.
    for _ in range(3):
        with operated.stream(max_tokens=400, logit_bias={str(EOS): -100}) as response:
            response.readline()  # the first chunk: the request is running
            status, listing = ctl.call(operated.control, "GET", "/requests")
            assert status == 200, listing
            [row] = listing["requests"]
            assert row["state"] == "running" and row["prompt_tokens"] > 0
            assert row["request_id"] in ctl.render("requests", listing)
            cancel = operated.ctl("--json", "cancel", row["request_id"])
            events = sse_events(response)
        if cancel.returncode == 0:
            break
        assert "no waiting or running request has id" in cancel.stderr, cancel.stderr
    assert json.loads(cancel.stdout) == {"cancelled": row["request_id"]}
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "cancelled" and "flare ctl cancel" in error["message"]
    assert operated.ctl_json("requests") == {"requests": []}
    assert (
        operated.metric("flare_http_requests_total", endpoint="/v1/chat/completions", outcome="cancelled")
        == cancelled_before + 1
    )


def test_a_failed_stream_is_counted_as_failed_with_its_device_status(operated: Operated) -> None:
    operated.notify.wait_for("READY=1")
    failed = operated.metric("flare_http_requests_total", endpoint="/v1/chat/completions", outcome="failed")
    nonfinite = operated.metric("flare_device_statuses_total", status="NONFINITE_LOGITS")
    with operated.stream(max_tokens=8, fault="NONFINITE_LOGITS") as response:
        events = sse_events(response)
    assert json.loads(events[-2])["error"]["code"] == "NONFINITE_LOGITS"
    assert operated.metric("flare_http_requests_total", endpoint="/v1/chat/completions", outcome="failed") == failed + 1
    assert operated.metric("flare_device_statuses_total", status="NONFINITE_LOGITS") == nonfinite + 1
    assert operated.ctl_json("status")["device_statuses"]["NONFINITE_LOGITS"] >= 1


def test_sighup_reloads_the_log_level_and_rejects_a_bad_file(operated: Operated) -> None:
    operated.notify.wait_for("READY=1")
    process = operated.daemon.process
    operated.config.write_text('log_level = "debug"\n')
    before = len(operated.notify.messages)
    process.send_signal(signal.SIGHUP)
    reloading = operated.notify.wait_for("RELOADING=1", after=before)
    operated.notify.wait_for("READY=1", after=reloading)
    assert operated.ctl_json("status")["log_level"] == "debug"

    operated.config.write_text('log_level = "loud"\n')
    before = len(operated.notify.messages)
    process.send_signal(signal.SIGHUP)
    reloading = operated.notify.wait_for("RELOADING=1", after=before)
    operated.notify.wait_for("READY=1", after=reloading)
    assert operated.ctl_json("status")["log_level"] == "debug"
    assert "log_level" in operated.last_event("reload_rejected")["message"]
    operated.config.write_text('log_level = "info"\n')


def test_sighup_swaps_api_keys_without_a_restart(operated: Operated) -> None:
    operated.notify.wait_for("READY=1")

    def reload(toml: str) -> None:
        operated.config.write_text(toml)
        before = len(operated.notify.messages)
        operated.daemon.process.send_signal(signal.SIGHUP)
        operated.notify.wait_for("READY=1", after=operated.notify.wait_for("RELOADING=1", after=before))

    pid = operated.daemon.process.pid
    seen = len(operated.daemon.events("reload_needs_restart"))
    reload('api_keys = ["sk-reloaded"]\nmax_body_bytes = "2MiB"\nport = 1\n')
    try:
        status, body = operated.get("/v1/models")
        assert status == 401 and "API key" in body
        assert operated.get("/health")[0] == 200  # still public
        assert operated.ctl_json("config")["api_keys"] == ["<redacted>"]
        # --port on the command line outranks the file: only max_body_bytes changed, and it needs a restart.
        assert operated.last_event("reload_needs_restart", after=seen)["settings"] == ["max_body_bytes"]
    finally:
        reload('log_level = "info"\n')
    assert operated.get("/v1/models")[0] == 200
    assert operated.daemon.process.pid == pid and operated.daemon.process.poll() is None


def test_sigterm_notifies_stopping_exits_0_and_removes_the_control_socket(operated: Operated) -> None:
    operated.notify.wait_for("READY=1")
    before = len(operated.notify.messages)
    assert operated.daemon.stop(signal.SIGTERM) == 0
    operated.notify.wait_for("STOPPING=1", after=before, timeout_s=5)
    assert not operated.control.exists()
    assert os.path.exists(operated.notify.path)
