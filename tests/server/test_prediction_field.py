"""OpenAI's `prediction` (predicted outputs) on chat through the real HTTP app with the fake
scheduler: the predicted text reaches the scheduler as token ids, malformed predictions get a 400
naming the field, and usage reports the accepted and rejected prediction tokens as OpenAI does."""

from __future__ import annotations

import json
from typing import Any

import pytest
import structlog
from aiohttp.test_utils import TestClient
from tests.fake_scheduler import FakeScheduler
from tests.server.test_http_api import CHAT, assert_error_shape, client, make_client, scheduler, sse_events  # noqa: F401

from flare.scheduler.request import Finished, Usage


def counted(scheduler: FakeScheduler, accepted: int, rejected: int) -> None:
    """The fake scheduler's answers report this many prediction tokens accepted and rejected."""
    scheduler.ending = lambda request: Finished("stop", Usage(len(request.prompt_token_ids), 4, 0, accepted, rejected))


async def test_the_predicted_text_reaches_the_scheduler_as_its_tokens(client: TestClient, scheduler: FakeScheduler) -> None:
    for content in ("Hello world", [{"type": "text", "text": "Hello"}, {"type": "text", "text": " world"}]):
        body = {**CHAT, "prediction": {"type": "content", "content": content}}
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status == 200, await response.text()
        assert scheduler.submitted[-1].prediction == tuple(ord(c) for c in "Hello world")


async def test_no_prediction_carries_no_predicted_tokens(client: TestClient, scheduler: FakeScheduler) -> None:
    assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200
    assert scheduler.submitted[-1].prediction == ()


@pytest.mark.parametrize(
    ("prediction", "param"),
    [
        ("Hello", "prediction"),
        ({"type": "text", "content": "Hello"}, "prediction.type"),
        ({"content": "Hello"}, "prediction.type"),
        ({"type": "content"}, "prediction.content"),
        ({"type": "content", "content": 5}, "prediction.content"),
        ({"type": "content", "content": []}, "prediction.content"),
        ({"type": "content", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "prediction.content"),
        ({"type": "content", "content": "Hello", "extra": 1}, "prediction.extra"),
    ],
)
async def test_a_malformed_prediction_gets_a_400_naming_the_field(
    client: TestClient, scheduler: FakeScheduler, prediction: Any, param: str
) -> None:
    response = await client.post("/v1/chat/completions", json={**CHAT, "prediction": prediction})
    assert response.status == 400
    error = assert_error_shape(await response.json())
    assert error["param"] == param
    assert "prediction" in error["message"]
    assert scheduler.submitted == []


async def test_a_prediction_longer_than_any_answer_could_be_is_refused(make_client: Any) -> None:
    scheduler = FakeScheduler(max_context=64)
    client = await make_client(scheduler)
    response = await client.post("/v1/chat/completions", json={**CHAT, "prediction": {"type": "content", "content": "x" * 100}})
    assert response.status == 400
    assert assert_error_shape(await response.json())["param"] == "prediction.content"


async def test_usage_reports_accepted_and_rejected_prediction_tokens(client: TestClient, scheduler: FakeScheduler) -> None:
    counted(scheduler, accepted=3, rejected=2)
    body = {**CHAT, "prediction": {"type": "content", "content": "Hello world"}}
    usage = (await (await client.post("/v1/chat/completions", json=body)).json())["usage"]
    assert usage["completion_tokens_details"] == {"accepted_prediction_tokens": 3, "rejected_prediction_tokens": 2}
    assert usage["completion_tokens"] == 4


async def test_usage_sums_the_prediction_tokens_of_every_choice(client: TestClient, scheduler: FakeScheduler) -> None:
    counted(scheduler, accepted=3, rejected=1)
    body = {**CHAT, "n": 2, "prediction": {"type": "content", "content": "Hello world"}}
    usage = (await (await client.post("/v1/chat/completions", json=body)).json())["usage"]
    assert usage["completion_tokens_details"] == {"accepted_prediction_tokens": 6, "rejected_prediction_tokens": 2}


async def test_the_streamed_usage_chunk_reports_the_prediction_tokens(client: TestClient, scheduler: FakeScheduler) -> None:
    counted(scheduler, accepted=3, rejected=2)
    body = {
        **CHAT,
        "stream": True,
        "stream_options": {"include_usage": True},
        "prediction": {"type": "content", "content": "Hello world"},
    }
    events = sse_events(await (await client.post("/v1/chat/completions", json=body)).text())
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])["usage"]
    assert usage["completion_tokens_details"] == {"accepted_prediction_tokens": 3, "rejected_prediction_tokens": 2}


async def test_an_answer_without_a_prediction_reports_zero_prediction_tokens(client: TestClient) -> None:
    usage = (await (await client.post("/v1/chat/completions", json=CHAT)).json())["usage"]
    assert usage["completion_tokens_details"] == {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}


async def test_the_finished_log_line_counts_the_prediction_tokens(client: TestClient, scheduler: FakeScheduler) -> None:
    counted(scheduler, accepted=3, rejected=2)
    body = {**CHAT, "prediction": {"type": "content", "content": "Hello world"}}
    with structlog.testing.capture_logs() as logs:
        assert (await client.post("/v1/chat/completions", json=body)).status == 200
    (finished,) = [line for line in logs if line["event"] == "generation_finished"]
    assert finished["accepted_prediction_tokens"] == 3 and finished["rejected_prediction_tokens"] == 2
