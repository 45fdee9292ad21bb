"""A model that reasons in `<think>...</think>`: its reasoning reaches each API's reasoning
field, streamed and not, and its answer is what follows the end mark."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from tests.fake_scheduler import FakeScheduler
from tests.server.test_stored_responses import MakeStored, make_stored  # noqa: F401  (a fixture)

from flare.daemon.config import DaemonConfig
from flare.package.reasoning_formats import THINK, ReasoningFormat
from flare.server.metrics import DaemonMetrics
from flare.server.routes import create_app
from flare.server.state import ServingState

MODEL = "tiny-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
# The marks split across pieces, as tokens split them.
THOUGHT = ("<th", "ink>\nLet me", " think.</th", "ink>\n\n", "Hello", " there")
SWITCHABLE = ReasoningFormat(THINK.name, THINK.start, THINK.end, switchable=True)


def thinking_scheduler(reply: tuple[str, ...] = THOUGHT, fmt: ReasoningFormat | None = SWITCHABLE) -> FakeScheduler:
    scheduler = FakeScheduler(reply=reply)
    scheduler.tokenizer.reasoning_format = fmt
    return scheduler


@pytest.fixture
async def serve() -> AsyncIterator[Any]:
    clients: list[TestClient] = []

    async def start(scheduler: FakeScheduler) -> TestClient:
        state = ServingState()
        state.ready(scheduler, (MODEL,))  # type: ignore[arg-type]
        client = TestClient(TestServer(create_app(DaemonConfig(), state, DaemonMetrics.create())))
        await client.start_server()
        clients.append(client)
        return client

    yield start
    for client in clients:
        await client.close()


def sse_data(raw: str) -> list[Any]:
    return [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


async def test_chat_answer_carries_the_reasoning_in_reasoning_content(serve: Any) -> None:
    client = await serve(thinking_scheduler())
    response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status == 200
    message = (await response.json())["choices"][0]["message"]
    assert message["content"] == "Hello there"
    assert message["reasoning_content"] == "\nLet me think."


async def test_chat_stream_sends_reasoning_deltas_then_content_deltas(serve: Any) -> None:
    client = await serve(thinking_scheduler())
    response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    deltas = [chunk["choices"][0]["delta"] for chunk in sse_data(await response.text())[1:]]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    assert reasoning == "\nLet me think." and content == "Hello there"
    assert not any("<th" in d.get("content", "") or "</" in d.get("reasoning_content", "") for d in deltas)


async def test_prompt_that_opens_the_reasoning_starts_the_answer_inside_it(serve: Any) -> None:
    scheduler = thinking_scheduler(reply=("Hmm.", "</think>", "\n\nYes"))
    scheduler.tokenizer.encode_chat = lambda *a, **k: scheduler.tokenizer.encode("<assistant><think>\n")  # type: ignore[method-assign]
    client = await serve(scheduler)
    message = (await (await client.post("/v1/chat/completions", json=CHAT)).json())["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Yes", "reasoning_content": "Hmm."}


async def test_answer_without_reasoning_is_all_content(serve: Any) -> None:
    client = await serve(thinking_scheduler(reply=("Hel", "lo")))
    message = (await (await client.post("/v1/chat/completions", json=CHAT)).json())["choices"][0]["message"]
    assert message["content"] == "Hello" and message["reasoning_content"] == ""


async def test_reasoning_effort_none_switches_the_templates_thinking_off(serve: Any) -> None:
    scheduler = thinking_scheduler(reply=("Hi",))
    client = await serve(scheduler)
    response = await client.post("/v1/chat/completions", json={**CHAT, "reasoning_effort": "none"})
    assert response.status == 200
    assert scheduler.tokenizer.template_kwargs == {"enable_thinking": False}
    await client.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {"enable_thinking": True}})
    assert scheduler.tokenizer.template_kwargs == {"enable_thinking": True}


async def test_reasoning_asked_of_a_model_that_does_not_reason_is_refused_naming_the_field(serve: Any) -> None:
    client = await serve(thinking_scheduler(fmt=None))
    response = await client.post("/v1/chat/completions", json={**CHAT, "reasoning_effort": "high"})
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["param"] == "reasoning_effort" and "does not reason" in error["message"]
    plain = await (await client.post("/v1/chat/completions", json=CHAT)).json()
    assert "reasoning_content" not in plain["choices"][0]["message"]


async def test_a_grammar_other_than_a_json_schema_with_reasoning_on_is_refused_naming_its_field(serve: Any) -> None:
    client = await serve(thinking_scheduler())
    response = await client.post("/v1/chat/completions", json={**CHAT, "structured_outputs": {"regex": "[ab]+"}})
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["param"] == "structured_outputs.regex" and "reasons before it answers" in error["message"]


MESSAGES = {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}]}


async def test_messages_answer_opens_with_a_thinking_block_when_thinking_is_enabled(serve: Any) -> None:
    scheduler = thinking_scheduler()
    client = await serve(scheduler)
    body = {**MESSAGES, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    response = await client.post("/v1/messages", json=body)
    assert response.status == 200
    content = (await response.json())["content"]
    assert content == [
        {"type": "thinking", "thinking": "\nLet me think.", "signature": ""},
        {"type": "text", "text": "Hello there"},
    ]
    assert scheduler.tokenizer.template_kwargs == {"enable_thinking": True}


async def test_messages_stream_sends_thinking_deltas_in_their_own_block(serve: Any) -> None:
    client = await serve(thinking_scheduler())
    response = await client.post("/v1/messages", json={**MESSAGES, "stream": True})
    events = sse_data(await response.text())
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text"]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "\nLet me think."
    assert "".join(d.get("text", "") for d in deltas) == "Hello there"
    assert [d["type"] for d in deltas].count("signature_delta") == 1
    assert [e["type"] for e in events].count("content_block_stop") == 2


async def test_messages_answer_with_its_thinking_block_can_be_sent_back(serve: Any) -> None:
    client = await serve(thinking_scheduler())
    body = {**MESSAGES, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    first = await (await client.post("/v1/messages", json=body)).json()
    turns = [*MESSAGES["messages"], {"role": "assistant", "content": first["content"]}, {"role": "user", "content": "And?"}]
    response = await client.post("/v1/messages", json={**body, "messages": turns})
    assert response.status == 200, await response.text()


async def test_messages_thinking_enabled_is_refused_for_a_model_that_does_not_reason(serve: Any) -> None:
    client = await serve(thinking_scheduler(fmt=None))
    response = await client.post("/v1/messages", json={**MESSAGES, "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert response.status == 400
    body = await response.json()
    assert body["type"] == "error" and "does not reason" in body["error"]["message"]


RESPONSES = {"model": MODEL, "input": "Hi"}


async def test_responses_output_opens_with_a_reasoning_item(serve: Any) -> None:
    client = await serve(thinking_scheduler())
    response = await client.post("/v1/responses", json=RESPONSES)
    assert response.status == 200
    reasoning, message = (await response.json())["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "\nLet me think."}]
    assert message["type"] == "message" and message["content"][0]["text"] == "Hello there"


async def test_responses_stream_closes_the_reasoning_item_before_the_message_opens(serve: Any) -> None:
    client = await serve(thinking_scheduler())
    response = await client.post("/v1/responses", json={**RESPONSES, "stream": True})
    events = sse_data(await response.text())
    kinds = [e["type"] for e in events]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert deltas == "\nLet me think."
    done = next(e for e in events if e["type"] == "response.reasoning_text.done")
    assert done["text"] == "\nLet me think."
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    first_done = kinds.index("response.output_item.done")
    assert events[first_done]["item"]["type"] == "reasoning"
    assert first_done < kinds.index("response.output_text.delta")
    final = events[-1]["response"]["output"]
    assert [item["type"] for item in final] == ["reasoning", "message"]


async def test_responses_reasoning_effort_none_switches_thinking_off(serve: Any) -> None:
    scheduler = thinking_scheduler(reply=("Hi",))
    client = await serve(scheduler)
    response = await client.post("/v1/responses", json={**RESPONSES, "reasoning": {"effort": "none"}})
    assert response.status == 200
    assert scheduler.tokenizer.template_kwargs == {"enable_thinking": False}
    bad = await client.post("/v1/responses", json={**RESPONSES, "reasoning": {"effort": "huge"}})
    assert bad.status == 400 and (await bad.json())["error"]["param"] == "reasoning.effort"


async def test_a_stored_response_with_reasoning_can_be_continued(make_stored: MakeStored) -> None:
    client, _ = await make_stored(thinking_scheduler())
    first = await (await client.post("/v1/responses", json=RESPONSES)).json()
    assert [item["type"] for item in first["output"]] == ["reasoning", "message"]
    body = {"model": MODEL, "input": "And?", "previous_response_id": first["id"]}
    response = await client.post("/v1/responses", json=body)
    assert response.status == 200, await response.text()
    sent_back = {"model": MODEL, "input": [*first["output"], {"role": "user", "content": "And?"}]}
    response = await client.post("/v1/responses", json=sent_back)
    assert response.status == 200, await response.text()


async def test_chat_stream_keeps_the_logprobs_of_reasoning_tokens(serve: Any) -> None:
    client = await serve(thinking_scheduler())
    response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True, "logprobs": True})
    chunks = sse_data(await response.text())[1:]
    reasoning_chunks = [c for c in chunks if "reasoning_content" in c["choices"][0]["delta"]]
    assert reasoning_chunks and all(c["choices"][0]["logprobs"] is not None for c in reasoning_chunks)
