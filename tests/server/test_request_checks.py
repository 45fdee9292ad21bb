"""The checks every API makes the same way, through the real HTTP app (a fake scheduler): tool
results paired with their calls on all three conversation APIs, metadata within OpenAI's bounds,
the Responses API's `include` and item fields, Anthropic's content and tool_result fields, an
assistant prefill continued, and the headers every response carries."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from tests.fake_scheduler import FakeScheduler
from tests.server.test_http_api import MODEL, MakeClient, client, make_client, scheduler  # noqa: F401
from tests.server.test_other_apis import assert_anthropic_error, assert_openai_error

from flare.server.connections import raw_error_response

MESSAGE = {"model": MODEL, "max_tokens": 16}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
RESPONSE = {"model": MODEL, "input": "Hi"}
TOOL_USE = {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}}
FUNCTION_CALL = {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{}"}


async def _anthropic_400(client: TestClient, body: dict[str, Any]) -> str:
    response = await client.post("/v1/messages", json={**MESSAGE, **body})
    assert response.status == 400
    message = assert_anthropic_error(await response.json(), "invalid_request_error")
    return message


async def _openai_400(client: TestClient, path: str, body: dict[str, Any], param: str) -> str:
    response = await client.post(path, json=body)
    assert response.status == 400
    return assert_openai_error(await response.json(), param)["message"]


# --- tool results answer the calls before them, on every API ---------------------------------


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        (
            [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": [TOOL_USE]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "18 C"}]},
            ],
            "messages[2].content[0].tool_use_id",
        ),
        (
            [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"}]}],
            "messages[0].content[0].tool_use_id",
        ),
    ],
    ids=["unmatched tool_use_id", "tool_result with no tool_use before it"],
)
async def test_messages_tool_result_answering_no_tool_use_is_a_400_naming_its_id(
    client: TestClient, scheduler: FakeScheduler, messages: list[dict[str, Any]], field: str
) -> None:
    message = await _anthropic_400(client, {"messages": messages})
    assert field in message
    assert scheduler.submitted == []


async def test_messages_tool_result_answering_its_tool_use_is_served(client: TestClient) -> None:
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [TOOL_USE]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"}]},
    ]
    assert (await client.post("/v1/messages", json={**MESSAGE, "messages": messages})).status == 200


@pytest.mark.parametrize(
    ("items", "param"),
    [
        (
            [{"role": "user", "content": "Weather?"}, FUNCTION_CALL,
             {"type": "function_call_output", "call_id": "call_9", "output": "18 C"}],
            "input[2].call_id",
        ),
        ([{"type": "function_call_output", "call_id": "call_1", "output": "18 C"}], "input[0].call_id"),
    ],
    ids=["unmatched call_id", "lone function_call_output"],
)
async def test_responses_function_call_output_answering_no_call_is_a_400_naming_its_call_id(
    client: TestClient, scheduler: FakeScheduler, items: list[dict[str, Any]], param: str
) -> None:
    await _openai_400(client, "/v1/responses", {**RESPONSE, "instructions": "Be brief.", "input": items}, param)
    assert scheduler.submitted == []


async def test_responses_function_call_output_answering_its_call_is_served(client: TestClient) -> None:
    items = [
        {"role": "user", "content": "Weather?"},
        FUNCTION_CALL,
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
    ]
    assert (await client.post("/v1/responses", json={**RESPONSE, "input": items})).status == 200


# --- loose fields ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metadata", "param"),
    [
        ({f"k{i}": "v" for i in range(1500)}, "metadata"),
        ({f"k{i}": "v" for i in range(17)}, "metadata"),
        ({"k" * 65: "v"}, "metadata"),
        ({"k": "v" * 513}, "metadata.k"),
        ({"k": 5}, "metadata.k"),
        (["k"], "metadata"),
    ],
    ids=["1500 keys", "17 keys", "long key", "long value", "number value", "a list"],
)
@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/chat/completions", CHAT), ("/v1/completions", {"model": MODEL, "prompt": "Hi"}),
     ("/v1/responses", RESPONSE)],
    ids=["chat", "completions", "responses"],
)
async def test_metadata_outside_openais_bounds_is_a_400_on_every_api(
    client: TestClient, path: str, body: dict[str, Any], metadata: Any, param: str
) -> None:
    await _openai_400(client, path, {**body, "metadata": metadata}, param)


async def test_messages_metadata_outside_the_bounds_is_a_400_and_user_id_is_served(client: TestClient) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    message = await _anthropic_400(client, {"messages": messages, "metadata": {f"k{i}": "v" for i in range(1500)}})
    assert "1500" in message
    served = await client.post("/v1/messages", json={**MESSAGE, "messages": messages, "metadata": {"user_id": "u-1"}})
    assert served.status == 200


@pytest.mark.parametrize(
    ("include", "param"),
    [
        (["no.such.value"], "include[0]"),
        (["message.output_text.logprobs", 3], "include[1]"),
        ([["file_search_call.results"]], "include[0]"),
        ("x", "include"),
    ],
)
async def test_responses_include_with_unknown_values_is_a_400(client: TestClient, include: Any, param: str) -> None:
    await _openai_400(client, "/v1/responses", {**RESPONSE, "include": include}, param)


async def test_responses_include_with_openais_values_is_served(client: TestClient) -> None:
    body = {**RESPONSE, "include": ["message.output_text.logprobs", "reasoning.encrypted_content"]}
    assert (await client.post("/v1/responses", json=body)).status == 200


@pytest.mark.parametrize(
    ("field", "value"),
    [("id", {"x": 1}), ("status", ["completed"]), ("status", "done")],
    ids=["object id", "list status", "unknown status"],
)
async def test_responses_input_item_id_and_status_of_the_wrong_kind_are_a_400(
    client: TestClient, field: str, value: Any
) -> None:
    items = [{"type": "message", "role": "user", "content": "Hi", field: value}]
    await _openai_400(client, "/v1/responses", {**RESPONSE, "input": items}, f"input[0].{field}")


async def test_responses_input_item_with_a_string_id_and_status_is_served(client: TestClient) -> None:
    items = [{"type": "message", "role": "user", "content": "Hi", "id": "msg_1", "status": "completed"}]
    assert (await client.post("/v1/responses", json={**RESPONSE, "input": items})).status == 200


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": []}],
        [{"role": "user", "content": ""}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": []}, {"role": "user", "content": "Hi"}],
    ],
    ids=["empty block list", "empty string", "empty assistant turn before the last"],
)
async def test_messages_empty_content_is_a_400_naming_it(
    client: TestClient, scheduler: FakeScheduler, messages: list[dict[str, Any]]
) -> None:
    message = await _anthropic_400(client, {"messages": messages})
    index = next(i for i, m in enumerate(messages) if m["content"] in ("", []))
    assert f"messages[{index}].content" in message
    assert scheduler.submitted == []


@pytest.mark.parametrize("is_error", ["yes", 1, "false"])
async def test_messages_tool_result_is_error_must_be_a_boolean(client: TestClient, is_error: Any) -> None:
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [TOOL_USE]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "x", "is_error": is_error}]},
    ]
    message = await _anthropic_400(client, {"messages": messages})
    assert "messages[2].content[0].is_error" in message


# --- an assistant prefill is continued ------------------------------------------------------


async def test_messages_final_assistant_turn_is_continued_not_answered_afresh(
    client: TestClient, scheduler: FakeScheduler
) -> None:
    messages = [
        {"role": "user", "content": "The capital of France, as JSON?"},
        {"role": "assistant", "content": '{"capital": "'},
    ]
    response = await client.post("/v1/messages", json={**MESSAGE, "messages": messages})
    assert response.status == 200
    prompt = "".join(map(chr, scheduler.submitted[0].prompt_token_ids))
    assert prompt.endswith('<assistant>{"capital": "')  # no new turn opened after the prefill
    # The answer is the continuation alone, as Anthropic returns it.
    assert (await response.json())["content"][0]["text"] == "Hello world"


async def test_messages_prefill_with_trailing_whitespace_or_ending_in_tool_use_is_a_400(client: TestClient) -> None:
    ask = {"role": "user", "content": "Hi"}
    message = await _anthropic_400(client, {"messages": [ask, {"role": "assistant", "content": "Sure "}]})
    assert "messages[1].content" in message and "trailing whitespace" in message
    message = await _anthropic_400(client, {"messages": [ask, {"role": "assistant", "content": [TOOL_USE]}]})
    assert "messages[1]" in message and "tool_result" in message


async def test_chat_keeps_answering_after_a_final_assistant_message_unless_asked_to_continue(
    client: TestClient, scheduler: FakeScheduler
) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    assert (await client.post("/v1/chat/completions", json={**CHAT, "messages": messages})).status == 200
    assert "".join(map(chr, scheduler.submitted[0].prompt_token_ids)).endswith("<assistant>Hel<assistant>")
    body = {**CHAT, "messages": messages, "continue_final_message": True}
    assert (await client.post("/v1/chat/completions", json=body)).status == 200
    assert "".join(map(chr, scheduler.submitted[1].prompt_token_ids)).endswith("<assistant>Hel")


@pytest.mark.parametrize(
    "body",
    [
        {**CHAT, "continue_final_message": True},  # the final message is the user's
        {**CHAT, "continue_final_message": "yes"},
        {**CHAT, "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "{"}],
         "continue_final_message": True, "response_format": {"type": "json_object"}},
    ],
    ids=["final message not an assistant's", "not a boolean", "with a response format"],
)
async def test_chat_continue_final_message_that_cannot_be_honoured_is_a_400(
    client: TestClient, scheduler: FakeScheduler, body: dict[str, Any]
) -> None:
    await _openai_400(client, "/v1/chat/completions", body, "continue_final_message")
    assert scheduler.submitted == []


# --- headers on every response --------------------------------------------------------------


async def test_every_response_carries_nosniff(client: TestClient) -> None:
    answers = [
        await client.get("/health"),  # JSON
        await client.post("/v1/chat/completions", json={**CHAT, "stream": True}),  # SSE
        await client.post("/v1/chat/completions", json={**CHAT, "n": "x"}),  # an API error
        await client.post("/v1/messages", json={**MESSAGE}),  # Anthropic's error
        await client.get("/no/such/path"),  # aiohttp's own 404
        await client.get("/v1/chat/completions"),  # aiohttp's own 405
        await client.get("/"),  # the chat page
    ]
    assert [a.status for a in answers] == [200, 200, 400, 400, 404, 405, 200]
    for answer in answers:
        assert answer.headers.get("X-Content-Type-Options") == "nosniff", (answer.url, answer.status)


def test_raw_answers_before_the_app_carry_nosniff() -> None:
    head = raw_error_response(503, "too many connections", "overloaded").split(b"\r\n\r\n")[0]
    assert b"\r\nX-Content-Type-Options: nosniff" in head
