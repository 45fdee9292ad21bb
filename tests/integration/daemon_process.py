"""The real daemon as a subprocess: `flare run PACKAGE --port 0`, found through its `listening` log
line, ready when /health answers 200."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

STARTUP_TIMEOUT_S = 180.0


class DaemonProcess:
    def __init__(
        self,
        package: Path | None,
        *flags: str,
        env: dict[str, str] | None = None,
        wrapper: Sequence[str] = (),
        pass_fds: Sequence[int] = (),
    ) -> None:
        # `python -m flare.cli.main` is the `flare` console script without needing it installed.
        command = [sys.executable, "-m", "flare.cli.main", "run", "--port", "0", "--log-format", "json"]
        if package is not None:  # None: the default model
            command.append(str(package))
        # The daemon's state (the stored Responses) in a directory of its own, never the home's,
        # unless the test names one (--state-dir, FLARE_STATE_DIR).
        self._state = tempfile.TemporaryDirectory(prefix="flare-state-")
        self.process = subprocess.Popen(
            [*wrapper, *command, *flags],
            pass_fds=pass_fds,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "XDG_STATE_HOME": self._state.name, **(env or {})},
            cwd=Path(__file__).resolve().parents[2],
        )
        self.lines: list[str] = []
        self._port: int | None = None
        self._listening = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)
            event = _json_line(line)
            if event.get("event") == "listening":
                self._port = int(event["port"])
                self._listening.set()
        self._listening.set()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def events(self, name: str) -> list[dict]:
        return [e for e in map(_json_line, list(self.lines)) if e.get("event") == name]

    def wait_for_events(
        self, name: str, count: int = 1, where: Callable[[dict], bool] = lambda _: True, timeout_s: float = 10.0
    ) -> list[dict]:
        """The `name` events that match `where`, once there are at least `count`: a thread reads
        the daemon's log, so a line the daemon has just written (an audit or access line is
        written after its answer is sent) may not be in `lines` yet."""
        deadline = time.monotonic() + timeout_s
        while len(found := [e for e in self.events(name) if where(e)]) < count:
            assert time.monotonic() < deadline, f"{len(found)} of {count} {name} events in {timeout_s} s:\n{self.log()}"
            time.sleep(0.05)
        return found

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        self._listening.wait(STARTUP_TIMEOUT_S)
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the daemon exited with {self.process.returncode}:\n{self.log()}")
            if self._port is not None and self.health() == 200:
                return
            time.sleep(0.1)
        raise TimeoutError(f"the daemon was not ready within {STARTUP_TIMEOUT_S} s:\n{self.log()}")

    def model_name(self) -> str:
        """The model name the daemon serves (GET /v1/models)."""
        with urllib.request.urlopen(f"{self.base_url}/v1/models", timeout=30) as response:
            return json.load(response)["data"][0]["id"]

    def health(self) -> int | None:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=5) as response:
                return response.status
        except urllib.error.HTTPError as error:
            return error.code
        except OSError:
            return None

    def stop(self, signum: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signum)
        code = self.process.wait(timeout_s)
        self._reader.join(5)
        return code

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def log(self, last: int = 60) -> str:
        return "".join(self.lines[-last:])


def _json_line(line: str) -> dict:
    try:
        value = json.loads(line)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def start_daemon(
    package: Path | None,
    flags: Sequence[str] = (),
    env: dict[str, str] | None = None,
    wrapper: Sequence[str] = (),
    pass_fds: Sequence[int] = (),
) -> DaemonProcess:
    daemon = DaemonProcess(package, *flags, env=env, wrapper=wrapper, pass_fds=pass_fds)
    try:
        daemon.wait_ready()
    except BaseException:
        daemon.kill()
        raise
    return daemon
