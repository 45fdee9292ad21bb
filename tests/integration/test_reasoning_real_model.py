"""Reasoning over the real daemon: a tiny package whose template opens `<think>` in the
generation prompt (Qwen 3's template, as the DeepSeek-R1 distills end it) answers inside its
reasoning, so everything the random model writes before any `</think>` is reasoning, through the
unchanged OpenAI and Anthropic clients."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from tests.integration.daemon_process import DaemonProcess, start_daemon

QWEN3 = (Path(__file__).parent.parent / "fixtures" / "templates" / "qwen3.jinja").read_text()
OPENS_THINKING = QWEN3.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'")
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def daemon(make_package: Any) -> Iterator[DaemonProcess]:
    process = start_daemon(make_package(chat_template=OPENS_THINKING), ["--max-concurrency", "2"])
    yield process
    assert process.stop() == 0, process.log()


async def test_chat_sends_the_reasoning_in_reasoning_content(client: openai.AsyncOpenAI, model: str) -> None:
    answer = await client.chat.completions.create(model=model, messages=HI, temperature=0, max_tokens=12)
    message = answer.choices[0].message.model_dump()
    assert message["reasoning_content"] and "</think>" not in message["reasoning_content"]
    assert message["content"] == ""
    stream = await client.chat.completions.create(model=model, messages=HI, temperature=0, max_tokens=12, stream=True)
    deltas = [chunk.choices[0].delta.model_dump() async for chunk in stream if chunk.choices]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]


async def test_messages_answer_with_a_thinking_block(daemon: DaemonProcess, model: str) -> None:
    client = anthropic.AsyncAnthropic(base_url=daemon.base_url, api_key="unused", max_retries=0)
    message = await client.messages.create(
        model=model, max_tokens=12, messages=HI, thinking={"type": "enabled", "budget_tokens": 1024}
    )
    assert message.content[0].type == "thinking" and message.content[0].thinking
