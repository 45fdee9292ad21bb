"""`flare run` with no PACKAGE serves the real default model (SmolLM2-135M-Instruct) to the OpenAI client."""

from __future__ import annotations

import openai
import pytest
from tests.integration.daemon_process import DaemonProcess

pytestmark = pytest.mark.real_model


async def test_the_default_model_answers_a_chat(default_model_daemon: DaemonProcess) -> None:
    # The daemon runs without PACKAGE: it found the package the fixture exported into the cache.
    client = openai.AsyncOpenAI(base_url=f"{default_model_daemon.base_url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in (await client.models.list()).data] == ["SmolLM2-135M-Instruct"]
    stream = await client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=24,
        stream=True,
    )
    answer = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
    assert "Paris" in answer
