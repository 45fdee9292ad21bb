"""Hostile input to the Responses API and Anthropic's Messages API on the real daemon: every answer
is a success for valid input or a 4xx in that API's own error shape (OpenAI's on /v1/responses,
Anthropic's on /v1/messages), never a 5xx, and the daemon keeps serving with nothing leaked."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.reliability.reliability_daemon import Daemon, is_error_body, report

MAX_BODY_BYTES = 65536
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"
RESPONSES_FIELDS = (
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "text", "tools", "tool_choice",
    "parallel_tool_calls", "stream", "store", "previous_response_id", "metadata", "truncation", "reasoning",
)
MESSAGES_FIELDS = (
    "model", "messages", "system", "max_tokens", "temperature", "top_p", "top_k", "stop_sequences", "tools",
    "tool_choice", "stream", "metadata",
)
HYPOTHESIS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)

json_scalars = (
    st.none()
    | st.booleans()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.integers(min_value=-(10**400), max_value=10**400)
    | st.sampled_from([0, -1, 1, 2**63, 10**30, 1e308, 5e-324])
    | st.text(max_size=40)
    | st.builds(lambda c, n: c * n, st.sampled_from("a\u00e9\U0001f600\x00\n"), st.integers(0, 30000))
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)


def is_anthropic_error(body: Any) -> bool:
    return (
        isinstance(body, dict)
        and body.get("type") == "error"
        and isinstance(body.get("error"), dict)
        and isinstance(body["error"].get("type"), str)
        and isinstance(body["error"].get("message"), str)
        and "Traceback" not in body["error"]["message"]
    )


class Tally:
    """Every answer the daemon gave in this module, by status, each checked for its API's shape."""

    def __init__(self) -> None:
        self.statuses: Counter[int] = Counter()

    def check(self, response: httpx.Response) -> None:
        self.statuses[response.status_code] += 1
        assert response.status_code < 500, (response.status_code, response.text[:500])
        if response.status_code < 400:
            assert response.status_code < 300, response.text[:500]
        elif response.request.method != "HEAD":
            body = response.json()
            anthropic = response.request.url.path.startswith(MESSAGES)
            assert (is_anthropic_error if anthropic else is_error_body)(body), response.text[:500]


@pytest.fixture(scope="module")
def daemon(tiny_package: Path, daemon_factory: Callable[..., Daemon]) -> Daemon:
    return daemon_factory(tiny_package, ["--max-body-bytes", str(MAX_BODY_BYTES)])


@pytest.fixture(scope="module")
def http(daemon: Daemon) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=daemon.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def tally(daemon: Daemon) -> Iterator[Tally]:
    tally = Tally()
    yield tally
    assert daemon.serves()
    idle = daemon.wait_idle()
    report(
        "hostile_other_apis",
        requests=sum(tally.statuses.values()),
        statuses=dict(sorted(tally.statuses.items())),
        leaked_blocks=idle["kv_blocks_used"],
        running=idle["running"],
    )
    assert idle["kv_blocks_used"] == 0 and idle["running"] == 0


def _post(http: httpx.Client, path: str, body: Any) -> httpx.Response:
    raw = json.dumps(body).encode("utf-8", "surrogatepass")
    return http.post(path, content=raw, headers={"Content-Type": "application/json"})


def _valid(path: str, model: str) -> dict[str, Any]:
    if path == RESPONSES:
        return {"model": model, "input": "hi", "max_output_tokens": 4, "temperature": 0}
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    return body if path == COUNT_TOKENS else {**body, "max_tokens": 4, "temperature": 0}


@given(path=st.sampled_from((RESPONSES, MESSAGES, COUNT_TOKENS)), body=json_values)
@HYPOTHESIS
def test_arbitrary_json_bodies_get_4xx_in_the_apis_shape(http: httpx.Client, tally: Tally, path: str, body: Any) -> None:
    response = _post(http, path, body)
    tally.check(response)
    # No such body names the model and a prompt as these APIs require: it is never served.
    assert 400 <= response.status_code < 500, response.text[:500]


@given(field=st.sampled_from(RESPONSES_FIELDS) | st.text(max_size=8), value=json_values)
@HYPOTHESIS
def test_any_value_in_any_responses_field_is_answered_without_a_server_error(
    http: httpx.Client, tally: Tally, daemon: Daemon, field: str, value: Any
) -> None:
    tally.check(_post(http, RESPONSES, {**_valid(RESPONSES, daemon.model), field: value}))


@given(
    path=st.sampled_from((MESSAGES, COUNT_TOKENS)),
    field=st.sampled_from(MESSAGES_FIELDS) | st.text(max_size=8),
    value=json_values,
)
@HYPOTHESIS
def test_any_value_in_any_messages_field_is_answered_without_a_server_error(
    http: httpx.Client, tally: Tally, daemon: Daemon, path: str, field: str, value: Any
) -> None:
    tally.check(_post(http, path, {**_valid(path, daemon.model), field: value}))


ITEMS = [
    {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c1", "output": "ok"},
]
BLOCKS = [
    {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]},
]


@given(
    index=st.integers(0, 2),
    field=st.sampled_from(["role", "content", "type", "call_id", "name", "arguments", "output", "x"]),
    value=json_values,
)
@HYPOTHESIS
def test_any_value_inside_an_input_item_is_answered_without_a_server_error(
    http: httpx.Client, tally: Tally, daemon: Daemon, index: int, field: str, value: Any
) -> None:
    items: list[Any] = [dict(item) for item in ITEMS]
    items[index][field] = value
    tally.check(_post(http, RESPONSES, {**_valid(RESPONSES, daemon.model), "input": items}))


@given(
    index=st.integers(0, 2),
    field=st.sampled_from(["type", "text", "id", "name", "input", "tool_use_id", "content", "is_error", "x"]),
    value=json_values,
)
@HYPOTHESIS
def test_any_value_inside_a_content_block_is_answered_without_a_server_error(
    http: httpx.Client, tally: Tally, daemon: Daemon, index: int, field: str, value: Any
) -> None:
    messages: list[Any] = [{**m, "content": [dict(m["content"][0])]} for m in BLOCKS]
    messages[index]["content"][0][field] = value
    tally.check(_post(http, MESSAGES, {**_valid(MESSAGES, daemon.model), "messages": messages}))


def test_extreme_values_get_400_naming_the_problem(http: httpx.Client, tally: Tally, daemon: Daemon) -> None:
    cases = {
        RESPONSES: [
            {"input": "sea " * 15000},
            {"input": [{"role": "user", "content": "hi"}] * 3000},
            {"store": "yes"},
            {"previous_response_id": "resp_1"},
            {"tools": [{"type": "web_search"}]},
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": 3}}},
        ],
        MESSAGES: [
            {"max_tokens": None},
            {"messages": [{"role": "user", "content": "sea " * 15000}]},
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            {"tools": [{"name": "f"}]},
            {"tool_choice": {"type": "tool", "name": "missing"}},
            {"stop_sequences": ["x"] * 1000},
        ],
    }
    for path, changes in cases.items():
        for change in changes:
            response = _post(http, path, {**_valid(path, daemon.model), **change})
            tally.check(response)
            assert 400 <= response.status_code < 500, (path, change, response.text[:300])
    # Past the policy's range: clamped (and reported), not refused.
    for path, field in ((RESPONSES, "max_output_tokens"), (MESSAGES, "max_tokens")):
        clamped = _post(http, path, {**_valid(path, daemon.model), field: 10**12})
        tally.check(clamped)
        assert clamped.status_code == 200 and clamped.json()["flare"]["adjusted"]
    for path in (RESPONSES, MESSAGES):
        too_large = http.post(path, content=b" " * (MAX_BODY_BYTES + 1))
        tally.check(too_large)
        assert too_large.status_code == 413
    for method in ("GET", "PUT", "DELETE"):
        for path in (RESPONSES, MESSAGES, COUNT_TOKENS, MESSAGES + "/x"):
            tally.check(http.request(method, path))
