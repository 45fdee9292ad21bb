"""The Responses API, Anthropic's Messages API and completions' prompt lists against a fake
scheduler: each API's shapes and event sequences, its own error shape, and the one request path
(policy clamp report, API keys, cancellation of every sequence) applying to all of them."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from tests.fake_scheduler import FakeScheduler
from tests.server.test_http_api import MODEL, MakeClient, client, make_client, scheduler  # noqa: F401

from flare.sampler.status import DeviceStatus
from flare.scheduler.errors import QueueFull
from flare.scheduler.failures import device_failure
from flare.scheduler.request import Failed, Finished, Usage

RESPONSE = {"model": MODEL, "input": "Hi"}
MESSAGE = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]}
COMPLETION = {"model": MODEL, "prompt": "Once"}


def named_events(raw: str) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of an SSE body whose events are named, checking the name matches `type`."""
    assert raw.endswith("\n\n")
    events = []
    for block in raw[:-2].split("\n\n"):
        name_line, data_line = block.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: ")
        data = json.loads(data_line[len("data: "):])
        assert data["type"] == name_line[len("event: "):]
        events.append((data["type"], data))
    return events


def assert_openai_error(body: dict[str, Any], param: str | None = None) -> dict[str, Any]:
    assert set(body) == {"error"} and set(body["error"]) >= {"message", "type", "param", "code"}
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


def assert_anthropic_error(body: dict[str, Any], kind: str) -> str:
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    assert isinstance(body["error"]["message"], str) and "Traceback" not in body["error"]["message"]
    return body["error"]["message"]


# --- the Responses API ----------------------------------------------------------------------


async def test_responses_body_has_the_answer_usage_and_flare(client: TestClient, scheduler: FakeScheduler) -> None:
    response = await client.post("/v1/responses", json={**RESPONSE, "instructions": "Be brief.", "temperature": 5})
    assert response.status == 200
    body = await response.json()
    assert body["object"] == "response" and body["status"] == "completed" and body["incomplete_details"] is None
    assert body["instructions"] == "Be brief."
    (message,) = body["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["content"] == [{"type": "output_text", "text": "Hello world", "annotations": [], "logprobs": []}]
    assert body["usage"]["output_tokens"] == 4 and body["usage"]["total_tokens"] == body["usage"]["input_tokens"] + 4
    # The one path: the package policy's clamp is reported on every API.
    assert [a["param"] for a in body["flare"]["adjusted"]] == ["temperature"]
    assert response.headers["Flare-Sampling-Adjusted"] == "temperature"
    prompt = "".join(map(chr, scheduler.submitted[0].prompt_token_ids))
    assert prompt == "<system>Be brief.<user>Hi<assistant>"


async def test_responses_at_max_output_tokens_is_incomplete(client: TestClient, scheduler: FakeScheduler) -> None:
    scheduler.ending = lambda request: Finished("length", Usage(1, 4))
    body = await (await client.post("/v1/responses", json={**RESPONSE, "max_output_tokens": 4})).json()
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert scheduler.submitted[0].params.max_tokens == 4


async def test_responses_stream_sends_the_documented_events_in_order(client: TestClient) -> None:
    response = await client.post("/v1/responses", json={**RESPONSE, "stream": True})
    assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
    events = named_events(await response.text())
    names = [name for name, _ in events]
    assert names == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 4,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    text = "".join(data["delta"] for name, data in events if name == "response.output_text.delta")
    assert text == "Hello world" == events[-4][1]["text"]
    assert events[0][1]["response"]["status"] == "in_progress" and "flare" in events[0][1]["response"]
    final = events[-1][1]["response"]
    assert final["output"][0]["content"][0]["text"] == text and final["usage"]["output_tokens"] == 4


async def test_responses_failure_mid_stream_is_response_failed(client: TestClient, scheduler: FakeScheduler) -> None:
    scheduler.ending = lambda request: Failed(device_failure(DeviceStatus.NONFINITE_LOGITS, 1), Usage(1, 4))
    events = named_events(await (await client.post("/v1/responses", json={**RESPONSE, "stream": True})).text())
    name, data = events[-1]
    assert name == "response.failed" and data["response"]["status"] == "failed"
    assert data["response"]["error"]["code"] == "NONFINITE_LOGITS"
    refused = await client.post("/v1/responses", json=RESPONSE)
    assert refused.status >= 500 and assert_openai_error(await refused.json())["code"] == "NONFINITE_LOGITS"


async def test_responses_input_items_become_the_conversation(client: TestClient, scheduler: FakeScheduler) -> None:
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "A"}, {"type": "input_text", "text": "B"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "C"}]},
        {"role": "user", "content": "D"},
    ]
    assert (await client.post("/v1/responses", json={**RESPONSE, "input": items})).status == 200
    prompt = "".join(map(chr, scheduler.submitted[0].prompt_token_ids))
    assert prompt == "<system>Rules.<user>AB<assistant>C<user>D<assistant>"


BAD_RESPONSES = [
    ("store true with the store off", {"store": True}, "store"),
    ("previous_response_id with the store off", {"previous_response_id": "resp_1"}, "previous_response_id"),
    ("no input", {"input": None}, "input"),
    ("input a number", {"input": 3}, "input"),
    ("an image part", {"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0].type"),
    ("a bad role", {"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ("an item_reference", {"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ("an output without call_id", {"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ("instructions a list", {"instructions": ["x"]}, "instructions"),
    ("max_output_tokens zero", {"max_output_tokens": 0}, "max_output_tokens"),
    ("temperature a string", {"temperature": "hot"}, "temperature"),
    ("a web search tool", {"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ("text.format a string", {"text": {"format": "json"}}, "text.format"),
    ("text.format schema not an object", {"text": {"format": {"type": "json_schema", "name": "x", "schema": 3}}},
     "text.format.schema"),
    ("an unknown field", {"temprature": 0}, "temprature"),
    ("stream a string", {"stream": "yes"}, "stream"),
]


@pytest.mark.parametrize(("case", "change", "param"), BAD_RESPONSES, ids=[c[0] for c in BAD_RESPONSES])
async def test_bad_responses_requests_get_400_naming_the_field(
    client: TestClient, scheduler: FakeScheduler, case: str, change: dict[str, Any], param: str
) -> None:
    response = await client.post("/v1/responses", json={**RESPONSE, **change})
    assert response.status == 400, await response.text()
    assert_openai_error(await response.json(), param)
    assert scheduler.submitted == []


# --- the Messages API -----------------------------------------------------------------------


async def test_messages_body_is_anthropics(client: TestClient, scheduler: FakeScheduler) -> None:
    body = {**MESSAGE, "system": [{"type": "text", "text": "Be brief."}], "top_k": 5, "stop_sequences": ["\n\n"]}
    response = await client.post("/v1/messages", json=body)
    assert response.status == 200
    message = await response.json()
    assert message["type"] == "message" and message["role"] == "assistant" and message["model"] == MODEL
    assert message["content"] == [{"type": "text", "text": "Hello world"}]
    assert message["stop_reason"] == "end_turn" and message["stop_sequence"] is None
    assert message["usage"]["output_tokens"] == 4 and "flare" in message
    params = scheduler.submitted[0].params
    assert (params.max_tokens, params.top_k, params.stop) == (16, 5, ("\n\n",))
    assert "".join(map(chr, scheduler.submitted[0].prompt_token_ids)).startswith("<system>Be brief.<user>Hi")


async def test_messages_stream_sends_anthropics_events_in_order(client: TestClient, scheduler: FakeScheduler) -> None:
    scheduler.ending = lambda request: Finished("length", Usage(1, 4))
    events = named_events(await (await client.post("/v1/messages", json={**MESSAGE, "stream": True})).text())
    names = [name for name, _ in events]
    assert names == [
        "message_start",
        "ping",
        "content_block_start",
        *["content_block_delta"] * 4,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert "".join(data["delta"]["text"] for name, data in events if name == "content_block_delta") == "Hello world"
    assert events[0][1]["message"]["usage"]["input_tokens"] > 0
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens" and events[-2][1]["usage"] == {"output_tokens": 4}


async def test_messages_ended_by_a_stop_sequence_name_it(client: TestClient, scheduler: FakeScheduler) -> None:
    scheduler.ending = lambda request: Finished("stop", Usage(1, 4), stop_string="\n\n")
    body = {**MESSAGE, "stop_sequences": ["END", "\n\n"]}
    message = await (await client.post("/v1/messages", json=body)).json()
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "\n\n")
    events = named_events(await (await client.post("/v1/messages", json={**body, "stream": True})).text())
    delta = next(data["delta"] for name, data in events if name == "message_delta")
    assert (delta["stop_reason"], delta["stop_sequence"]) == ("stop_sequence", "\n\n")


async def test_messages_tool_turns_reach_the_prompt(client: TestClient, scheduler: FakeScheduler) -> None:
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "9C"}]}]},
    ]
    assert (await client.post("/v1/messages", json={**MESSAGE, "messages": messages})).status == 200
    prompt = "".join(map(chr, scheduler.submitted[0].prompt_token_ids))
    assert '<tool_call>{"name": "get", "arguments": {"city": "Oslo"}}</tool_call>' in prompt
    assert "<tool_response>\n9C\n</tool_response>" in prompt


async def test_count_tokens_is_the_prompt_messages_would_send(client: TestClient, scheduler: FakeScheduler) -> None:
    counted = await client.post("/v1/messages/count_tokens", json={k: v for k, v in MESSAGE.items() if k != "max_tokens"})
    assert counted.status == 200
    await client.post("/v1/messages", json=MESSAGE)
    assert (await counted.json()) == {"input_tokens": len(scheduler.submitted[0].prompt_token_ids)}


BAD_MESSAGES = [
    ("no max_tokens", {"max_tokens": None}, 400, "invalid_request_error"),
    ("max_tokens zero", {"max_tokens": 0}, 400, "invalid_request_error"),
    ("no messages", {"messages": None}, 400, "invalid_request_error"),
    ("a system role in messages", {"messages": [{"role": "system", "content": "x"}]}, 400, "invalid_request_error"),
    ("an image block", {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error"),
    ("tool_use on a user turn", {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b"}]}]},
     400, "invalid_request_error"),
    ("stop_sequences a string", {"stop_sequences": "x"}, 400, "invalid_request_error"),
    ("tool_choice any without tools", {"tool_choice": {"type": "any"}}, 400, "invalid_request_error"),
    ("a tool without input_schema", {"tools": [{"name": "f"}]}, 400, "invalid_request_error"),
    ("thinking", {"thinking": {"type": "enabled"}}, 400, "invalid_request_error"),
    ("another model", {"model": "claude"}, 404, "not_found_error"),
]


@pytest.mark.parametrize(("case", "change", "status", "kind"), BAD_MESSAGES, ids=[c[0] for c in BAD_MESSAGES])
async def test_bad_messages_requests_get_anthropics_error(
    client: TestClient, scheduler: FakeScheduler, case: str, change: dict[str, Any], status: int, kind: str
) -> None:
    response = await client.post("/v1/messages", json={**MESSAGE, **change})
    assert response.status == status, await response.text()
    assert_anthropic_error(await response.json(), kind)
    assert scheduler.submitted == []


async def test_messages_refusals_and_protocol_errors_come_in_anthropics_shape(
    client: TestClient, scheduler: FakeScheduler
) -> None:
    assert_anthropic_error(await (await client.post("/v1/messages", data=b"{")).json(), "invalid_request_error")
    wrong_method = await client.get("/v1/messages")
    assert wrong_method.status == 405
    assert_anthropic_error(await wrong_method.json(), "invalid_request_error")
    scheduler.refuse = QueueFull("full", retry_after_s=2.0)
    full = await client.post("/v1/messages", json=MESSAGE)
    assert full.status == 429 and full.headers["Retry-After"] == "2"
    assert_anthropic_error(await full.json(), "rate_limit_error")


async def test_x_api_key_is_accepted_as_the_api_key(make_client: MakeClient, scheduler: FakeScheduler) -> None:
    client = await make_client(scheduler, api_keys=["secret"])
    refused = await client.post("/v1/messages", json=MESSAGE, headers={"x-api-key": "wrong"})
    assert refused.status == 401
    assert_anthropic_error(await refused.json(), "authentication_error")
    assert (await client.post("/v1/messages", json=MESSAGE, headers={"x-api-key": "secret"})).status == 200
    assert (await client.post("/v1/responses", json=RESPONSE, headers={"Authorization": "Bearer secret"})).status == 200
    no_key = await client.post("/v1/responses", json=RESPONSE)
    assert no_key.status == 401 and assert_openai_error(await no_key.json())["code"] == "invalid_api_key"


# --- completions prompt lists ---------------------------------------------------------------


async def test_several_prompts_are_choices_numbered_prompt_major(client: TestClient, scheduler: FakeScheduler) -> None:
    response = await client.post("/v1/completions", json={**COMPLETION, "prompt": ["ab", "cde"], "n": 2})
    assert response.status == 200
    body = await response.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    # The fake suffixes choice j's texts with j: prompt k's choices are 2k and 2k+1.
    assert [c["text"] for c in body["choices"]] == ["Hel0lo0 wor0ld0", "Hel1lo1 wor1ld1"] * 2
    assert [r.prompt_token_ids for r in scheduler.submitted] == [(97, 98), (99, 100, 101)]
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 16


async def test_several_prompts_stream_with_request_wide_indexes(client: TestClient) -> None:
    response = await client.post("/v1/completions", json={**COMPLETION, "prompt": ["ab", "cd"], "stream": True})
    raw = await response.text()
    chunks = [json.loads(line[6:]) for line in raw.split("\n\n") if line.startswith("data: {")]
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: "Hello world", 1: "Hello world"}
    assert raw.endswith("data: [DONE]\n\n")


async def test_token_id_prompts_are_submitted_as_given(client: TestClient, scheduler: FakeScheduler) -> None:
    for prompt in ([104, 105], [[104, 105], [106]]):
        response = await client.post("/v1/completions", json={**COMPLETION, "prompt": prompt, "echo": True})
        assert response.status == 200
    assert [r.prompt_token_ids for r in scheduler.submitted] == [(104, 105), (104, 105), (106,)]
    body = await response.json()
    assert [c["text"][:2] for c in body["choices"]] == ["hi", "jH"]


async def test_disconnect_cancels_every_prompt_of_the_request(client: TestClient, scheduler: FakeScheduler) -> None:
    scheduler.hold = True
    response = await client.post("/v1/completions", json={**COMPLETION, "prompt": ["a", "b"], "stream": True})
    assert (await response.content.readline()).startswith(b"data: ")
    response.close()
    for _ in range(200):
        if len(scheduler.cancelled) == 2:
            break
        await asyncio.sleep(0.01)
    assert sorted(request_id for request_id, _ in scheduler.cancelled) == sorted(r.request_id for r in scheduler.submitted)


async def test_a_refused_second_prompt_cancels_the_first(client: TestClient, scheduler: FakeScheduler) -> None:
    submit = scheduler.submit

    def full_after_one(request: Any) -> Any:
        if scheduler.submitted:
            raise QueueFull("full", retry_after_s=1.0)
        return submit(request)

    scheduler.submit = full_after_one  # type: ignore[method-assign]
    response = await client.post("/v1/completions", json={**COMPLETION, "prompt": ["a", "b"]})
    assert response.status == 429
    assert [request_id for request_id, _ in scheduler.cancelled] == [scheduler.submitted[0].request_id]


@pytest.mark.parametrize(("path", "body"), [("/v1/responses", RESPONSE), ("/v1/messages", MESSAGE)])
async def test_disconnect_mid_stream_cancels_on_the_new_apis(
    client: TestClient, scheduler: FakeScheduler, path: str, body: dict[str, Any]
) -> None:
    scheduler.hold = True
    response = await client.post(path, json={**body, "stream": True})
    assert (await response.content.readline()).startswith(b"event: ")
    response.close()
    for _ in range(200):
        if scheduler.cancelled:
            break
        await asyncio.sleep(0.01)
    assert scheduler.cancelled == [(scheduler.submitted[0].request_id, None)]


async def test_a_prompt_too_long_is_refused_alike_on_every_api(make_client: MakeClient) -> None:
    client = await make_client(FakeScheduler(max_context=64))
    long = "x" * 100
    refused = await client.post("/v1/responses", json={**RESPONSE, "input": long})
    assert refused.status == 400 and assert_openai_error(await refused.json(), "input")["code"] == "context_length_exceeded"
    refused = await client.post("/v1/messages", json={**MESSAGE, "messages": [{"role": "user", "content": long}]})
    assert refused.status == 400 and "context" in assert_anthropic_error(await refused.json(), "invalid_request_error")
