"""The default model behind the real daemon (issue 29 item 5, issue 30 strict schemas): a tool
whose parameters use `$defs`/`$ref` (what Pydantic and `openai.pydantic_function_tool` write)
gets a call whose arguments follow the reference; a strict schema without
`additionalProperties` never yields keys it does not name, sampled at temperature 0.8, and the
`flare` object says what strict closed; a strict schema that allows other keys is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.reliability.reliability_daemon import Daemon, is_error_body, report

pytestmark = pytest.mark.real_model

# Pydantic's model_json_schema() of Launch(kind: str, site: Site), Site(city, country: Literal):
# no additionalProperties anywhere, the nested model behind a $ref.
LAUNCH = {
    "$defs": {
        "Site": {
            "properties": {"city": {"title": "City", "type": "string"}, "country": {"enum": ["FR", "US", "JP"], "type": "string"}},
            "required": ["city", "country"],
            "title": "Site",
            "type": "object",
        }
    },
    "properties": {"kind": {"title": "Kind", "type": "string"}, "site": {"$ref": "#/$defs/Site"}},
    "required": ["kind", "site"],
    "title": "Launch",
    "type": "object",
}
QUESTION = [{"role": "user", "content": "Describe a rocket launch as JSON."}]


@pytest.fixture(scope="module")
def daemon(daemon_factory, default_package: Path) -> Daemon:
    return daemon_factory(default_package, ["--max-concurrency", "4"])


def _names(value: Any, schema: dict[str, Any], defs: dict[str, Any]) -> set[str]:
    """Keys of `value`'s objects that `schema` does not name (following $refs into `defs`)."""
    if "$ref" in schema:
        schema = defs[schema["$ref"].rsplit("/", 1)[1]]
    if isinstance(value, dict):
        named = schema.get("properties", {})
        extra = set(value) - set(named)
        for key, item in value.items():
            if key in named:
                extra |= _names(item, named[key], defs)
        return extra
    return set()


def test_a_strict_schema_without_additional_properties_never_yields_unnamed_keys(daemon: Daemon) -> None:
    unnamed: set[str] = set()
    answers = 0
    for seed in range(6):
        response = httpx.post(
            f"{daemon.url}/v1/chat/completions",
            json=daemon.body(
                messages=QUESTION,
                temperature=0.8,
                seed=seed,
                max_tokens=120,
                response_format={"type": "json_schema", "json_schema": {"name": "launch", "strict": True, "schema": LAUNCH}},
            ),
            timeout=300,
        )
        assert response.status_code == 200, response.text
        body = response.json()
        adjusted = {a["param"]: a for a in body["flare"]["adjusted"]}
        closed = adjusted["response_format.json_schema.schema.additionalProperties"]
        assert closed["applied"] is False and "/$defs/Site" in closed["reason"]
        choice = body["choices"][0]
        if choice["finish_reason"] == "stop":
            value = json.loads(choice["message"]["content"])
            answers += 1
            unnamed |= _names(value, LAUNCH, LAUNCH["$defs"])
        else:
            # Cut by max_tokens: whatever keys were written so far are still named ones.
            assert choice["finish_reason"] == "length"
    assert unnamed == set()
    assert answers >= 3
    report("strict_schema_keys", seeds=6, complete_answers=answers, unnamed_keys=len(unnamed))


def test_a_strict_schema_that_allows_other_keys_is_refused(daemon: Daemon) -> None:
    schema = {**LAUNCH, "additionalProperties": True}
    response = httpx.post(
        f"{daemon.url}/v1/chat/completions",
        json=daemon.body(response_format={"type": "json_schema", "json_schema": {"name": "l", "strict": True, "schema": schema}}),
        timeout=60,
    )
    assert response.status_code == 400 and is_error_body(response.json())
    assert response.json()["error"]["param"] == "response_format.json_schema.schema"
    assert "additionalProperties" in response.json()["error"]["message"]


@pytest.mark.parametrize("strict", [False, True])
def test_a_tool_with_defs_gets_a_call_whose_arguments_follow_the_reference(daemon: Daemon, strict: bool) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "record_launch", "description": "Record a rocket launch.", "parameters": LAUNCH, "strict": strict
        },
    }
    # Sampled at 0.8, an answer may run to max_tokens before its call closes (which draft lengths
    # the round's costs chose changes which sample a seed draws): up to six seeds, three calls.
    calls = []
    for seed in range(6):
        if len(calls) == 3:
            break
        response = httpx.post(
            f"{daemon.url}/v1/chat/completions",
            json=daemon.body(
                messages=QUESTION,
                tools=[tool],
                tool_choice={"type": "function", "function": {"name": "record_launch"}},
                temperature=0.8,
                seed=seed,
                max_tokens=150,
            ),
            timeout=300,
        )
        assert response.status_code == 200, response.text
        adjusted = {a["param"] for a in response.json()["flare"]["adjusted"]}
        assert ("tools.additionalProperties" in adjusted) is strict
        choice = response.json()["choices"][0]
        if choice["finish_reason"] == "length":
            continue
        assert choice["finish_reason"] == "tool_calls"
        (call,) = choice["message"]["tool_calls"]
        arguments = json.loads(call["function"]["arguments"])
        assert set(arguments) >= {"kind", "site"}
        assert isinstance(arguments["site"]["city"], str) and arguments["site"]["country"] in ("FR", "US", "JP")
        if strict:
            assert set(arguments) == {"kind", "site"} and set(arguments["site"]) == {"city", "country"}
        calls.append(arguments)
    assert calls
    report("tool_defs", strict=strict, calls=len(calls), example=json.dumps(calls[0]).replace(" ", ""))
