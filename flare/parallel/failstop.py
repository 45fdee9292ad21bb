"""Fail-stop: the first failure of any rank stops the whole group.

No rank recovers a lost peer (neither does vLLM, SGLang or nano-vllm): a worker that dies, a
collective that times out or a round past its deadline leaves the shards of the model
inconsistent, so rank 0 records the first reason, ends every request with ``engine_dead``, and
exits non-zero so that the supervisor (systemd ``Restart=on-failure``) restarts the group.
Workers exit when rank 0 dies (launch.py), so a restart finds nothing left of the old group.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class EngineDead(RuntimeError):
    """The group stopped; ``reason`` says which rank and why."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"engine_dead: {reason}")
        self.reason = reason


class FailStop:
    """The group's stop latch: the first ``fail`` wins, runs the listeners once, and every later
    ``check`` raises EngineDead with that reason."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reason: str | None = None
        self._listeners: list[Callable[[str], None]] = []

    @property
    def reason(self) -> str | None:
        return self._reason

    def on_fail(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(reason)`` once at the first failure (at once if it already failed)."""
        with self._lock:
            if self._reason is None:
                self._listeners.append(listener)
                return
            reason = self._reason
        listener(reason)

    def fail(self, reason: str) -> None:
        with self._lock:
            if self._reason is not None:
                return
            self._reason = reason
            listeners, self._listeners = self._listeners, []
        for listener in listeners:
            listener(reason)

    def check(self) -> None:
        if self._reason is not None:
            raise EngineDead(self._reason)

    @contextmanager
    def deadline(self, seconds: float, what: str = "round") -> Iterator[None]:
        """Fail the group when the body has not finished within ``seconds`` (a collective that a
        dead host never answers, a rank stuck in a kernel); the body's own exception, if any,
        is left to the caller."""
        timer = threading.Timer(seconds, self.fail, args=(f"a {what} ran past its deadline of {seconds:g} s",))
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()

    def collective_failed(self, error: BaseException) -> EngineDead:
        """Record a collective's error (a timeout, a peer's closed connection) as the group's
        failure, and return the EngineDead to raise."""
        self.fail(f"a collective failed: {error}")
        assert self._reason is not None
        return EngineDead(self._reason)
