"""The default model (SmolLM2-135M-Instruct) behind flare, driven by the official OpenAI SDK and
by LangChain's ChatOpenAI: structured output with Pydantic models, json_object, tools with each
tool_choice, logprobs consistent with greedy choices, and logit_bias."""

from __future__ import annotations

import enum
import json
from pathlib import Path

import pytest
from tests.integration.daemon_process import DaemonProcess
from pydantic import BaseModel, Field

pytestmark = pytest.mark.real_model
MODEL = "SmolLM2-135M-Instruct"


class Colour(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: str = Field(max_length=20)
    country: str = Field(max_length=20)


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    favourite_colour: Colour
    address: Address
    hobbies: list[str] = Field(max_length=3)
    nickname: str | None = Field(max_length=12)


class Sentiment(BaseModel):
    label: Colour
    stars: int = Field(ge=1, le=5)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
PERSON = [{"role": "user", "content": "Invent a person who lives in Rome: name, age, colour, address, hobbies."}]


@pytest.fixture(scope="module")
def daemon(default_model_daemon: DaemonProcess) -> DaemonProcess:
    return default_model_daemon


async def test_parse_returns_nested_objects_arrays_enums_and_optionals(client) -> None:
    completion = await client.chat.completions.parse(
        model=MODEL, messages=PERSON, response_format=Person, temperature=0, max_tokens=200
    )
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and isinstance(person.address, Address)
    async with client.chat.completions.stream(
        model=MODEL, messages=PERSON, response_format=Person, temperature=0.7, seed=3, max_tokens=200
    ) as stream:
        final = await stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Person)


async def test_json_object_parses(client) -> None:
    answer = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give a JSON object with a name and an age."}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=100,
    )
    assert answer.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


@pytest.mark.parametrize("tool_choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}])
async def test_tools_with_each_tool_choice(client, tool_choice) -> None:
    # One call: with parallel calls allowed this small model repeats its call until max_tokens.
    answer = await client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=tool_choice, parallel_tool_calls=False,
        temperature=0, max_tokens=80,
    )
    choice = answer.choices[0]
    if tool_choice != "auto" or choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        call = choice.message.tool_calls[0]
        arguments = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and arguments["unit"] in ("celsius", "fahrenheit")
    else:
        assert choice.message.content


async def test_tool_choice_none_answers_in_text(client) -> None:
    answer = await client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=20
    )
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].message.content


async def test_greedy_tokens_are_the_top_logprob_and_logit_bias_removes_one(client, default_package: Path) -> None:
    from flare.engine.tokenizer import Tokenizer
    from flare.package.directory import open_package

    answer = await client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_tokens=10, logprobs=True, top_logprobs=5
    )
    content = answer.choices[0].logprobs.content
    assert all(entry.top_logprobs[0].token == entry.token for entry in content)
    tokenizer = Tokenizer.from_package(open_package(default_package))
    (first_id,) = tokenizer.encode(content[0].token, add_special_tokens=False)
    biased = await client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_tokens=1, logprobs=True, logit_bias={str(first_id): -100}
    )
    assert biased.choices[0].logprobs.content[0].token == content[0].top_logprobs[1].token


async def test_langchain_structured_output_and_tools(daemon: DaemonProcess) -> None:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=MODEL, base_url=f"{daemon.base_url}/v1", api_key="unused", temperature=0, max_tokens=120)
    sentiment = await chat.with_structured_output(Sentiment, method="json_schema").ainvoke("I love this!")
    assert isinstance(sentiment, Sentiment)
    message = await chat.bind_tools([WEATHER], tool_choice="get_weather").ainvoke("Weather in Oslo?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
