"""The OpenAI-compatible API against a fake scheduler: shapes, SSE framing, the flare object,
failures, admission refusals, disconnects, API keys and every bad-input path."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from tests.fake_scheduler import FakeScheduler

from flare.daemon.config import DaemonConfig
from flare.sampler.status import DeviceStatus
from flare.scheduler.errors import Draining, PromptTooLong, QueueFull
from flare.scheduler.failures import cancelled_failure, device_failure
from flare.scheduler.request import Failed, FaultSpec, Finished, Usage
from flare.server import request_body
from flare.server.metrics import DaemonMetrics
from flare.server.routes import create_app
from flare.server.state import ServingState

MODEL = "tiny-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
COMPLETION = {"model": MODEL, "prompt": "Once upon a time"}

MakeClient = Callable[..., Awaitable[TestClient]]


@pytest.fixture
async def make_client() -> AsyncIterator[MakeClient]:
    clients: list[TestClient] = []

    async def make(
        scheduler: FakeScheduler | None = None,
        names: tuple[str, ...] = (MODEL,),
        accept_any_name: bool = False,
        **config: Any,
    ) -> TestClient:
        state = ServingState()
        if scheduler is not None:
            state.ready(scheduler, names, accept_any_name=accept_any_name)  # type: ignore[arg-type]
        client = TestClient(TestServer(create_app(DaemonConfig(**config), state, DaemonMetrics.create())))
        await client.start_server()
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


@pytest.fixture
def scheduler() -> FakeScheduler:
    return FakeScheduler()


@pytest.fixture
async def client(make_client: MakeClient, scheduler: FakeScheduler) -> TestClient:
    return await make_client(scheduler)


def sse_events(raw: str) -> list[str]:
    """The `data:` payloads of an SSE body, checking OpenAI's framing on the way."""
    assert raw.endswith("\n\n"), "every event ends with a blank line"
    events = raw[:-2].split("\n\n")
    assert all(event.startswith("data: ") and "\n" not in event for event in events)
    return [event[len("data: "):] for event in events]


def assert_error_shape(body: dict[str, Any]) -> dict[str, Any]:
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in error["message"]
    return error


# --- successful answers ---------------------------------------------------------------------


async def test_chat_completion_has_openai_shape_and_reports_sampling(client: TestClient) -> None:
    response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status == 200
    body = await response.json()
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    assert isinstance(body["created"], int)
    assert body["model"] == MODEL
    assert body["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "Hello world"}, "logprobs": None, "finish_reason": "stop"}
    ]
    prompt_tokens = len("<user>Hi<assistant>")
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 4,
        "total_tokens": prompt_tokens + 4,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0},
    }
    assert body["flare"]["sampling"]["temperature"] == 0.7
    assert body["flare"]["sampling"]["top_p"] == 0.9
    assert body["flare"]["adjusted"] == []
    assert body["flare"]["fell_back"] is False
    assert "Flare-Sampling-Adjusted" not in response.headers
    assert response.headers["X-Request-Id"]


async def test_chat_stream_is_openai_sse_with_flare_object_in_first_chunk(client: TestClient) -> None:
    response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(await response.text())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert len({chunk["id"] for chunk in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert all(chunk["object"] == "chat.completion.chunk" and chunk["model"] == MODEL for chunk in chunks)
    assert all("usage" not in chunk for chunk in chunks)
    first, *deltas, last = chunks
    assert first["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ]
    assert first["flare"]["sampling"]["temperature"] == 0.7 and first["flare"]["adjusted"] == []
    assert [d["choices"][0]["delta"] for d in deltas] == [{"content": t} for t in ("Hel", "lo", " wor", "ld")]
    assert all("flare" not in chunk for chunk in (*deltas, last))
    assert last["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]


async def test_stream_include_usage_adds_a_usage_chunk_before_done(client: TestClient) -> None:
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    events = sse_events(await (await client.post("/v1/chat/completions", json=body)).text())
    chunks = [json.loads(event) for event in events[:-1]]
    assert all(chunk["usage"] is None for chunk in chunks[:-1])
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    assert events[-1] == "[DONE]"


async def test_clamped_parameters_are_reported_in_header_and_flare_object(client: TestClient) -> None:
    body = {**CHAT, "temperature": 5, "presence_penalty": 1.0, "top_p": 0.5}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status == 200
    assert response.headers["Flare-Sampling-Adjusted"] == "temperature,presence_penalty"
    flare = (await response.json())["flare"]
    assert flare["sampling"]["temperature"] == 2.0 and flare["sampling"]["top_p"] == 0.5
    adjusted = {a["param"]: a for a in flare["adjusted"]}
    assert adjusted["temperature"]["requested"] == 5 and adjusted["temperature"]["applied"] == 2.0
    assert adjusted["presence_penalty"]["applied"] == 0.0 and adjusted["presence_penalty"]["reason"]

    stream = await client.post("/v1/chat/completions", json={**body, "stream": True})
    assert stream.headers["Flare-Sampling-Adjusted"] == "temperature,presence_penalty"
    first = json.loads(sse_events(await stream.text())[0])
    assert [a["param"] for a in first["flare"]["adjusted"]] == ["temperature", "presence_penalty"]


async def test_effective_parameters_reach_the_scheduler(client: TestClient, scheduler: FakeScheduler) -> None:
    body = {**CHAT, "temperature": 0, "max_tokens": 10, "seed": 7, "stop": ["\n"], "top_k": 0}
    assert (await client.post("/v1/chat/completions", json=body)).status == 200
    params = scheduler.submitted[0].params
    assert (params.temperature, params.max_tokens, params.seed, params.stop, params.top_k) == (0.0, 10, 7, ("\n",), -1)
    assert scheduler.submitted[0].fault is None


async def test_max_tokens_is_capped_by_the_context_left_after_the_prompt(
    make_client: MakeClient,
) -> None:
    scheduler = FakeScheduler(max_context=30)
    client = await make_client(scheduler)
    response = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 100})
    prompt_tokens = len("<user>Hi<assistant>")
    assert scheduler.submitted[0].params.max_tokens == 30 - prompt_tokens
    assert response.headers["Flare-Sampling-Adjusted"] == "max_tokens"


async def test_completions_endpoint_non_streaming_and_streaming(client: TestClient) -> None:
    response = await client.post("/v1/completions", json=COMPLETION)
    assert response.status == 200
    body = await response.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["choices"] == [{"index": 0, "text": "Hello world", "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"]["prompt_tokens"] == len("Once upon a time")
    assert "sampling" in body["flare"]

    stream = await client.post("/v1/completions", json={**COMPLETION, "prompt": ["x"], "stream": True})
    events = sse_events(await stream.text())
    chunks = [json.loads(event) for event in events[:-1]]
    assert events[-1] == "[DONE]"
    assert all(chunk["object"] == "text_completion" for chunk in chunks)
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == "Hello world"
    assert "flare" in chunks[0]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_models_lists_the_served_model(client: TestClient) -> None:
    body = await (await client.get("/v1/models")).json()
    assert body == {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "flare"}]}
    assert (await client.get(f"/v1/models/{MODEL}")).status == 200
    missing = await client.get("/v1/models/other")
    assert missing.status == 404 and assert_error_shape(await missing.json())["code"] == "model_not_found"


async def test_fallback_is_reported(client: TestClient, scheduler: FakeScheduler) -> None:
    scheduler.ending = lambda request: Finished("length", Usage(1, 4), fell_back=True)
    assert (await (await client.post("/v1/chat/completions", json=CHAT)).json())["flare"]["fell_back"] is True
    events = sse_events(await (await client.post("/v1/chat/completions", json={**CHAT, "stream": True})).text())
    final = json.loads(events[-2])
    assert final["choices"][0]["finish_reason"] == "length"
    assert final["flare"] == {"fell_back": True}


# --- per-request failures -------------------------------------------------------------------


async def test_device_failure_in_a_stream_is_an_error_event_then_done(client: TestClient, scheduler: FakeScheduler) -> None:
    scheduler.ending = lambda request: Failed(device_failure(DeviceStatus.INVALID_SPECULATION, 3), Usage(1, 4))
    response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert response.status == 200
    events = sse_events(await response.text())
    assert events[-1] == "[DONE]"
    error = assert_error_shape(json.loads(events[-2]))
    assert error["code"] == "INVALID_SPECULATION"
    assert error["flare"] == {"status": 6, "status_name": "INVALID_SPECULATION", "round": 3}
    assert all("error" not in json.loads(event) for event in events[:-2])


async def test_device_failure_without_streaming_is_the_failure_status_with_error_body(
    client: TestClient, scheduler: FakeScheduler
) -> None:
    scheduler.ending = lambda request: Failed(device_failure(DeviceStatus.NONFINITE_LOGITS, 1), Usage(1, 4))
    response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status == 502
    error = assert_error_shape(await response.json())
    assert error["code"] == "NONFINITE_LOGITS" and error["type"] == "server_error"
    assert error["flare"] == {"status": 1, "status_name": "NONFINITE_LOGITS", "round": 1}


async def test_an_operator_cancel_tells_retrying_clients_not_to_retry(client: TestClient, scheduler: FakeScheduler) -> None:
    scheduler.ending = lambda request: Failed(cancelled_failure("cancelled by the operator"), Usage(1, 4))
    response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status == 503 and response.headers["x-should-retry"] == "false"
    assert assert_error_shape(await response.json())["code"] == "cancelled"
    # A device failure may be retried: no such header.
    scheduler.ending = lambda request: Failed(device_failure(DeviceStatus.NONFINITE_LOGITS, 1), Usage(1, 4))
    assert "x-should-retry" not in (await client.post("/v1/chat/completions", json=CHAT)).headers


async def test_fault_header_becomes_a_fault_spec_only_with_fault_injection(
    make_client: MakeClient, scheduler: FakeScheduler
) -> None:
    headers = {"X-Flare-Fault": "NONFINITE_LOGITS@2"}
    plain = await make_client(scheduler)
    assert (await plain.post("/v1/chat/completions", json=CHAT, headers=headers)).status == 200
    assert scheduler.submitted[-1].fault is None

    testing = await make_client(scheduler, fault_injection=True)
    assert (await testing.post("/v1/chat/completions", json=CHAT, headers=headers)).status == 200
    assert scheduler.submitted[-1].fault == FaultSpec(DeviceStatus.NONFINITE_LOGITS, 2)
    await testing.post("/v1/chat/completions", json=CHAT, headers={"X-Flare-Fault": "invalid_speculation"})
    assert scheduler.submitted[-1].fault == FaultSpec(DeviceStatus.INVALID_SPECULATION, None)

    for bad in ("NOPE", "OK", "EMPTY_DISTRIBUTION@x"):
        response = await testing.post("/v1/chat/completions", json=CHAT, headers={"X-Flare-Fault": bad})
        assert response.status == 400
        assert assert_error_shape(await response.json())["param"] == "X-Flare-Fault"


async def test_request_timeout_ends_the_request_with_504(make_client: MakeClient, scheduler: FakeScheduler) -> None:
    scheduler.hold = True
    client = await make_client(scheduler, request_timeout_s=0.05)
    response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status == 504
    assert assert_error_shape(await response.json())["code"] == "request_timeout"
    assert scheduler.cancelled[0][1] is not None and scheduler.cancelled[0][1].code == "request_timeout"


# --- admission ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("refusal", "status", "code", "retry_after"),
    [
        (QueueFull("full", retry_after_s=2.2), 429, "queue_full", "3"),
        (Draining(retry_after_s=5.0), 503, "draining", "5"),
    ],
)
async def test_admission_refusals_carry_retry_after(
    client: TestClient, scheduler: FakeScheduler, refusal: Exception, status: int, code: str, retry_after: str
) -> None:
    scheduler.refuse = refusal
    for stream in (False, True):
        response = await client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        assert response.status == status
        assert response.headers["Retry-After"] == retry_after
        assert assert_error_shape(await response.json())["code"] == code


async def test_prompt_the_scheduler_can_never_fit_is_400(client: TestClient, scheduler: FakeScheduler) -> None:
    scheduler.refuse = PromptTooLong("the whole KV cache holds 64 tokens", prompt_tokens=100, limit=63)
    response = await client.post("/v1/completions", json=COMPLETION)
    assert response.status == 400
    error = assert_error_shape(await response.json())
    assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")


async def test_health_and_generation_answer_503_while_loading(make_client: MakeClient) -> None:
    client = await make_client(None)
    health = await client.get("/health")
    assert health.status == 503 and (await health.json())["status"] == "loading"
    for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
        response = await client.request(method, path, json=CHAT)
        assert response.status == 503 and response.headers["Retry-After"]
        assert assert_error_shape(await response.json())["code"] == "model_loading"


async def test_health_is_200_when_ready_and_503_when_draining(client: TestClient, scheduler: FakeScheduler) -> None:
    assert (await client.get("/health")).status == 200
    scheduler.draining = True
    response = await client.get("/health")
    assert response.status == 503 and (await response.json())["status"] == "draining"


# --- disconnects ----------------------------------------------------------------------------


async def test_client_disconnect_mid_stream_cancels_the_request(client: TestClient, scheduler: FakeScheduler) -> None:
    scheduler.hold = True
    response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert (await response.content.readline()).startswith(b"data: ")
    response.close()  # drop the connection with the stream still open
    request_id = scheduler.submitted[0].request_id
    for _ in range(200):
        if scheduler.cancelled:
            break
        await asyncio.sleep(0.01)
    assert scheduler.cancelled == [(request_id, None)]


# --- bad input ------------------------------------------------------------------------------


BAD_CHAT_BODIES = [
    ("not json", b"{", 400, None),
    ("empty body", b"", 400, None),
    ("not an object", b"[1, 2]", 400, None),
    ("NaN constant", b'{"model": "tiny-model", "messages": [], "temperature": NaN}', 400, None),
    ("invalid UTF-8", b'{"model": "\xff"}', 400, None),
    ("no model", {"messages": CHAT["messages"]}, 400, "model"),
    ("model not a string", {**CHAT, "model": 3}, 400, "model"),
    ("no messages", {"model": MODEL}, 400, "messages"),
    ("messages not a list", {**CHAT, "messages": "hi"}, 400, "messages"),
    ("empty messages", {**CHAT, "messages": []}, 400, "messages"),
    ("message not an object", {**CHAT, "messages": ["hi"]}, 400, "messages[0]"),
    ("bad role", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("missing content", {**CHAT, "messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("content a number", {**CHAT, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (
        "image part",
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages[0].content[0]",
    ),
    ("tool message without its call id", {**CHAT, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].tool_call_id"),
    (
        "tool message with no call before it",
        {**CHAT, "messages": [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "call_1", "content": "x"}]},
        400,
        "messages[1].tool_call_id",
    ),
    (
        "tool message answering no call of the assistant message before it",
        {
            **CHAT,
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ]},
                {"role": "tool", "tool_call_id": "call_1", "content": "x"},
                {"role": "tool", "tool_call_id": "call_2", "content": "y"},
            ],
        },
        400,
        "messages[3].tool_call_id",
    ),
    ("function message", {**CHAT, "messages": [{"role": "function", "content": "x"}]}, 400, "messages[0]"),
    (
        "tool call without arguments text",
        {**CHAT, "messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}]}]},
        400,
        "messages[0].tool_calls[0].function.arguments",
    ),
    (
        "tool calls on a user message",
        {**CHAT, "messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]},
        400,
        "messages[0].tool_calls",
    ),
    ("tool not a function", {**CHAT, "tools": [{"type": "retrieval"}]}, 400, "tools[0]"),
    ("tool with a bad name", {**CHAT, "tools": [{"type": "function", "function": {"name": "a b"}}]}, 400, "tools[0].function.name"),
    (
        "tool parameters not a schema",
        {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
        400,
        "tools[0].function.parameters",
    ),
    (
        "tool parameters chained too deep",
        {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(300)}, "$ref": "#/$defs/d0"
        }}}]},
        400,
        "tools[0].function.parameters",
    ),
    (
        "strict tool parameters open to other keys",
        {**CHAT, "tools": [{"type": "function", "function": {
            "name": "f", "strict": True, "parameters": {"type": "object", "additionalProperties": True}
        }}]},
        400,
        "tools[0].function.parameters",
    ),
    (
        "tools named twice",
        {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}] * 2},
        400,
        "tools",
    ),
    (
        "tool_choice names an unknown tool",
        {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}},
        400,
        "tool_choice",
    ),
    ("tool_choice without tools", {**CHAT, "tool_choice": "required"}, 400, "tool_choice"),
    ("parallel_tool_calls not a bool", {**CHAT, "parallel_tool_calls": "yes"}, 400, "parallel_tool_calls"),
    ("n = 0", {**CHAT, "n": 0}, 400, "n"),
    ("n = true", {**CHAT, "n": True}, 400, "n"),
    ("n past OpenAI's bound", {**CHAT, "n": 129}, 400, "n"),
    ("deprecated functions", {**CHAT, "functions": [{"name": "f"}]}, 400, "functions"),
    ("logprobs not a bool", {**CHAT, "logprobs": 1}, 400, "logprobs"),
    ("top_logprobs past 20", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("top_logprobs without logprobs", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("json schema without one", {**CHAT, "response_format": {"type": "json_schema"}}, 400, "response_format.json_schema"),
    ("response_format type unknown", {**CHAT, "response_format": {"type": "xml"}}, 400, "response_format.type"),
    (
        "json schema without a name",
        {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
        400,
        "response_format.json_schema.name",
    ),
    (
        "json schema not an object",
        {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": []}}},
        400,
        "response_format.json_schema.schema",
    ),
    ("structured_outputs with two kinds", {**CHAT, "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400, "structured_outputs"),
    ("structured_outputs choice empty", {**CHAT, "structured_outputs": {"choice": []}}, 400, "structured_outputs.choice"),
    ("structured_outputs unknown kind", {**CHAT, "structured_outputs": {"xml": "a"}}, 400, "structured_outputs.xml"),
    (
        "response_format and structured_outputs",
        {**CHAT, "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        400,
        "structured_outputs",
    ),
    ("logit_bias not an object", {**CHAT, "logit_bias": [1, 5]}, 400, "logit_bias"),
    ("logit_bias past 100", {**CHAT, "logit_bias": {"1": 100.5}}, 400, "logit_bias"),
    ("logit_bias a string value", {**CHAT, "logit_bias": {"1": "5"}}, 400, "logit_bias"),
    ("logit_bias key not an id", {**CHAT, "logit_bias": {"-1": 5}}, 400, "logit_bias"),
    ("logit_bias id past the vocabulary", {**CHAT, "logit_bias": {"50000": 5}}, 400, "logit_bias"),
    ("logit_bias of 301 tokens", {**CHAT, "logit_bias": {str(i): 1 for i in range(301)}}, 400, "logit_bias"),
    ("unknown field", {**CHAT, "temprature": 0.5}, 400, "temprature"),
    ("stream not a bool", {**CHAT, "stream": "yes"}, 400, "stream"),
    ("stream_options not an object", {**CHAT, "stream_options": 1}, 400, "stream_options"),
    ("include_usage not a bool", {**CHAT, "stream_options": {"include_usage": 1}}, 400, "stream_options.include_usage"),
    ("temperature a string", {**CHAT, "temperature": "hot"}, 400, "temperature"),
    ("negative temperature", {**CHAT, "temperature": -1}, 400, "temperature"),
    ("top_p zero", {**CHAT, "top_p": 0}, 400, "top_p"),
    ("max_tokens zero", {**CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", {**CHAT, "max_tokens": -5}, 400, "max_tokens"),
    ("max_completion_tokens zero", {**CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("stop not strings", {**CHAT, "stop": [1]}, 400, "stop"),
    ("unknown model", {**CHAT, "model": "gpt-4"}, 404, "model"),
    ("template refuses", {**CHAT, "messages": [{"role": "user", "content": "refuse"}]}, 400, "messages"),
]


@pytest.mark.parametrize(("case", "body", "status", "param"), BAD_CHAT_BODIES, ids=[c[0] for c in BAD_CHAT_BODIES])
async def test_bad_chat_requests_get_4xx_with_openai_error_and_never_reach_the_scheduler(
    client: TestClient, scheduler: FakeScheduler, case: str, body: Any, status: int, param: str | None
) -> None:
    if isinstance(body, bytes):
        response = await client.post("/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    else:
        response = await client.post("/v1/chat/completions", json=body)
    assert response.status == status, await response.text()
    error = assert_error_shape(await response.json())
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert scheduler.submitted == []


BAD_COMPLETION_BODIES = [
    ("no prompt", {"model": MODEL}, "prompt"),
    ("an empty prompt list", {**COMPLETION, "prompt": []}, "prompt"),
    ("a negative token id", {**COMPLETION, "prompt": [1, -2, 3]}, "prompt"),
    ("a token id outside the vocabulary", {**COMPLETION, "prompt": [1, 50_000]}, "prompt"),
    ("a token id list among prompts outside the vocabulary", {**COMPLETION, "prompt": ["a", [1, 99_999]]}, "prompt"),
    ("a prompt neither text nor ids", {**COMPLETION, "prompt": ["a", {"text": "b"}]}, "prompt"),
    ("an empty token-id list among prompts", {**COMPLETION, "prompt": ["a", []]}, "prompt"),
    ("a token id a boolean", {**COMPLETION, "prompt": [True, 2]}, "prompt"),
    ("more sequences than max_concurrency", {**COMPLETION, "prompt": ["a"] * 9, "n": 2}, "prompt"),
    ("an empty prompt among several", {**COMPLETION, "prompt": ["a", ""]}, "prompt"),
    ("empty prompt", {**COMPLETION, "prompt": ""}, "prompt"),
    ("echo not a bool", {**COMPLETION, "echo": 1}, "echo"),
    ("logprobs past 20", {**COMPLETION, "logprobs": 21}, "logprobs"),
    ("logprobs a bool", {**COMPLETION, "logprobs": True}, "logprobs"),
    ("best_of more than n", {**COMPLETION, "best_of": 3}, "best_of"),
    ("best_of less than n", {**COMPLETION, "n": 3, "best_of": 2}, "best_of"),
    ("n a string", {**COMPLETION, "n": "2"}, "n"),
    ("messages on completions", {**COMPLETION, "messages": []}, "messages"),
]


@pytest.mark.parametrize(("case", "body", "param"), BAD_COMPLETION_BODIES, ids=[c[0] for c in BAD_COMPLETION_BODIES])
async def test_bad_completion_requests_get_400_naming_the_field(
    client: TestClient, scheduler: FakeScheduler, case: str, body: Any, param: str
) -> None:
    response = await client.post("/v1/completions", json=body)
    assert response.status == 400
    assert assert_error_shape(await response.json())["param"] == param
    assert scheduler.submitted == []


async def test_prompt_longer_than_the_context_is_400_context_length_exceeded(make_client: MakeClient) -> None:
    scheduler = FakeScheduler(max_context=16)
    client = await make_client(scheduler)
    response = await client.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": "x" * 50}]})
    assert response.status == 400
    error = assert_error_shape(await response.json())
    assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")
    assert scheduler.submitted == []


async def test_harmless_fields_and_text_parts_are_accepted(client: TestClient, scheduler: FakeScheduler) -> None:
    body = {
        **CHAT,
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}], "name": "a"},
        ],
        "n": 1, "user": "u1", "logprobs": False, "tools": [], "tool_choice": "none", "logit_bias": {},
        "response_format": {"type": "text"}, "metadata": {"k": "v"}, "store": False,
    }
    assert (await client.post("/v1/chat/completions", json=body)).status == 200
    prompt = "".join(map(chr, scheduler.submitted[0].prompt_token_ids))
    assert prompt == "<system>Be brief.<user>Hi there<assistant>"


async def test_body_over_the_size_limit_is_413(make_client: MakeClient, scheduler: FakeScheduler) -> None:
    client = await make_client(scheduler, max_body_bytes=1024)
    response = await client.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": "x" * 4096}]})
    assert response.status == 413
    assert assert_error_shape(await response.json())["code"] == "request_too_large"


async def test_a_body_that_never_arrives_is_408(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(request_body, "BODY_READ_TIMEOUT_S", 0.05)
    reader, writer = await asyncio.open_connection(client.host, client.port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"model\"")
    await writer.drain()
    assert b" 408 " in await reader.readline()
    writer.close()


async def test_unknown_route_and_wrong_method_get_openai_errors(client: TestClient) -> None:
    missing = await client.get("/v1/nothing")
    assert missing.status == 404 and assert_error_shape(await missing.json())["code"] == "not_found"
    wrong = await client.get("/v1/chat/completions")
    assert wrong.status == 405 and wrong.headers["Allow"] == "POST"
    assert_error_shape(await wrong.json())


async def test_a_bug_is_a_500_error_body_without_traceback(client: TestClient, scheduler: FakeScheduler) -> None:
    scheduler.refuse = RuntimeError("boom")
    response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status == 500
    error = assert_error_shape(await response.json())
    assert error["code"] == "internal_error" and "boom" not in error["message"]


# --- request ids and API keys ---------------------------------------------------------------


async def test_request_id_is_echoed_when_sane_and_replaced_otherwise(client: TestClient) -> None:
    sane = await client.get("/health", headers={"X-Request-Id": "abc-123"})
    assert sane.headers["X-Request-Id"] == "abc-123"
    insane = await client.get("/health", headers={"X-Request-Id": "a b\tc"})
    assert insane.headers["X-Request-Id"] not in ("", "a b\tc")
    streamed = await client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers={"X-Request-Id": "s1"})
    assert streamed.headers["X-Request-Id"] == "s1"


async def test_api_keys_are_required_except_for_health(make_client: MakeClient, scheduler: FakeScheduler) -> None:
    client = await make_client(scheduler, api_keys=("sk-one", "sk-two"))
    assert (await client.get("/health")).status == 200
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "Basic sk-one"}, {"Authorization": "Bearer "}):
        response = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
        assert response.status == 401
        assert response.headers["WWW-Authenticate"] == "Bearer"
        assert assert_error_shape(await response.json())["code"] == "invalid_api_key"
    assert (await client.get("/v1/models")).status == 401
    assert scheduler.submitted == []
    for key in ("sk-one", "sk-two"):
        response = await client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}"})
        assert response.status == 200

