"""Fixtures of the integration tests that talk to a running daemon through the official client.

A module that uses them defines its own module-scoped `daemon` fixture (a `DaemonProcess` started
with the flags it needs, or the session's `tiny_daemon` or `default_model_daemon`); `client` and `model` are built
on whichever `daemon` the module has.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from tests.integration.daemon_process import DaemonProcess, start_daemon


@pytest.fixture(scope="session")
def tiny_daemon(tiny_package: Path) -> Iterator[DaemonProcess]:
    """The tiny package served with up to four requests at once, started once for every module
    that needs no other flags. Tests on it assert on their own answers only, never on the
    daemon's log or counters."""
    process = start_daemon(tiny_package, ["--max-concurrency", "4"])
    yield process
    assert process.stop() == 0, process.log()


@pytest.fixture(scope="session")
def default_model_daemon(default_package: Path) -> Iterator[DaemonProcess]:
    """The default model served with up to four requests at once, started once for every module
    that needs no other flags: loading the real model is most of a daemon's start. It is `flare
    run` without PACKAGE, which finds the package the fixture exported in the cache. Tests on it
    assert on their own answers only, never on the daemon's log or counters."""
    process = start_daemon(None, ["--max-concurrency", "4"], env={"FLARE_CACHE_DIR": str(default_package.parents[1])})
    yield process
    assert process.stop() == 0, process.log()


@pytest.fixture
def client(daemon: DaemonProcess) -> openai.AsyncOpenAI:
    # No retries: a test must see the daemon's first answer.
    return openai.AsyncOpenAI(base_url=f"{daemon.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def model(daemon: DaemonProcess) -> str:
    return daemon.model_name()
