"""The families' chat conventions over the real daemon (tiny random Llama, the default model's
tokenizer, a family's own chat template): tool calls are generated in the format the template
teaches and come back as OpenAI tool_calls, streamed and not, and a conversation carrying them
renders again through that template; generation ends at any of the package's stop ids, which are
never sent as text."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from tests.integration.daemon_process import DaemonProcess, start_daemon

TEMPLATES = Path(__file__).parent.parent / "fixtures" / "templates"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
IM_START = 1  # <|im_start|> in the default model's vocabulary: made a stop id of these packages


@pytest.fixture(scope="module", params=["llama3.1", "mistral-v0.3", "qwen2.5"])
def daemon(request: pytest.FixtureRequest, make_package: Any, package_parts: dict[str, Any]) -> Iterator[DaemonProcess]:
    config = package_parts["config"]
    package = make_package(
        chat_template=(TEMPLATES / f"{request.param}.jinja").read_text(),
        config=replace(config, eos_token_ids=(*config.eos_token_ids, IM_START)),
    )
    process = start_daemon(package, ["--max-concurrency", "4"])
    yield process
    assert process.stop() == 0, process.log()


def _valid(name: str, arguments: str) -> bool:
    return name == "get_weather" and json.loads(arguments) in ({"city": "Paris"}, {"city": "Oslo"})


async def test_a_required_call_comes_back_as_tool_calls_and_renders_again(
    client: openai.AsyncOpenAI, model: str
) -> None:
    answer = await client.chat.completions.create(
        model=model, messages=CHAT, tools=[WEATHER], tool_choice="required", temperature=1.0, seed=1, max_tokens=80
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and all(_valid(c.function.name, c.function.arguments) for c in calls)
    # The calls, with the ids flare gave them, render through the family's template (Mistral's
    # refuses any id but nine letters and digits; Llama 3.1's more than one call a turn).
    messages: list[Any] = [
        *CHAT,
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
        *({"role": "tool", "tool_call_id": c.id, "content": "18 C"} for c in calls),
    ]
    again = await client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=4
    )
    assert again.choices[0].finish_reason in ("stop", "length")


async def test_a_named_call_streams_as_openai_deltas(client: openai.AsyncOpenAI, model: str) -> None:
    stream = await client.chat.completions.create(
        model=model, messages=CHAT, tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=1.0, seed=2, max_tokens=80, stream=True,
    )
    name, arguments, finish, content = "", "", None, ""
    async for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or ():
            assert call.index == 0
            name += call.function.name or ""
            arguments += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == "" and _valid(name, arguments)


@pytest.mark.parametrize("stream", [False, True])
async def test_generation_ends_at_a_stop_id_which_is_not_sent_as_text(
    client: openai.AsyncOpenAI, model: str, stream: bool
) -> None:
    # logit_bias makes the stop id the model's first choice: the answer ends there, empty.
    kwargs: dict[str, Any] = {
        "model": model, "messages": CHAT, "temperature": 0, "max_tokens": 16, "logit_bias": {str(IM_START): 100},
    }
    if not stream:
        answer = await client.chat.completions.create(**kwargs)
        # Without the id among the stop ids the answer would run to max_tokens ("length").
        assert answer.choices[0].finish_reason == "stop" and answer.choices[0].message.content == ""
        return
    text, finish = "", None
    async for chunk in await client.chat.completions.create(**kwargs, stream=True):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop" and text == ""


async def test_the_messages_and_responses_apis_read_calls_in_the_templates_format(
    daemon: DaemonProcess, client: openai.AsyncOpenAI, model: str
) -> None:
    claude = anthropic.AsyncAnthropic(base_url=daemon.base_url, api_key="unused", max_retries=0)
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    message = await claude.messages.create(
        model=model, max_tokens=80, messages=[{"role": "user", "content": CHAT[0]["content"]}], tools=[tool],
        tool_choice={"type": "any"}, extra_body={"temperature": 0},
    )
    assert message.stop_reason == "tool_use"
    uses = [block for block in message.content if block.type == "tool_use"]
    assert uses and all(use.name == "get_weather" and use.input in ({"city": "Paris"}, {"city": "Oslo"}) for use in uses)
    response = await client.responses.create(
        model=model, input=CHAT[0]["content"], max_output_tokens=80, temperature=0,
        tools=[{"type": "function", **WEATHER["function"]}], tool_choice="required",
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(_valid(call.name, call.arguments) for call in calls)


QWEN_GENERATION = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
                   "eos_token_id": [2, 0]}


@pytest.fixture(scope="module")
def qwen_daemon(smollm2_source: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """A tiny Qwen2 checkpoint (tests/family_checkpoints.py) with Qwen 2.5's chat template and generation
    config, exported from its Hugging Face directory and served."""
    import io

    from tests.family_checkpoints import write_checkpoint

    from flare.preparation.export import ExportOptions, export_package

    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("qwen2")
    template = (TEMPLATES / "qwen2.5.jinja").read_text()
    checkpoint = write_checkpoint("qwen2", root / "qwen2", smollm2_source.tokenizer_json, template)
    (checkpoint.path / "generation_config.json").write_text(json.dumps(QWEN_GENERATION))
    export_package(str(checkpoint.path), root / "package", ExportOptions(dtype="float32"), stderr=io.StringIO())
    process = start_daemon(root / "package", ["--max-concurrency", "4"])
    yield process
    assert process.stop() == 0, process.log()


async def test_a_qwen2_package_serves_its_generation_defaults_and_calls_in_its_format(qwen_daemon: DaemonProcess) -> None:
    client = openai.AsyncOpenAI(base_url=f"{qwen_daemon.base_url}/v1", api_key="unused", max_retries=0)
    model = qwen_daemon.model_name()
    plain = await client.chat.completions.create(model=model, messages=CHAT, max_tokens=4, seed=0)
    applied = plain.model_extra["flare"]["sampling"]
    assert (applied["temperature"], applied["top_p"], applied["top_k"]) == (0.7, 0.8, 20)
    assert applied["repetition_penalty"] == 1.05
    stream = await client.chat.completions.create(
        model=model, messages=CHAT, tools=[WEATHER], tool_choice="required", seed=3, max_tokens=80, stream=True
    )
    name, arguments, finish = "", "", None
    async for chunk in stream:
        if chunk.choices:
            for call in chunk.choices[0].delta.tool_calls or ():
                name += call.function.name or ""
                arguments += call.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and _valid(name, arguments)
