"""`flare run` with no PACKAGE serves the real default model (SmolLM2-135M-Instruct) to the OpenAI client."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from tests.integration.daemon_process import start_daemon

pytestmark = pytest.mark.real_model


async def test_the_default_model_answers_a_chat(default_package: Path) -> None:
    # The fixture exported the package into the cache; `flare run` without PACKAGE must find it there.
    daemon = start_daemon(None, env={"FLARE_CACHE_DIR": str(default_package.parents[1])})
    try:
        client = openai.AsyncOpenAI(base_url=f"{daemon.base_url}/v1", api_key="unused", max_retries=0)
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
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.kill()
