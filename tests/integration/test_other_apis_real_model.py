"""The default model (SmolLM2-135M-Instruct) behind flare, driven unchanged by the official
`openai` SDK's Responses API and the official `anthropic` SDK's Messages API (with a json schema
and with a tool), and completions with several prompts and with token ids."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import openai
import pytest
from tests.integration.daemon_process import DaemonProcess

pytestmark = pytest.mark.real_model
MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ASK_WEATHER = "What is the weather like in Paris today?"


@pytest.fixture(scope="module")
def daemon(default_model_daemon: DaemonProcess) -> DaemonProcess:
    return default_model_daemon


# The current anthropic SDK has no temperature argument (its models fix it); the API still takes
# one, so the tests send it as an extra body field for greedy answers.
@pytest.fixture
def claude(daemon: DaemonProcess) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=daemon.base_url, api_key="unused", max_retries=0)


# --- the Responses API ----------------------------------------------------------------------


async def test_responses_create_answers_paris(client: openai.AsyncOpenAI) -> None:
    response = await client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=24)
    assert response.status in ("completed", "incomplete")
    assert "Paris" in response.output_text
    assert response.usage is not None and response.usage.output_tokens > 0
    assert response.model_extra is not None and "flare" in response.model_extra


async def test_responses_stream_sends_the_events_in_order_and_deltas_make_the_text(client: openai.AsyncOpenAI) -> None:
    stream = await client.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
        temperature=0,
        max_output_tokens=24,
        stream=True,
    )
    events = [event async for event in stream]
    types = [event.type for event in events]
    assert types[:4] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"
    ]
    assert types[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        types[-1],
    ] and types[-1] in ("response.completed", "response.incomplete")
    assert set(types[4:-4]) == {"response.output_text.delta"}
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-4].text == events[-1].response.output_text
    assert "Paris" in deltas
    assert [e.sequence_number for e in events] == list(range(len(events)))


async def test_responses_text_format_json_schema_is_held(client: openai.AsyncOpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "maxLength": 20}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    response = await client.responses.create(
        model=MODEL,
        input=QUESTION,
        text={"format": {"type": "json_schema", "name": "capital", "schema": schema, "strict": True}},
        temperature=0,
        max_output_tokens=40,
    )
    assert set(json.loads(response.output_text)) == {"capital"}


async def test_responses_stream_and_parse_helpers_of_the_sdk_work(client: openai.AsyncOpenAI) -> None:
    from pydantic import BaseModel, Field

    class Capital(BaseModel):
        capital: str = Field(max_length=20)

    async with client.responses.stream(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=24) as stream:
        final = await stream.get_final_response()
    assert "Paris" in final.output_text
    parsed = await client.responses.parse(
        model=MODEL, input=QUESTION, text_format=Capital, temperature=0, max_output_tokens=40
    )
    assert isinstance(parsed.output_parsed, Capital)


async def test_responses_tool_call_then_its_output_is_answered(client: openai.AsyncOpenAI) -> None:
    tool = {"type": "function", "name": "get_weather", "description": "Get the weather.", "parameters": WEATHER_PARAMETERS}
    response = await client.responses.create(
        model=MODEL, input=ASK_WEATHER, tools=[tool], tool_choice="required", parallel_tool_calls=False,
        temperature=0, max_output_tokens=80,
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments)["unit"] in ("celsius", "fahrenheit")
    stream = await client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": ASK_WEATHER},
            {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temperature": 21}'},
        ],
        tools=[tool], tool_choice="none", temperature=0, max_output_tokens=30, stream=True,
    )
    events = [event async for event in stream]
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.output_text


async def test_responses_streams_function_call_events(client: openai.AsyncOpenAI) -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMETERS}
    stream = await client.responses.create(
        model=MODEL, input=ASK_WEATHER, tools=[tool], tool_choice="required", parallel_tool_calls=False,
        temperature=0, max_output_tokens=80, stream=True,
    )
    events = [event async for event in stream]
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert pieces == done.arguments and json.loads(done.arguments)["unit"] in ("celsius", "fahrenheit")


async def test_responses_refuses_an_unknown_previous_response_id_by_name(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(model=MODEL, input=QUESTION, previous_response_id="resp_1")
    assert refused.value.body["param"] == "previous_response_id"


# --- the Messages API -----------------------------------------------------------------------


async def test_messages_create_answers_paris(claude: anthropic.AsyncAnthropic) -> None:
    message = await claude.messages.create(
        model=MODEL, max_tokens=24, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": QUESTION}],
    )
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert "Paris" in message.content[0].text
    assert message.usage.output_tokens > 0


async def test_messages_prefill_is_continued_not_answered_afresh(claude: anthropic.AsyncAnthropic) -> None:
    message = await claude.messages.create(
        model=MODEL, max_tokens=12, extra_body={"temperature": 0},
        messages=[
            {"role": "user", "content": f"{QUESTION} Answer in JSON."},
            {"role": "assistant", "content": '{"capital": "'},
        ],
    )
    text = message.content[0].text
    # The answer goes on from inside the string the prefill opened: it does not start a new
    # JSON object, and the continuation alone comes back, as from Anthropic.
    assert not text.lstrip().startswith("{"), text
    assert text.startswith("Paris"), text


async def test_messages_create_stopped_by_a_stop_sequence_says_which(claude: anthropic.AsyncAnthropic) -> None:
    message = await claude.messages.create(
        model=MODEL, max_tokens=24, extra_body={"temperature": 0}, stop_sequences=["Nowhere", "Paris"],
        messages=[{"role": "user", "content": QUESTION}],
    )
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "Paris")
    assert "Paris" not in message.content[0].text and "France" in message.content[0].text


async def test_messages_stream_events_concatenate_to_the_final_text(claude: anthropic.AsyncAnthropic) -> None:
    async with claude.messages.stream(
        model=MODEL, max_tokens=24, extra_body={"temperature": 0}, messages=[{"role": "user", "content": QUESTION}]
    ) as stream:
        types = []
        texts = []
        async for event in stream:
            types.append(event.type)
            if event.type == "content_block_delta":
                texts.append(event.delta.text)
        final = await stream.get_final_message()
    assert types[0] == "message_start" and types[-1] == "message_stop"
    assert "content_block_start" in types and "content_block_stop" in types and "message_delta" in types
    assert "".join(texts) == final.content[0].text and "Paris" in final.content[0].text


async def test_messages_tool_use_then_tool_result(claude: anthropic.AsyncAnthropic) -> None:
    tool = {"name": "get_weather", "description": "Get the weather.", "input_schema": WEATHER_PARAMETERS}
    asked = [{"role": "user", "content": ASK_WEATHER}]
    message = await claude.messages.create(
        model=MODEL, max_tokens=80, extra_body={"temperature": 0}, messages=asked, tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert message.stop_reason == "tool_use"
    use = next(block for block in message.content if block.type == "tool_use")
    assert use.name == "get_weather" and use.input["unit"] in ("celsius", "fahrenheit")
    async with claude.messages.stream(
        model=MODEL, max_tokens=30, extra_body={"temperature": 0}, tools=[tool],
        messages=[
            *asked,
            {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 degrees"}]},
        ],
        tool_choice={"type": "none"},
    ) as stream:
        final = await stream.get_final_message()
    assert final.content[0].type == "text" and final.content[0].text


async def test_messages_stream_sends_input_json_deltas_for_a_tool(claude: anthropic.AsyncAnthropic) -> None:
    tool = {"name": "get_weather", "input_schema": WEATHER_PARAMETERS}
    async with claude.messages.stream(
        model=MODEL, max_tokens=80, extra_body={"temperature": 0}, tools=[tool], tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": ASK_WEATHER}],
    ) as stream:
        final = await stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert final.content[-1].type == "tool_use" and final.content[-1].input["unit"] in ("celsius", "fahrenheit")


async def test_count_tokens_counts_what_messages_would_send(claude: anthropic.AsyncAnthropic) -> None:
    counted = await claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": QUESTION}])
    message = await claude.messages.create(
        model=MODEL, max_tokens=1, messages=[{"role": "user", "content": QUESTION}]
    )
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens


async def test_messages_errors_come_in_anthropics_shape(claude: anthropic.AsyncAnthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as refused:
        await claude.messages.create(model=MODEL, max_tokens=0, messages=[{"role": "user", "content": "Hi"}])
    assert refused.value.body["type"] == "error"
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        await claude.messages.create(model="other", max_tokens=5, messages=[{"role": "user", "content": "Hi"}])


# --- completions prompts --------------------------------------------------------------------


async def test_two_prompts_answer_as_choices_zero_and_one(client: openai.AsyncOpenAI) -> None:
    prompts = ["The capital of France is", "The capital of Italy is"]
    both = await client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=6)
    assert [c.index for c in both.choices] == [0, 1]
    alone = [await client.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=6) for p in prompts]
    assert [c.text for c in both.choices] == [a.choices[0].text for a in alone]
    assert both.usage is not None
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone if a.usage is not None)
    assert both.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone if a.usage is not None)


async def test_a_token_id_prompt_answers_as_its_string(client: openai.AsyncOpenAI, default_package: Path) -> None:
    from flare.engine.tokenizer import Tokenizer
    from flare.package.directory import open_package

    tokenizer = Tokenizer.from_package(open_package(default_package))
    text = "The capital of France is"
    ids = tokenizer.encode(text)
    by_text = await client.completions.create(model=MODEL, prompt=text, temperature=0, max_tokens=8)
    by_ids = await client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=8)
    by_lists = await client.completions.create(model=MODEL, prompt=[ids, ids], temperature=0, max_tokens=8)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert [c.text for c in by_lists.choices] == [by_text.choices[0].text] * 2
