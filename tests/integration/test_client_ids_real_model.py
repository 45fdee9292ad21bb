"""The default model behind flare, as the official `openai` and `anthropic` SDKs see it unchanged:
each API's ids in its documented form (answers, items, tool calls, stream events), and the
names tools send: several served names, any name under --accept-any-model-name, and the OpenAI
routes without /v1; and Anthropic's output_config.format, now served."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest
from tests.integration.daemon_process import DaemonProcess, start_daemon

pytestmark = pytest.mark.real_model
MODEL = "SmolLM2-135M-Instruct"
ALIAS = "smol"
QUESTION = "What is the capital of France?"
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
ASK = "What is the weather like in Paris today?"


@pytest.fixture(scope="module")
def daemon(default_package: Path) -> Iterator[DaemonProcess]:
    # PACKAGE first: --served-model-name takes every name after it.
    process = start_daemon(
        default_package, ["--max-concurrency", "4", "--served-model-name", MODEL, ALIAS, "--accept-any-model-name"]
    )
    yield process
    assert process.stop() == 0, process.log()


@pytest.fixture
def claude(daemon: DaemonProcess) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=daemon.base_url, api_key="unused", max_retries=0)


def hex_id(prefix: str, value: str) -> bool:
    return re.fullmatch(rf"{prefix}[0-9a-f]{{24,32}}", value) is not None


async def test_openai_sdk_sees_chatcmpl_resp_msg_fc_and_call_ids(client: openai.AsyncOpenAI) -> None:
    chat = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": ASK}], max_tokens=40, temperature=0,
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}],
        tool_choice="required", parallel_tool_calls=False,
    )
    assert hex_id("chatcmpl-", chat.id)
    (call,) = chat.choices[0].message.tool_calls or []
    assert hex_id("call_", call.id)

    response = await client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=8)
    assert hex_id("resp_", response.id) and hex_id("msg_", response.output[0].id)
    tool = {"type": "function", "name": "get_weather", "parameters": PARAMETERS}
    calling = await client.responses.create(
        model=MODEL, input=ASK, tools=[tool], tool_choice="required", parallel_tool_calls=False,
        temperature=0, max_output_tokens=40,
    )
    (item,) = [item for item in calling.output if item.type == "function_call"]
    assert hex_id("fc_", item.id) and hex_id("call_", item.call_id)

    stream = await client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=8, stream=True)
    events = [event async for event in stream]
    assert hex_id("resp_", events[0].response.id)
    assert all(hex_id("msg_", e.item_id) for e in events if e.type == "response.output_text.delta")


async def test_anthropic_sdk_sees_msg_and_toolu_ids(claude: anthropic.AsyncAnthropic) -> None:
    message = await claude.messages.create(
        model=MODEL, max_tokens=8, extra_body={"temperature": 0}, messages=[{"role": "user", "content": QUESTION}],
        thinking={"type": "disabled"},
    )
    assert hex_id("msg_", message.id)
    calling = await claude.messages.create(
        model=MODEL, max_tokens=40, extra_body={"temperature": 0}, messages=[{"role": "user", "content": ASK}],
        tools=[{"name": "get_weather", "input_schema": PARAMETERS}], tool_choice={"type": "tool", "name": "get_weather"},
    )
    use = next(block for block in calling.content if block.type == "tool_use")
    assert hex_id("toolu_", use.id)
    async with claude.messages.stream(
        model=MODEL, max_tokens=8, extra_body={"temperature": 0}, messages=[{"role": "user", "content": QUESTION}]
    ) as stream:
        final = await stream.get_final_message()
    assert hex_id("msg_", final.id)


async def test_names_tools_send_are_answered(daemon: DaemonProcess) -> None:
    # As a tool written for llama.cpp calls it: no /v1 in the base URL, a name of its own.
    bare = openai.AsyncOpenAI(base_url=daemon.base_url, api_key="unused", max_retries=0)
    assert [model.id async for model in bare.models.list()] == [MODEL, ALIAS]
    for name in (ALIAS, "gpt-4o"):
        chat = await bare.chat.completions.create(
            model=name, messages=[{"role": "user", "content": QUESTION}], max_tokens=4, temperature=0
        )
        assert chat.model == name
        flare = (chat.model_extra or {})["flare"]
        assert flare.get("model") == (None if name == ALIAS else {"requested": name, "served": MODEL})


async def test_anthropic_output_config_format_holds_the_answer_to_the_schema(claude: anthropic.AsyncAnthropic) -> None:
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "maxLength": 20}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    message = await claude.messages.create(
        model=MODEL, max_tokens=40, extra_body={"temperature": 0}, messages=[{"role": "user", "content": QUESTION}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    (block,) = message.content
    assert block.type == "text" and set(json.loads(block.text)) == {"capital"}
