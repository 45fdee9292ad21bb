"""Stored Responses through the HTTP app (a fake scheduler, a real SQLite store): `store: true`
(the default) keeps a response, `previous_response_id` continues it, GET, input_items and
DELETE serve it, another API key gets 404, `store: false` keeps nothing, retention bounds it."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from tests.fake_scheduler import FakeScheduler
from tests.server.test_http_api import MODEL
from tests.server.test_other_apis import named_events

from flare.api.responses.store import ResponseStore, Retention, StoredResponse
from flare.daemon.config import DaemonConfig
from flare.server.context import RESPONSE_STORE
from flare.server.metrics import DaemonMetrics
from flare.server.routes import create_app
from flare.server.state import ServingState

RESPONSE = {"model": MODEL, "input": "Hi"}
KEYS = ("key-a", "key-b")
A = {"Authorization": "Bearer key-a"}
B = {"Authorization": "Bearer key-b"}
ROOMY = Retention(max_age_s=3600.0, max_bytes=1 << 30)

MakeStored = Callable[..., Awaitable[tuple[TestClient, ResponseStore]]]


@pytest.fixture
async def make_stored(tmp_path: Path) -> AsyncIterator[MakeStored]:
    opened: list[tuple[TestClient, ResponseStore]] = []

    async def make(
        scheduler: FakeScheduler, retention: Retention = ROOMY, **config: Any
    ) -> tuple[TestClient, ResponseStore]:
        state = ServingState()
        state.ready(scheduler, (MODEL,))  # type: ignore[arg-type]
        app = create_app(DaemonConfig(**config), state, DaemonMetrics.create())
        store = ResponseStore(tmp_path / "state" / "responses.sqlite3", retention)
        app[RESPONSE_STORE] = store
        client = TestClient(TestServer(app))
        await client.start_server()
        opened.append((client, store))
        return client, store

    yield make
    for client, store in opened:
        await client.close()
        store.close()


@pytest.fixture
def scheduler() -> FakeScheduler:
    return FakeScheduler()


async def create(client: TestClient, body: dict[str, Any], headers: dict[str, str] | None = None) -> dict[str, Any]:
    response = await client.post("/v1/responses", json=body, headers=headers)
    assert response.status == 200, await response.text()
    return await response.json()


def prompt_of(scheduler: FakeScheduler, k: int) -> str:
    return "".join(map(chr, scheduler.submitted[k].prompt_token_ids))


async def test_a_response_is_stored_by_default_and_got_back_whole(make_stored: MakeStored, scheduler: FakeScheduler) -> None:
    client, _ = await make_stored(scheduler)
    first = await create(client, RESPONSE)
    assert first["id"].startswith("resp_") and first["store"] is True
    got = await client.get(f"/v1/responses/{first['id']}")
    assert got.status == 200
    assert await got.json() == first
    # Without /v1 too, as the other OpenAI routes answer.
    assert await (await client.get(f"/responses/{first['id']}")).json() == first


async def test_previous_response_id_continues_the_stored_conversation(
    make_stored: MakeStored, scheduler: FakeScheduler
) -> None:
    client, _ = await make_stored(scheduler)
    first = await create(client, {**RESPONSE, "instructions": "Be brief."})
    second = await create(client, {**RESPONSE, "input": "More", "previous_response_id": first["id"]})
    assert second["previous_response_id"] == first["id"]
    # The earlier turn, its answer, then the new input; instructions are not carried over, as on OpenAI.
    assert prompt_of(scheduler, 1) == "<user>Hi<assistant>Hello world<user>More<assistant>"
    await create(client, {**RESPONSE, "input": "Again", "previous_response_id": second["id"]})
    assert prompt_of(scheduler, 2) == (
        "<user>Hi<assistant>Hello world<user>More<assistant>Hello world<user>Again<assistant>"
    )


async def test_a_streamed_response_is_stored_and_can_be_continued(make_stored: MakeStored, scheduler: FakeScheduler) -> None:
    client, _ = await make_stored(scheduler)
    raw = await (await client.post("/v1/responses", json={**RESPONSE, "stream": True})).text()
    name, data = named_events(raw)[-1]
    assert name == "response.completed" and data["response"]["store"] is True
    response_id = data["response"]["id"]
    got = await (await client.get(f"/v1/responses/{response_id}")).json()
    assert got["output"][0]["content"][0]["text"] == "Hello world"
    await create(client, {**RESPONSE, "input": "More", "previous_response_id": response_id})
    assert prompt_of(scheduler, 1) == "<user>Hi<assistant>Hello world<user>More<assistant>"


async def test_input_items_lists_the_conversation_in_openais_shape(make_stored: MakeStored, scheduler: FakeScheduler) -> None:
    client, _ = await make_stored(scheduler)
    first = await create(client, RESPONSE)
    second = await create(client, {**RESPONSE, "input": "More", "previous_response_id": first["id"]})
    listed = await (await client.get(f"/v1/responses/{second['id']}/input_items", params={"order": "asc"})).json()
    assert listed["object"] == "list" and listed["has_more"] is False
    texts = [(item["type"], item["role"], item["content"][0]["text"]) for item in listed["data"]]
    assert texts == [("message", "user", "Hi"), ("message", "assistant", "Hello world"), ("message", "user", "More")]
    assert listed["first_id"] == listed["data"][0]["id"] and listed["last_id"] == listed["data"][-1]["id"]
    newest = await (await client.get(f"/v1/responses/{second['id']}/input_items", params={"limit": "1"})).json()
    assert [item["content"][0]["text"] for item in newest["data"]] == ["More"] and newest["has_more"] is True
    bad = await client.get(f"/v1/responses/{second['id']}/input_items", params={"limit": "0"})
    assert bad.status == 400 and (await bad.json())["error"]["param"] == "limit"


async def test_delete_removes_the_response(make_stored: MakeStored, scheduler: FakeScheduler) -> None:
    client, store = await make_stored(scheduler)
    first = await create(client, RESPONSE)
    deleted = await client.delete(f"/v1/responses/{first['id']}")
    assert deleted.status == 200
    assert await deleted.json() == {"id": first["id"], "object": "response", "deleted": True}
    assert (await client.get(f"/v1/responses/{first['id']}")).status == 404
    assert (await client.delete(f"/v1/responses/{first['id']}")).status == 404
    assert store.use().responses == 0


async def test_another_api_key_gets_404_and_never_the_content(make_stored: MakeStored, scheduler: FakeScheduler) -> None:
    client, store = await make_stored(scheduler, api_keys=KEYS)
    first = await create(client, RESPONSE, A)
    for method, path in (
        ("GET", f"/v1/responses/{first['id']}"),
        ("GET", f"/v1/responses/{first['id']}/input_items"),
        ("DELETE", f"/v1/responses/{first['id']}"),
    ):
        answer = await client.request(method, path, headers=B)
        body = await answer.json()
        assert answer.status == 404, body
        assert body["error"]["message"] == f"Response with id '{first['id']}' not found."
        assert "Hello" not in json.dumps(body)
    continued = await client.post("/v1/responses", json={**RESPONSE, "previous_response_id": first["id"]}, headers=B)
    error = (await continued.json())["error"]
    assert continued.status == 400 and error["param"] == "previous_response_id"
    assert error["type"] == "invalid_request_error"
    assert error["message"] == f"Previous response with id '{first['id']}' not found."
    assert len(scheduler.submitted) == 1
    # The key that made it still has it; the file holds the key's hash, never the key.
    assert (await client.get(f"/v1/responses/{first['id']}", headers=A)).status == 200
    assert b"key-a" not in store.path.read_bytes()


async def test_an_unknown_previous_response_id_is_refused_as_openai_does(
    make_stored: MakeStored, scheduler: FakeScheduler
) -> None:
    client, _ = await make_stored(scheduler)
    answer = await client.post("/v1/responses", json={**RESPONSE, "previous_response_id": "resp_nothing"})
    assert answer.status == 400
    error = (await answer.json())["error"]
    assert error["param"] == "previous_response_id" and error["code"] == "previous_response_not_found"
    assert scheduler.submitted == []


async def test_store_false_keeps_nothing(make_stored: MakeStored, scheduler: FakeScheduler) -> None:
    client, store = await make_stored(scheduler)
    answered = await create(client, {**RESPONSE, "store": False})
    assert answered["store"] is False
    assert (await client.get(f"/v1/responses/{answered['id']}")).status == 404
    assert store.use().responses == 0
    bad = await client.post("/v1/responses", json={**RESPONSE, "store": "yes"})
    assert bad.status == 400 and (await bad.json())["error"]["param"] == "store"


async def test_retention_by_size_deletes_the_oldest_first(make_stored: MakeStored, scheduler: FakeScheduler) -> None:
    client, store = await make_stored(scheduler)
    first = await create(client, RESPONSE)
    one = store.use().bytes
    store.retention = Retention(max_age_s=3600.0, max_bytes=int(2.5 * one))
    second = await create(client, RESPONSE)
    third = await create(client, RESPONSE)
    assert (await client.get(f"/v1/responses/{first['id']}")).status == 404
    for kept in (second, third):
        assert (await client.get(f"/v1/responses/{kept['id']}")).status == 200
    assert store.use().responses == 2 and store.use().bytes <= 2.5 * one


async def test_retention_by_age_deletes_what_is_older_on_the_next_write(tmp_path: Path) -> None:
    now = 1_000_000.0
    store = ResponseStore(tmp_path / "responses.sqlite3", Retention(max_age_s=60.0, max_bytes=1 << 30), clock=lambda: now)
    for response_id, created_at in (("resp_old", now - 61.0), ("resp_new", now - 1.0)):
        store.stage(StoredResponse(response_id, "", created_at, [], {"id": response_id, "output": []}))
        await store.commit(response_id)
    assert await store.get("resp_old", "") is None
    assert await store.get("resp_new", "") is not None
    assert store.use().responses == 1 and store.use().oldest_created_at == now - 1.0
    store.close()


async def test_the_store_file_is_private_and_survives_reopening(tmp_path: Path) -> None:
    path = tmp_path / "responses.sqlite3"
    store = ResponseStore(path, ROOMY)
    store.stage(StoredResponse("resp_1", "", 1e12, [{"type": "message"}], {"id": "resp_1", "output": []}))
    await store.commit("resp_1")
    store.close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    reopened = ResponseStore(path, ROOMY)
    assert (await reopened.get("resp_1", "")) is not None and reopened.use().responses == 1
    reopened.close()


WRITER = """
import sys, anyio
from pathlib import Path
from flare.api.responses.store import ResponseStore, Retention, StoredResponse

async def main() -> None:
    store = ResponseStore(Path(sys.argv[1]), Retention(3600.0, 1 << 30))
    for k in range(100_000):
        response_id = f"resp_{k}"
        store.stage(StoredResponse(response_id, "", 1e12, [{"type": "message", "text": "x" * 2000}], {"id": response_id}))
        await store.commit(response_id)
        print(response_id, flush=True)

anyio.run(main)
"""


def test_a_writer_killed_mid_write_loses_no_committed_response_and_corrupts_none(tmp_path: Path) -> None:
    path = tmp_path / "responses.sqlite3"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    assert writer.stdout is not None
    committed = [writer.stdout.readline().strip() for _ in range(200)]
    writer.send_signal(signal.SIGKILL)
    writer.wait(30)
    connection = sqlite3.connect(path)
    assert connection.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    kept = {row[0] for row in connection.execute("SELECT id FROM responses")}
    connection.close()
    assert set(committed) <= kept


async def test_a_function_call_output_answers_the_stored_responses_call(
    make_stored: MakeStored, scheduler: FakeScheduler
) -> None:
    client, store = await make_stored(scheduler)
    call = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather", "arguments": "{}",
            "status": "completed"}
    asked = [{"type": "message", "id": "msg_1", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]}]
    store.stage(StoredResponse("resp_call", "", 1e12, asked, {"id": "resp_call", "output": [call]}))
    await store.commit("resp_call")
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    result = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
    await create(client, {**RESPONSE, "input": [result], "tools": tools, "tool_choice": "none", "previous_response_id": "resp_call"})
    assert "sunny" in prompt_of(scheduler, 0) and "Weather?" in prompt_of(scheduler, 0)
    wrong = await client.post(
        "/v1/responses",
        json={**RESPONSE, "input": [{**result, "call_id": "call_2"}], "tools": tools, "tool_choice": "none", "previous_response_id": "resp_call"},
    )
    assert wrong.status == 400 and (await wrong.json())["error"]["param"] == "input[0].call_id"


async def test_a_write_that_fails_is_logged_and_the_answer_still_served(
    make_stored: MakeStored, scheduler: FakeScheduler
) -> None:
    client, store = await make_stored(scheduler)
    store.close()  # every write now fails, as on a full or vanished disk
    answered = await client.post("/v1/responses", json=RESPONSE)
    assert answered.status == 200 and (await answered.json())["output"][0]["content"][0]["text"] == "Hello world"
