"""Fixtures of the reliability suite (helpers: reliability_daemon.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from tests.reliability.reliability_daemon import Daemon, launch


@pytest.fixture(scope="module")
def daemon_factory(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., Daemon]]:
    """launch(package, flags) for this module; every daemon is stopped (and must exit 0) at its end."""
    started: list[Daemon] = []

    def start(package: Path, flags: Sequence[str] = ()) -> Daemon:
        daemon = launch(package, tmp_path_factory.mktemp("daemon"), flags)
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        code = daemon.process.stop()
        assert code == 0, daemon.process.log()
