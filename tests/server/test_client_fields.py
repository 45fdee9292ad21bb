"""What clients written for OpenAI, Anthropic and llama.cpp send and check, through the real HTTP
app with the fake scheduler: each API's ids in its documented form, the documented fields chat
used to refuse, Anthropic's thinking switch, and the model names and routes tools use."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import structlog
from aiohttp.test_utils import TestClient
from tests.fake_scheduler import FakeScheduler
from tests.server.test_http_api import CHAT, MODEL, MakeClient, client, make_client, scheduler, sse_events  # noqa: F401
from tests.server.test_other_apis import MESSAGE, RESPONSE, named_events

from flare.api.tools.reader import ToolCallReader

HEX = "[0-9a-f]{32}"


def request_logs() -> Any:
    """The log lines as the daemon writes them, with the fields bound to the request."""
    return structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars])


# --- ids --------------------------------------------------------------------------------------


async def test_each_api_answers_with_its_documented_id_form(client: TestClient) -> None:
    chat = await (await client.post("/v1/chat/completions", json=CHAT)).json()
    completion = await (await client.post("/v1/completions", json={"model": MODEL, "prompt": "Once"})).json()
    response = await (await client.post("/v1/responses", json=RESPONSE)).json()
    message = await (await client.post("/v1/messages", json=MESSAGE)).json()
    assert re.fullmatch(f"chatcmpl-{HEX}", chat["id"])
    assert re.fullmatch(f"cmpl-{HEX}", completion["id"])
    assert re.fullmatch(f"resp_{HEX}", response["id"])
    assert re.fullmatch(f"msg_{HEX}", response["output"][0]["id"])
    assert re.fullmatch(f"msg_{HEX}", message["id"])


async def test_streamed_ids_take_the_same_forms(client: TestClient) -> None:
    raw = await (await client.post("/v1/responses", json={**RESPONSE, "stream": True})).text()
    events = named_events(raw)
    response_ids = {data["response"]["id"] for name, data in events if "response" in data}
    assert len(response_ids) == 1 and re.fullmatch(f"resp_{HEX}", response_ids.pop())
    item_ids = {data["item_id"] for _, data in events if "item_id" in data}
    assert len(item_ids) == 1 and re.fullmatch(f"msg_{HEX}", item_ids.pop())
    raw = await (await client.post("/v1/messages", json={**MESSAGE, "stream": True})).text()
    (start,) = [data for name, data in named_events(raw) if name == "message_start"]
    assert re.fullmatch(f"msg_{HEX}", start["message"]["id"])


def test_tool_call_ids_take_the_answering_apis_form() -> None:
    """The reader names each call in the form the renderer's API states: Anthropic's toolu_,
    OpenAI's call_ (the default)."""
    for prefix in ("toolu_", "call_"):
        reader = ToolCallReader(active=True, call_prefix=prefix)
        _, deltas = reader.push('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
        assert deltas[0]["id"].startswith(prefix)
        assert reader.calls[0].id == deltas[0]["id"]


# --- documented chat fields -----------------------------------------------------------------


async def test_chat_accepts_prompt_cache_key_safety_identifier_and_text_modalities(
    client: TestClient, scheduler: FakeScheduler
) -> None:
    with request_logs() as logs:
        for body in (
            {**CHAT, "prompt_cache_key": "conversation-7", "safety_identifier": "user-42", "modalities": ["text"]},
            {**CHAT, "modalities": None},
        ):
            response = await client.post("/v1/chat/completions", json=body)
            assert response.status == 200, await response.text()
    started = [line for line in logs if line["event"] == "generation_started"]
    assert started[0]["safety_identifier"] == "user-42" and started[0]["prompt_cache_key"] == "conversation-7"
    assert "safety_identifier" not in started[1]


async def test_responses_log_safety_identifier_and_prompt_cache_key_as_chat_does(client: TestClient) -> None:
    with request_logs() as logs:
        body = {**RESPONSE, "prompt_cache_key": "c", "safety_identifier": "u"}
        assert (await client.post("/v1/responses", json=body)).status == 200
    (started,) = [line for line in logs if line["event"] == "generation_started"]
    assert started["safety_identifier"] == "u" and started["prompt_cache_key"] == "c"


async def test_prompt_cache_key_is_a_hint_that_keeps_the_keys_scope(
    make_client: MakeClient, scheduler: FakeScheduler
) -> None:
    """Requests of one API key share cached blocks whatever their prompt_cache_key (narrowing
    would only lose hits); another key's scope stays its own."""
    client = await make_client(scheduler, api_keys=("sk-a", "sk-b"))
    for key, cache_key in (("sk-a", "one"), ("sk-a", "two"), ("sk-a", None), ("sk-b", "one")):
        headers = {"Authorization": f"Bearer {key}"}
        response = await client.post("/v1/chat/completions", json={**CHAT, "prompt_cache_key": cache_key}, headers=headers)
        assert response.status == 200
    scopes = [request.cache_scope for request in scheduler.submitted]
    assert scopes[0] == scopes[1] == scopes[2] != scopes[3]


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("modalities", ["text", "audio"], "modalities"),
        ("modalities", ["audio"], "modalities"),
        ("modalities", "text", "modalities"),
        ("audio", {"voice": "alloy", "format": "wav"}, "audio"),
        ("prompt_cache_key", 7, "prompt_cache_key"),
        ("safety_identifier", "", "safety_identifier"),
    ],
)
async def test_chat_refuses_audio_and_bad_labels_naming_the_field(
    client: TestClient, field: str, value: object, param: str
) -> None:
    response = await client.post("/v1/chat/completions", json={**CHAT, field: value})
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["param"] == param and error["code"] != "unknown_parameter"


# --- Anthropic's thinking -------------------------------------------------------------------


async def test_messages_serve_thinking_disabled(client: TestClient) -> None:
    response = await client.post("/v1/messages", json={**MESSAGE, "thinking": {"type": "disabled"}})
    assert response.status == 200
    assert (await response.json())["content"] == [{"type": "text", "text": "Hello world"}]


async def test_messages_refuse_thinking_enabled_saying_the_model_does_not_think(client: TestClient) -> None:
    body = {**MESSAGE, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    response = await client.post("/v1/messages", json=body)
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["type"] == "invalid_request_error"
    assert "thinking" in error["message"] and "this model does not reason" in error["message"]


async def test_count_tokens_takes_the_switches_a_messages_request_sends(client: TestClient) -> None:
    body = {"model": MODEL, "messages": MESSAGE["messages"], "thinking": {"type": "disabled"}, "speed": "fast"}
    response = await client.post("/v1/messages/count_tokens", json=body)
    assert response.status == 200 and (await response.json())["input_tokens"] > 0
    enabled = {**body, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    response = await client.post("/v1/messages/count_tokens", json=enabled)
    assert response.status == 400 and "does not reason" in (await response.json())["error"]["message"]


# --- names and routes -----------------------------------------------------------------------


async def test_several_served_names_are_listed_and_each_is_answered(
    make_client: MakeClient, scheduler: FakeScheduler
) -> None:
    client = await make_client(scheduler, names=("smollm2", "gpt-4o"))
    listed = await (await client.get("/v1/models")).json()
    assert [card["id"] for card in listed["data"]] == ["smollm2", "gpt-4o"]
    for name in ("smollm2", "gpt-4o"):
        body = await (await client.post("/v1/chat/completions", json={**CHAT, "model": name})).json()
        assert body["model"] == name and "model" not in body["flare"]
        assert (await client.get(f"/v1/models/{name}")).status == 200
    response = await client.post("/v1/chat/completions", json={**CHAT, "model": "other"})
    assert response.status == 404
    message = (await response.json())["error"]["message"]
    assert "'smollm2'" in message and "'gpt-4o'" in message


async def test_accept_any_model_name_answers_any_name_and_says_it_was_mapped(
    make_client: MakeClient, scheduler: FakeScheduler
) -> None:
    client = await make_client(scheduler, accept_any_name=True)
    with request_logs() as logs:
        body = await (await client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4o"})).json()
    assert body["model"] == "gpt-4o"
    assert body["flare"]["model"] == {"requested": "gpt-4o", "served": MODEL}
    (started,) = [line for line in logs if line["event"] == "generation_started"]
    assert started["model_mapped_from"] == "gpt-4o"
    raw = await (await client.post("/v1/messages", json={**MESSAGE, "model": "claude-x", "stream": True})).text()
    (start,) = [data for name, data in named_events(raw) if name == "message_start"]
    assert start["message"]["model"] == "claude-x" and start["message"]["flare"]["model"]["served"] == MODEL
    # The served name is answered as itself, not mapped; /v1/models lists the served name only.
    body = await (await client.post("/v1/chat/completions", json=CHAT)).json()
    assert "model" not in body["flare"]
    assert [card["id"] for card in (await (await client.get("/v1/models")).json())["data"]] == [MODEL]


async def test_openai_routes_answer_without_the_v1_prefix(client: TestClient) -> None:
    assert (await (await client.get("/models")).json())["data"][0]["id"] == MODEL
    assert (await client.get(f"/models/{MODEL}")).status == 200
    chat = await client.post("/chat/completions", json={**CHAT, "stream": True})
    assert chat.status == 200 and sse_events(await chat.text())[-1] == "[DONE]"
    completion = await (await client.post("/completions", json={"model": MODEL, "prompt": "Once"})).json()
    assert completion["object"] == "text_completion"
    response = await (await client.post("/responses", json=RESPONSE)).json()
    assert response["object"] == "response"
    unknown = await client.post("/chat/completions", json={**CHAT, "model": "nope"})
    assert unknown.status == 404 and (await unknown.json())["error"]["code"] == "model_not_found"


async def test_routes_without_v1_need_the_api_key_as_the_others(
    make_client: MakeClient, scheduler: FakeScheduler
) -> None:
    client = await make_client(scheduler, api_keys=("sk-a",))
    assert (await client.post("/chat/completions", json=CHAT)).status == 401
    assert (await client.get("/models")).status == 401
    ok = await client.post("/chat/completions", json=CHAT, headers={"Authorization": "Bearer sk-a"})
    assert ok.status == 200 and json.loads(await ok.text())["model"] == MODEL
