"""Request parsing holds for any JSON: a parsed request, or an ApiError with a 4xx naming the
problem; never another exception (which the API would answer 500)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from tests.fake_scheduler import POLICY
from hypothesis import given, settings
from hypothesis import strategies as st

from flare.api.chat.parse import parse_chat_completion, parse_completion
from flare.api.errors import ApiError
from flare.api.json_body import parse_json_body

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)
FIELDS = [
    "model", "messages", "prompt", "stream", "stream_options", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "max_tokens", "max_completion_tokens",
    "stop", "n", "logprobs", "tools", "tool_choice", "response_format", "logit_bias", "echo", "best_of", "user",
    "top_logprobs", "structured_outputs", "logprobs_mode", "parallel_tool_calls",
]
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "wizard"]) | json_values},
    optional={"content": json_values | st.text(), "name": json_values},
)
bodies = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=8) | st.fixed_dictionaries(
    {"model": st.just("m"), "messages": st.lists(message | json_values, max_size=3), "prompt": json_values},
    optional={field: json_values for field in FIELDS[4:]},
)


def _parsed_or_4xx(parse: Any, body: Any) -> None:
    try:
        request = parse(body)
    except ApiError as error:
        assert 400 <= error.status < 500
        assert error.message
        return
    # What was accepted can always be clamped to a policy.
    POLICY.clamp(request.sampling, max_tokens_limit=100)


@settings(max_examples=150, deadline=None)
@given(bodies)
def test_any_body_parses_or_is_a_4xx(body: dict[str, Any]) -> None:
    _parsed_or_4xx(parse_chat_completion, {k: v for k, v in body.items() if k != "prompt"})
    _parsed_or_4xx(parse_completion, {k: v for k, v in body.items() if k != "messages"})


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()))
def test_any_bytes_are_a_json_object_or_a_400(raw: bytes) -> None:
    try:
        body = parse_json_body(raw)
    except ApiError as error:
        assert error.status == 400
        return
    assert isinstance(body, dict)


def test_deeply_nested_json_is_a_400() -> None:
    with pytest.raises(ApiError) as raised:
        parse_json_body(b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert raised.value.status == 400


def test_an_unpaired_surrogate_escape_is_a_400_and_a_pair_is_text() -> None:
    assert parse_json_body(b'{"prompt": "\\ud83d\\ude00"}') == {"prompt": "\U0001f600"}
    for raw in (b'{"prompt": "\\ud800"}', b'{"\\uDC00": 1}', b'{"messages": [{"content": "a\\udfff"}]}'):
        with pytest.raises(ApiError) as refused:
            parse_json_body(raw)
        assert refused.value.status == 400 and "surrogate" in refused.value.message


OPEN_SCHEMA = {"type": "object", "properties": {"kind": {"type": "string"}}, "required": ["kind"]}


def _with_schema(schema: dict[str, Any], strict: bool | None) -> dict[str, Any]:
    format_ = {"name": "thing", "schema": schema, **({} if strict is None else {"strict": strict})}
    return {"model": "m", "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": format_}}


def test_a_strict_schema_is_closed_and_says_which_objects() -> None:
    spec = parse_chat_completion(_with_schema(OPEN_SCHEMA, strict=True)).constraint
    assert spec is not None and json.loads(spec.source)["additionalProperties"] is False
    assert spec.closed_objects == ("/",)
    for strict in (None, False):
        lenient = parse_chat_completion(_with_schema(OPEN_SCHEMA, strict)).constraint
        assert lenient is not None and "additionalProperties" not in json.loads(lenient.source)
        assert lenient.closed_objects == ()


def test_a_strict_schema_that_allows_other_keys_is_a_400_naming_the_schema() -> None:
    with pytest.raises(ApiError) as refused:
        parse_chat_completion(_with_schema({**OPEN_SCHEMA, "additionalProperties": {"type": "string"}}, strict=True))
    assert refused.value.status == 400
    assert refused.value.param == "response_format.json_schema.schema"
    assert "additionalProperties" in refused.value.message
