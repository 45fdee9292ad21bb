"""Tool calls over the real daemon (tiny random package) with the official OpenAI client: each
tool_choice, streaming deltas in OpenAI's shape, arguments that validate, and a conversation
that carries earlier calls and their results."""

from __future__ import annotations

import json

import pytest
from tests.integration.daemon_process import DaemonProcess

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"hours_ahead": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["hours_ahead"],
            "additionalProperties": False,
        },
    },
}
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def daemon(tiny_daemon: DaemonProcess) -> DaemonProcess:
    return tiny_daemon


def _valid_call(name: str, arguments: str) -> bool:
    value = json.loads(arguments)
    if name == "get_weather":
        return value["city"] in ("Paris", "Oslo") and value["unit"] in ("C", "F") and len(value) == 2
    return name == "get_time" and 0 <= value["hours_ahead"] <= 9 and len(value) == 1


@pytest.mark.parametrize("parallel", [True, False])
async def test_required_forces_calls_whose_arguments_validate(client, model, parallel: bool) -> None:
    answer = await client.chat.completions.create(
        model=model, messages=CHAT, tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=parallel,
        temperature=1.0, seed=3, max_tokens=200,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.tool_calls
    if not parallel:
        assert len(choice.message.tool_calls) == 1
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert _valid_call(call.function.name, call.function.arguments)


async def test_a_named_choice_calls_that_function(client, model) -> None:
    answer = await client.chat.completions.create(
        model=model, messages=CHAT, tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_time"}}, temperature=0, max_tokens=100,
    )
    (call,) = answer.choices[0].message.tool_calls
    assert call.function.name == "get_time" and _valid_call("get_time", call.function.arguments)


async def test_none_answers_in_text_and_auto_either_way(client, model) -> None:
    none = await client.chat.completions.create(
        model=model, messages=CHAT, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=8
    )
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason in ("stop", "length")
    for seed in range(4):
        auto = await client.chat.completions.create(
            model=model, messages=CHAT, tools=[WEATHER], temperature=1.0, seed=seed, max_tokens=60
        )
        choice = auto.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            assert all(_valid_call(c.function.name, c.function.arguments) for c in choice.message.tool_calls)
        else:
            assert not choice.message.content.startswith("<")


async def test_streamed_tool_calls_come_as_deltas_in_openais_shape(client, model) -> None:
    stream = await client.chat.completions.create(
        model=model, messages=CHAT, tools=[WEATHER, CLOCK], tool_choice="required", temperature=1.0, seed=5,
        max_tokens=200, stream=True,
    )
    calls: dict[int, dict[str, str]] = {}
    finish = None
    async for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        assert not delta.content
        for call in delta.tool_calls or ():
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls
    assert all(_valid_call(c["name"], c["arguments"]) for c in calls.values())


async def test_a_conversation_with_calls_and_their_results_is_answered(client, model) -> None:
    messages = [
        *CHAT,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]
    answer = await client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=6
    )
    assert answer.choices[0].message.content is not None
    assert answer.usage.prompt_tokens > 50  # the preamble-free conversation with the call and its result
