"""docs/api.md's table of every request field, held to the installed SDKs' own request types and
to what the parsers do: a field a new `openai` or `anthropic` release adds fails here until the
table says what flare does with it, instead of reaching a user as a 400."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from anthropic.types.message_create_params import MessageCreateParamsStreaming
from openai.types.chat.completion_create_params import CompletionCreateParamsStreaming
from openai.types.responses.response_create_params import ResponseCreateParamsStreaming
from tests.server.test_http_api import CHAT, MakeClient, client, make_client, scheduler  # noqa: F401
from tests.server.test_other_apis import MESSAGE, RESPONSE

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
BEHAVIOURS = ("served", "accepted and ignored", "refused")


@dataclass(frozen=True)
class Api:
    heading: str  # the line before its table in docs/api.md
    path: str
    body: dict[str, Any]  # a request that succeeds
    sdk_fields: frozenset[str]  # the SDK's request type's keys (its streaming variant: with `stream`)


APIS = {
    "chat": Api(
        "Chat Completions (`POST /v1/chat/completions`):",
        "/v1/chat/completions",
        CHAT,
        frozenset(CompletionCreateParamsStreaming.__annotations__),
    ),
    "responses": Api(
        "Responses (`POST /v1/responses`):",
        "/v1/responses",
        RESPONSE,
        frozenset(ResponseCreateParamsStreaming.__annotations__),
    ),
    "messages": Api(
        "Messages (`POST /v1/messages`):",
        "/v1/messages",
        MESSAGE,
        frozenset(MessageCreateParamsStreaming.__annotations__),
    ),
}

# A value of each accepted-and-ignored field as clients send it (answered 200), and of each
# refused field that asks for what is refused (a 400 naming the field).
EXAMPLES: dict[str, Any] = {
    "metadata": {"user_id": "u-1"},
    "store": True,
    "user": "u-1",
    "service_tier": "auto",
    "verbosity": "low",
    "prompt_cache_key": "conversation-7",
    "safety_identifier": "user-42",
    "prompt_cache_options": {"ttl": "24h"},
    "prompt_cache_retention": "24h",
    "include": ["message.output_text.logprobs"],
    "stream_options": {"include_obfuscation": False},
    "access_programs": {},
    "background_options": {},
    "image": {},
    "cache_control": {"type": "ephemeral"},
    "speed": "fast",
    "inference_geo": "us",
    "diagnostics": {},
    "user_profile_id": "profile-1",
    "workspace_id": "wrkspc-1",
    "audio": {"voice": "alloy", "format": "wav"},
    "reasoning_effort": "high",
    "web_search_options": {},
    "moderation": {},
    "functions": [{"name": "get_weather", "parameters": {"type": "object"}}],
    "function_call": {"name": "get_weather"},
    "previous_response_id": "resp_0123",
    "conversation": "conv_0123",
    "context_management": [{"type": "compaction"}],
    "prompt": {"id": "pmpt_0123"},
    "background": True,
    "reasoning": {"effort": "low"},
    "top_logprobs": 5,
    "max_tool_calls": 1,
    "container": "container_0123",
}


def doc_table(heading: str) -> dict[str, tuple[str, str]]:
    """The table after `heading` in docs/api.md: field -> (what flare does, why)."""
    lines = DOC.read_text(encoding="utf-8").splitlines()
    start = lines.index(heading)
    rows: dict[str, tuple[str, str]] = {}
    for line in lines[start + 1 :]:
        if not line.strip():
            if rows:
                break
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells[0] in ("field", "---"):
            continue
        field = re.fullmatch(r"`([a-z_]+)`", cells[0])
        assert field is not None, f"{heading}: a row's first cell names a field in backticks: {line!r}"
        assert cells[1] in BEHAVIOURS, f"{heading} {cells[0]}: one of {BEHAVIOURS}, got {cells[1]!r}"
        assert cells[1] == "served" or cells[2], f"{heading} {cells[0]}: say why it is {cells[1]}"
        assert field.group(1) not in rows, f"{heading}: {cells[0]} has two rows"
        rows[field.group(1)] = (cells[1], cells[2])
    assert rows, f"no table after {heading!r} in {DOC}"
    return rows


ROWS = [(api, field, behaviour) for api, spec in APIS.items() for field, (behaviour, _) in doc_table(spec.heading).items()]


@pytest.mark.parametrize("api", APIS)
def test_every_field_of_the_sdks_request_type_has_a_row(api: str) -> None:
    spec = APIS[api]
    missing = sorted(spec.sdk_fields - set(doc_table(spec.heading)))
    assert missing == [], f"docs/api.md's {api} table has no row for {missing}: say what flare does with them"


async def send(client: TestClient, api: str, field: str, value: Any) -> tuple[int, dict[str, Any]]:
    spec = APIS[api]
    response = await client.post(spec.path, json={**spec.body, field: value})
    return response.status, await response.json()


def error_names(body: dict[str, Any], field: str) -> bool:
    """Whether an error body (OpenAI's param, or Anthropic's message) names `field`."""
    error = body["error"]
    if "param" in error:
        return error["param"] is not None and re.match(rf"{field}\b", error["param"]) is not None
    return field in error["message"]


def unknown(body: dict[str, Any]) -> bool:
    return "unrecognized request field" in body.get("error", {}).get("message", "")


@pytest.mark.parametrize(("api", "field", "behaviour"), ROWS)
async def test_the_parser_does_what_the_table_says(client: TestClient, api: str, field: str, behaviour: str) -> None:
    if behaviour == "served":
        # Its own tests hold what it does; here: the parser knows it (null is "not sent").
        status, body = await send(client, api, field, None)
        assert not (status == 400 and unknown(body)), body
        return
    assert field in EXAMPLES, f"give {field} an example value, as clients send it, in EXAMPLES"
    status, body = await send(client, api, field, EXAMPLES[field])
    if behaviour == "accepted and ignored":
        assert status == 200, body
    else:
        assert status == 400 and error_names(body, field) and not unknown(body), body
