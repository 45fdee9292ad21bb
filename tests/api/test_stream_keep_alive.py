"""A stream whose next event is late gets its API's keep-alive: an SSE comment on OpenAI's
APIs, a `ping` event on Anthropic's Messages. The fake scheduler holds the stream after its
first token, as a stalled round would."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient
from tests.fake_scheduler import FakeScheduler
from tests.server.test_http_api import MODEL, MakeClient, make_client, scheduler  # noqa: F401

KEEP_ALIVE_S = 0.1
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
RESPONSE = {"model": MODEL, "input": "Hi", "stream": True}
MESSAGE = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}], "stream": True}


async def read_for(client: TestClient, path: str, body: dict, seconds: float) -> str:
    """What a client reads of a stream in ``seconds``, then it hangs up."""
    response = await client.post(path, json=body)
    assert response.status == 200
    received = b""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while (left := deadline - loop.time()) > 0:
        try:
            received += await asyncio.wait_for(response.content.readany(), left)
        except TimeoutError:
            break
    response.close()
    return received.decode()


@pytest.mark.parametrize(("path", "body"), [("/v1/chat/completions", CHAT), ("/v1/responses", RESPONSE)])
async def test_a_stalled_openai_stream_gets_sse_comment_keep_alives(
    make_client: MakeClient, scheduler: FakeScheduler, path: str, body: dict
) -> None:
    scheduler.hold = True
    client = await make_client(scheduler, stream_keepalive_s=KEEP_ALIVE_S)
    text = await read_for(client, path, body, 10 * KEEP_ALIVE_S)
    first_token = text.index("Hel")
    assert text.count(": keep-alive\n\n") >= 3
    assert text.index(": keep-alive\n\n") > first_token, "the answer's own events come first"


async def test_a_stalled_messages_stream_gets_ping_events(make_client: MakeClient, scheduler: FakeScheduler) -> None:
    scheduler.hold = True
    client = await make_client(scheduler, stream_keepalive_s=KEEP_ALIVE_S)
    text = await read_for(client, "/v1/messages", MESSAGE, 10 * KEEP_ALIVE_S)
    pings = text.split("Hel", 1)[1].count('event: ping\ndata: {"type":"ping"}\n\n')
    assert pings >= 3, text
    assert ": keep-alive" not in text, "Messages speaks Anthropic's events only"


async def test_a_stream_with_steady_output_gets_no_keep_alive(make_client: MakeClient, scheduler: FakeScheduler) -> None:
    client = await make_client(scheduler, stream_keepalive_s=KEEP_ALIVE_S)
    response = await client.post("/v1/chat/completions", json=CHAT)
    text = await response.text()
    assert text.endswith("data: [DONE]\n\n") and ": keep-alive" not in text
