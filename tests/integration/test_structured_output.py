"""Structured output over the real daemon (tiny random package) with the official OpenAI client:
parse() with Pydantic models, json_object, the structured_outputs extension, and hostile
constraints answered 400 quickly without disturbing a stream in flight."""

from __future__ import annotations

import asyncio
import enum
import json
import re
import time

import httpx
import pytest
from tests.integration.daemon_process import DaemonProcess
from pydantic import BaseModel, Field

CHAT = [{"role": "user", "content": "Describe a pet."}]


class Kind(str, enum.Enum):
    cat = "cat"
    dog = "dog"


class Owner(BaseModel):
    initials: str = Field(max_length=3)
    age: int = Field(ge=0, le=99)


class Pet(BaseModel):
    kind: Kind
    owner: Owner
    vaccinated: bool
    nickname: str | None = Field(max_length=6)
    toys: list[Kind] = Field(max_length=2)


@pytest.fixture(scope="module")
def daemon(tiny_daemon: DaemonProcess) -> DaemonProcess:
    return tiny_daemon


@pytest.mark.parametrize("temperature", [0.0, 1.2])
async def test_parse_returns_a_valid_pydantic_object(client, model, temperature: float) -> None:
    completion = await client.chat.completions.parse(
        model=model, messages=CHAT, response_format=Pet, temperature=temperature, seed=4, max_tokens=120
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, Pet)


async def test_a_streamed_answer_validates_too(client, model) -> None:
    async with client.chat.completions.stream(
        model=model, messages=CHAT, response_format=Pet, temperature=0.9, seed=8, max_tokens=120
    ) as stream:
        final = await stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Pet)


async def test_stop_strings_cannot_cut_a_constrained_answer_and_the_flare_object_says_so(client, model) -> None:
    completion = await client.chat.completions.parse(
        model=model, messages=CHAT, response_format=Pet, temperature=0, max_tokens=120, stop=['"', "}"]
    )
    assert isinstance(completion.choices[0].message.parsed, Pet)
    (adjusted,) = completion.model_extra["flare"]["adjusted"]
    assert adjusted["param"] == "stop" and adjusted["applied"] == [] and "response_format" in adjusted["reason"]


async def test_json_object_parses(client, model) -> None:
    answer = await client.chat.completions.create(
        model=model, messages=CHAT, response_format={"type": "json_object"}, temperature=0, max_tokens=60
    )
    text = answer.choices[0].message.content
    if answer.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: a prefix of an object
        assert text.startswith("{")


async def test_structured_outputs_regex_and_choice_on_both_endpoints(client, model) -> None:
    answer = await client.completions.create(
        model=model, prompt="The date:", max_tokens=16, temperature=1.0, seed=1,
        extra_body={"structured_outputs": {"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"}},
    )
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", answer.choices[0].text)
    chat = await client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=8, temperature=0,
        extra_body={"structured_outputs": {"choice": ["positive", "negative"]}},
    )
    assert chat.choices[0].message.content in ("positive", "negative")


HOSTILE = [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "format": "color"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": list(range(100_000))}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}}},
     "response_format.json_schema.schema"),
]
HOSTILE_EXTENSION = [
    ({"regex": "[a-"}, "structured_outputs.regex"),
    ({"regex": "(a|aa)*" * 2000}, "structured_outputs.regex"),
    ({"grammar": "start: foo"}, "structured_outputs.grammar"),
    ({"json": "{not json"}, "structured_outputs.json"),
]


async def test_hostile_constraints_get_a_quick_400_while_a_stream_goes_on(daemon: DaemonProcess, model) -> None:
    async with httpx.AsyncClient(base_url=daemon.base_url, timeout=60) as http:
        async def streaming() -> tuple[float, int]:
            started = time.perf_counter()
            body = {"model": model, "messages": CHAT, "max_tokens": 60, "temperature": 0, "stream": True}
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                chunks = [line async for line in response.aiter_lines() if line.startswith("data: ")]
            return time.perf_counter() - started, len(chunks)

        stream = asyncio.create_task(streaming())
        bodies = [({"response_format": fmt}, param) for fmt, param in HOSTILE]
        bodies += [({"structured_outputs": ext}, param) for ext, param in HOSTILE_EXTENSION]
        for extra, param in bodies:
            started = time.perf_counter()
            response = await http.post("/v1/chat/completions", json={"model": model, "messages": CHAT, **extra})
            elapsed = time.perf_counter() - started
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == param, error
            assert error["message"].startswith(param)
            assert elapsed < 5.0, f"{param} took {elapsed:.1f} s"
        # Patterns that make backtracking engines explode are plain automata here: served.
        for pattern in ("(x+x+)+y" * 50, "[0-9]{1000}{1000}"):
            started = time.perf_counter()
            body = {"model": model, "prompt": "p", "max_tokens": 8, "structured_outputs": {"regex": pattern}}
            response = await http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            assert time.perf_counter() - started < 5.0
            assert re.fullmatch("[xy]*|[0-9]*", response.json()["choices"][0]["text"])
        seconds, chunks = await stream
        assert chunks > 3
