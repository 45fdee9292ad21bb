"""Fixtures of the integration tests that talk to a running daemon through the official client.

A module that uses them defines its own module-scoped `daemon` fixture (a `DaemonProcess` started
with the flags it needs); `client` and `model` are built on whichever `daemon` the module has.
"""

from __future__ import annotations

import openai
import pytest
from tests.integration.daemon_process import DaemonProcess


@pytest.fixture
def client(daemon: DaemonProcess) -> openai.AsyncOpenAI:
    # No retries: a test must see the daemon's first answer.
    return openai.AsyncOpenAI(base_url=f"{daemon.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def model(daemon: DaemonProcess) -> str:
    return daemon.model_name()
