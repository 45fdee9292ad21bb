"""n choices and cached prompt tokens over the HTTP API, in OpenAI's shapes (a fake scheduler)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from tests.fake_scheduler import FakeScheduler
from tests.server.test_http_api import CHAT, COMPLETION, assert_error_shape, client, make_client, scheduler, sse_events  # noqa: F401

from flare.scheduler.errors import TooManyChoices
from flare.scheduler.request import Finished, Usage


async def test_n_choices_come_back_in_index_order_with_the_prompt_counted_once(
    client: TestClient, scheduler: FakeScheduler
) -> None:
    response = await client.post("/v1/chat/completions", json={**CHAT, "n": 3})
    assert response.status == 200
    body = await response.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in body["choices"]] == [f"Hel{i}lo{i} wor{i}ld{i}" for i in range(3)]
    assert all(c["finish_reason"] == "stop" for c in body["choices"])
    prompt_tokens = len(scheduler.submitted[0].prompt_token_ids)
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert body["usage"]["completion_tokens"] == 3 * 4
    assert scheduler.submitted[0].n == 3


async def test_a_stream_of_n_choices_interleaves_them_by_index_and_ends_with_one_usage_chunk(client: TestClient) -> None:
    body = {**CHAT, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    events = sse_events(await (await client.post("/v1/chat/completions", json=body)).text())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert all(len(chunk["choices"]) == 1 for chunk in chunks[:-1])
    indices = [chunk["choices"][0]["index"] for chunk in chunks[:-1]]
    assert indices[:2] == [0, 1]  # a role chunk for each choice first
    assert [chunks[k]["choices"][0]["delta"] for k in (0, 1)] == [{"role": "assistant", "content": ""}] * 2
    assert "flare" in chunks[0] and "flare" not in chunks[1]
    texts: dict[int, str] = {0: "", 1: ""}
    finishes: dict[int, str] = {}
    for chunk in chunks[2:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["delta"].get("content", "")
        if choice["finish_reason"] is not None:
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {0: "Hel0lo0 wor0ld0", 1: "Hel1lo1 wor1ld1"}
    assert finishes == {0: "stop", 1: "stop"}
    assert indices[2:6] == [0, 1, 0, 1]  # interleaved as the tokens came, not one after the other
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8


async def test_completions_take_n_with_best_of_equal_to_n(client: TestClient, scheduler: FakeScheduler) -> None:
    response = await client.post("/v1/completions", json={**COMPLETION, "n": 2, "best_of": 2})
    assert response.status == 200
    body = await response.json()
    assert [c["text"] for c in body["choices"]] == ["Hel0lo0 wor0ld0", "Hel1lo1 wor1ld1"]
    assert scheduler.submitted[0].n == 2


async def test_more_choices_than_the_server_runs_at_once_is_a_400_naming_n(
    client: TestClient, scheduler: FakeScheduler
) -> None:
    scheduler.refuse = TooManyChoices("n is 40, but this server runs at most 32 sequences at once", 32)
    response = await client.post("/v1/chat/completions", json={**CHAT, "n": 40})
    assert response.status == 400
    error = assert_error_shape(await response.json())
    assert error["param"] == "n" and "32" in error["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
async def test_usage_reports_the_prompt_tokens_served_from_the_cache(
    client: TestClient, scheduler: FakeScheduler, stream: bool
) -> None:
    scheduler.ending = lambda request: Finished("stop", Usage(len(request.prompt_token_ids), 4, cached_tokens=16))
    body: dict[str, Any] = {**CHAT, "stream": stream, "stream_options": {"include_usage": True}} if stream else CHAT
    response = await client.post("/v1/chat/completions", json=body)
    if stream:
        usage = json.loads(sse_events(await response.text())[-2])["usage"]
    else:
        usage = (await response.json())["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 16}
