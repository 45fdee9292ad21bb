"""Ollama's API against a fake scheduler, through the real app: /api/chat and /api/generate
streamed as NDJSON and not, options mapped to the sampling fields and clamped by the package
policy, format and tools on the one request path, the model endpoints, and errors in Ollama's
shape."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from tests.fake_scheduler import FakeScheduler
from tests.server.test_http_api import MODEL, MakeClient, client, make_client, scheduler  # noqa: F401

from flare.package.directory import open_package
from flare.sampler.status import DeviceStatus
from flare.scheduler.failures import device_failure
from flare.scheduler.request import Failed, Usage
from flare.structured import GrammarCompiler

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
GENERATE = {"model": MODEL, "prompt": "Once upon a time"}
COUNTERS = ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count", "eval_duration")


def ndjson_lines(response_text: str) -> list[dict[str, Any]]:
    assert response_text.endswith("\n")
    return [json.loads(line) for line in response_text[:-1].split("\n")]


def assert_done(line: dict[str, Any], reason: str = "stop") -> None:
    assert line["done"] is True and line["done_reason"] == reason
    assert all(isinstance(line[name], int) and line[name] >= 0 for name in COUNTERS), line
    assert line["total_duration"] == pytest.approx(line["prompt_eval_duration"] + line["eval_duration"], abs=1)
    assert 0 < line["prompt_eval_duration"] <= line["total_duration"]


async def test_chat_streams_ndjson_by_default_with_a_done_line(client: TestClient, scheduler: FakeScheduler) -> None:
    response = await client.post("/api/chat", json=CHAT)
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("application/x-ndjson")
    lines = ndjson_lines(await response.text())
    pieces, last = lines[:-1], lines[-1]
    assert all(line["done"] is False and line["model"] == MODEL for line in pieces)
    assert "".join(line["message"]["content"] for line in pieces) == "Hello world"
    assert all(line["message"]["role"] == "assistant" for line in lines)
    assert_done(last)
    assert last["prompt_eval_count"] == len(scheduler.submitted[0].prompt_token_ids)
    assert last["eval_count"] == 4


async def test_chat_not_streamed_is_one_object(client: TestClient) -> None:
    response = await client.post("/api/chat", json={**CHAT, "stream": False})
    assert response.status == 200
    body = await response.json()
    assert body["message"] == {"role": "assistant", "content": "Hello world"}
    assert body["model"] == MODEL and body["created_at"].endswith("Z")
    assert_done(body)


async def test_generate_streams_and_answers_in_one_object(client: TestClient, scheduler: FakeScheduler) -> None:
    lines = ndjson_lines(await (await client.post("/api/generate", json=GENERATE)).text())
    assert "".join(line["response"] for line in lines) == "Hello world"
    assert_done(lines[-1])
    body = await (await client.post("/api/generate", json={**GENERATE, "stream": False})).json()
    assert body["response"] == "Hello world"
    assert_done(body)


async def test_generate_renders_the_chat_template_unless_raw(client: TestClient, scheduler: FakeScheduler) -> None:
    await client.post("/api/generate", json={**GENERATE, "system": "Be brief.", "stream": False})
    templated = "".join(map(chr, scheduler.submitted[0].prompt_token_ids))
    assert "Be brief." in templated and "Once upon a time" in templated and templated != "Once upon a time"
    await client.post("/api/generate", json={**GENERATE, "raw": True, "stream": False})
    assert "".join(map(chr, scheduler.submitted[1].prompt_token_ids)) == "Once upon a time"


async def test_generate_without_a_prompt_answers_loaded(client: TestClient, scheduler: FakeScheduler) -> None:
    body = await (await client.post("/api/generate", json={"model": MODEL})).json()
    assert body["done"] is True and body["done_reason"] == "load"
    assert scheduler.submitted == []


async def test_options_are_mapped_and_clamped_by_the_policy(client: TestClient, scheduler: FakeScheduler) -> None:
    options = {
        "temperature": 5, "top_k": 20, "repeat_penalty": 9, "num_predict": 7, "seed": 3, "stop": ["\n\n"],
        "num_ctx": 8192, "num_thread": 4, "mirostat": 2,
    }
    body = await (await client.post("/api/chat", json={**CHAT, "stream": False, "options": options})).json()
    params = scheduler.submitted[0].params
    assert (params.temperature, params.top_k, params.repetition_penalty) == (2.0, 20, 1.5)
    assert (params.max_tokens, params.seed, params.stop) == (7, 3, ("\n\n",))
    adjusted = {a["param"] for a in body["flare"]["adjusted"]}
    assert adjusted == {"temperature", "repetition_penalty"}


async def test_num_predict_minus_one_takes_the_policy_default(client: TestClient, scheduler: FakeScheduler) -> None:
    await client.post("/api/generate", json={**GENERATE, "stream": False, "options": {"num_predict": -1}})
    assert scheduler.submitted[0].params.max_tokens == 256


async def test_served_name_answers_with_and_without_latest(client: TestClient) -> None:
    response = await client.post("/api/chat", json={**CHAT, "model": f"{MODEL}:latest", "stream": False})
    assert response.status == 200
    assert (await response.json())["model"] == f"{MODEL}:latest"


async def test_tool_turns_reach_the_prompt_in_order(client: TestClient, scheduler: FakeScheduler) -> None:
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "9C", "tool_name": "get"},
    ]
    assert (await client.post("/api/chat", json={**CHAT, "messages": messages, "stream": False})).status == 200
    prompt = "".join(map(chr, scheduler.submitted[0].prompt_token_ids))
    assert '<tool_call>{"name": "get", "arguments": {"city": "Oslo"}}</tool_call>' in prompt
    assert "<tool_response>\n9C\n</tool_response>" in prompt


def _scheduler_with_compiler(tiny_package: Path, reply: tuple[str, ...]) -> FakeScheduler:
    package = open_package(tiny_package)
    config = package.manifest.model
    scheduler = FakeScheduler(reply=reply)
    scheduler.grammars = GrammarCompiler(  # type: ignore[assignment]
        package.tokenizer_json_path.read_text(), vocab_size=config.vocab_size, eos_token_ids=config.eos_token_ids
    )
    return scheduler


TOOLS = [{"type": "function", "function": {"name": "get", "description": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = ('<tool_call>{"name": "get", "arguments": ', '{"city": "Oslo"}', "}</tool_call>")


async def test_tool_calls_come_back_in_ollamas_form(make_client: MakeClient, tiny_package: Path) -> None:
    client = await make_client(_scheduler_with_compiler(tiny_package, CALL))
    body = await (await client.post("/api/chat", json={**CHAT, "tools": TOOLS, "stream": False})).json()
    assert body["message"]["tool_calls"] == [{"function": {"name": "get", "arguments": {"city": "Oslo"}}}]
    assert_done(body)
    lines = ndjson_lines(await (await client.post("/api/chat", json={**CHAT, "tools": TOOLS})).text())
    calls = [call for line in lines for call in line["message"].get("tool_calls", ())]
    assert calls == [{"function": {"name": "get", "arguments": {"city": "Oslo"}}}]
    assert_done(lines[-1])


async def test_format_is_the_structured_output_constraint(make_client: MakeClient, tiny_package: Path) -> None:
    scheduler = _scheduler_with_compiler(tiny_package, ('{"a": 1}',))
    client = await make_client(scheduler)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for format_ in ("json", schema):
        response = await client.post("/api/generate", json={**GENERATE, "format": format_, "stream": False})
        assert response.status == 200
    assert all(request.grammar is not None for request in scheduler.submitted)
    assert scheduler.submitted[1].grammar.spec.param == "format"


async def test_tags_show_ps_and_version_describe_the_served_model(make_client: MakeClient, scheduler: FakeScheduler) -> None:
    client = await make_client(scheduler, names=(MODEL, "alias:7b"))
    tags = await (await client.get("/api/tags")).json()
    assert [m["name"] for m in tags["models"]] == [f"{MODEL}:latest", "alias:7b"]
    assert all({"model", "modified_at", "size", "digest", "details"} <= set(m) for m in tags["models"])
    shown = await (await client.post("/api/show", json={"model": f"{MODEL}:latest"})).json()
    assert shown["details"]["family"] == "llama"
    assert shown["model_info"]["llama.context_length"] == 2048
    assert "temperature 0.7" in shown["parameters"].split("\n")
    assert "completion" in shown["capabilities"]
    ps = await (await client.get("/api/ps")).json()
    assert ps["models"][0]["name"] == f"{MODEL}:latest" and ps["models"][0]["context_length"] == 2048
    version = await (await client.get("/api/version")).json()
    assert isinstance(version["version"], str) and version["version"]


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/api/chat", {**CHAT, "model": "nope"}, 404),
        ("/api/show", {"model": "nope"}, 404),
        ("/api/generate", {**GENERATE, "model": "nope:latest"}, 404),
        ("/api/generate", {**GENERATE, "template": "{{ .Prompt }}"}, 400),
        ("/api/generate", {**GENERATE, "context": [1, 2, 3]}, 400),
        ("/api/chat", {**CHAT, "options": {"temperature": "hot"}}, 400),
        ("/api/chat", {**CHAT, "options": {"num_predict": 0}}, 400),
        ("/api/chat", {**CHAT, "format": "yaml"}, 400),
        ("/api/chat", {**CHAT, "messages": [{"role": "tool", "content": "9C"}]}, 400),
        ("/api/chat", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400),
        ("/api/chat", {**CHAT, "surprise": 1}, 400),
        ("/api/chat", {**CHAT, "think": True}, 400),
        ("/api/chat", {**CHAT, "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, 400),
        ("/api/chat", {**CHAT, "format": "json", "tools": TOOLS}, 400),
        ("/api/chat", {**CHAT, "keep_alive": True}, 400),
        ("/api/generate", {**GENERATE, "raw": "yes"}, 400),
    ],
)
async def test_errors_are_ollamas_shape_with_the_right_status(
    client: TestClient, path: str, body: dict[str, Any], status: int
) -> None:
    response = await client.post(path, json=body)
    assert response.status == status
    error = await response.json()
    assert set(error) == {"error"} and isinstance(error["error"], str) and "Traceback" not in error["error"]


async def test_bad_option_error_names_ollamas_option(client: TestClient) -> None:
    response = await client.post("/api/chat", json={**CHAT, "options": {"num_predict": 0}})
    assert "options.num_predict" in (await response.json())["error"]


async def test_a_stream_that_fails_ends_with_an_error_line(client: TestClient, scheduler: FakeScheduler) -> None:
    scheduler.ending = lambda request: Failed(device_failure(DeviceStatus.NONFINITE_LOGITS, 3), Usage(1, 1))
    lines = ndjson_lines(await (await client.post("/api/chat", json=CHAT)).text())
    assert set(lines[-1]) == {"error"}
    response = await client.post("/api/chat", json={**CHAT, "stream": False})
    assert response.status >= 500 and set(await response.json()) == {"error"}


async def test_keep_alive_is_accepted_and_a_stalled_stream_gets_empty_pieces(
    make_client: MakeClient, scheduler: FakeScheduler
) -> None:
    scheduler.hold = True
    client = await make_client(scheduler, stream_keepalive_s=0.05)
    response = await client.post("/api/chat", json={**CHAT, "keep_alive": "5m"})
    assert response.status == 200
    first = json.loads(await response.content.readline())
    assert first["message"]["content"] == "Hel"
    stalled = json.loads(await response.content.readline())
    assert stalled["done"] is False and stalled["message"]["content"] == ""
    response.close()


async def test_a_missing_key_and_an_unknown_route_answer_in_ollamas_shape(
    make_client: MakeClient, scheduler: FakeScheduler
) -> None:
    client = await make_client(scheduler, api_keys=("sk-a",))
    refused = await client.post("/api/chat", json=CHAT)
    assert refused.status == 401 and isinstance((await refused.json())["error"], str)
    missing = await client.post("/api/pull", json={"model": "x"}, headers={"Authorization": "Bearer sk-a"})
    assert missing.status == 404 and isinstance((await missing.json())["error"], str)
