"""The sd_notify protocol, spoken directly over `NOTIFY_SOCKET` (no libsystemd).

systemd passes a datagram AF_UNIX socket address in `NOTIFY_SOCKET` (a path, or an abstract
name written with a leading '@'); each message is newline-separated `KEY=VALUE` assignments
in one datagram (sd_notify(3)). Without `NOTIFY_SOCKET` every call is a no-op, so the daemon
calls the notifier unconditionally.

The socket is non-blocking: a full receive queue drops the message (logged) rather than
stalling the event loop; a watchdog ping that is dropped is followed by the next one.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Mapping

import anyio
import structlog

log = structlog.get_logger(__name__)


def _socket_address(value: str) -> str | None:
    """The address to sendto() for a NOTIFY_SOCKET value, or None when it is not AF_UNIX."""
    if value.startswith("@"):
        return "\0" + value[1:]  # Linux abstract namespace
    if value.startswith("/"):
        return value
    return None  # e.g. "vsock:..." (systemd >= 254 in VMs): not spoken here


class SystemdNotifier:
    """Sends readiness, status, watchdog and lifecycle messages to the service manager."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self._socket_name = env.get("NOTIFY_SOCKET", "")
        self._address = _socket_address(self._socket_name) if self._socket_name else None
        if self._socket_name and self._address is None:
            log.warning("notify.unsupported_socket", notify_socket=self._socket_name)
        self._sock: socket.socket | None = None
        if self._address is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.setblocking(False)
        self._watchdog_usec = env.get("WATCHDOG_USEC", "")
        self._watchdog_pid = env.get("WATCHDOG_PID", "")

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, *assignments: str) -> bool:
        """Send one message; True when it was handed to the socket."""
        if self._sock is None or self._address is None:
            return False
        payload = "\n".join(assignments).encode()
        try:
            self._sock.sendto(payload, self._address)
        except OSError as exc:
            log.warning("notify.send_failed", notify_socket=self._socket_name, message=payload.decode(), error=str(exc))
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        return self.notify("READY=1", *([f"STATUS={status}"] if status is not None else []))

    def status(self, text: str) -> bool:
        # STATUS is one line in `systemctl status`; a newline would end the assignment early.
        return self.notify("STATUS=" + text.replace("\n", " "))

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")

    def reloading(self) -> bool:
        # systemd >= 253 (Type=notify-reload) wants the CLOCK_MONOTONIC time of the reload
        # start next to RELOADING=1, to tell this reload from a later one; older versions
        # ignore the extra field.
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def watchdog_interval(self) -> float | None:
        """Seconds between watchdog pings (half of WATCHDOG_USEC), or None when the service
        manager expects none: no WATCHDOG_USEC, or WATCHDOG_PID names another process."""
        if not self.enabled or not self._watchdog_usec:
            return None
        if self._watchdog_pid and self._watchdog_pid != str(os.getpid()):
            return None
        try:
            usec = int(self._watchdog_usec)
        except ValueError:
            log.warning("notify.bad_watchdog_usec", watchdog_usec=self._watchdog_usec)
            return None
        if usec <= 0:
            return None
        return usec / 1_000_000 / 2

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class WatchdogHeartbeat:
    """The scheduler loop's heartbeat: called once per loop iteration, it sends WATCHDOG=1 at
    most once per half watchdog interval. Because only the loop calls it, a round that hangs
    stops the pings and systemd restarts the service. Thread-safe (the loop may run in a
    worker thread)."""

    def __init__(self, notifier: SystemdNotifier, clock: Callable[[], float] = time.monotonic) -> None:
        self._notifier = notifier
        self._interval = notifier.watchdog_interval()
        self._clock = clock
        self._last: float | None = None
        self._lock = threading.Lock()

    @property
    def interval(self) -> float | None:
        """Seconds between pings; the scheduler loop must iterate at least this often, idle or not."""
        return self._interval

    def __call__(self) -> None:
        if self._interval is None:
            return
        now = self._clock()
        with self._lock:
            if self._last is not None and now - self._last < self._interval:
                return
            self._last = now
        self._notifier.watchdog()


async def publish_status(notifier: SystemdNotifier, summary: Callable[[], str], interval_s: float = 5.0) -> None:
    """Keep `systemctl status` current: send STATUS= every `interval_s` when the summary
    changed. Runs until cancelled; returns at once without a service manager."""
    if not notifier.enabled:
        return
    last: str | None = None
    while True:
        text = summary()
        if text != last:
            notifier.status(text)
            last = text
        await anyio.sleep(interval_s)
