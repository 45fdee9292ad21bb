"""POST /tokenize and /detokenize over the real daemon (tiny package): vLLM's shapes, the round
trip, the chat template, API keys, and bad input as 400s naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests.integration.daemon_process import DaemonProcess, start_daemon

from flare.engine.tokenizer import Tokenizer
from flare.package.directory import open_package

KEY = "sk-tokenize-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def daemon(tiny_package: Path) -> Iterator[DaemonProcess]:
    process = start_daemon(tiny_package, ["--api-key", KEY])
    yield process
    assert process.stop() == 0, process.log()


@pytest.fixture(scope="module")
def tokenizer(tiny_package: Path) -> Tokenizer:
    return Tokenizer.from_package(open_package(tiny_package))


def post(daemon: DaemonProcess, path: str, body: object, headers: dict[str, str] = AUTH) -> httpx.Response:
    return httpx.post(f"{daemon.base_url}{path}", json=body, headers=headers, timeout=30)


def test_a_prompt_round_trips_through_tokenize_and_detokenize(daemon: DaemonProcess, tokenizer: Tokenizer) -> None:
    text = "The capital of France is Paris. Ünïcödé, emoji 🚀 and\nnew lines."
    response = post(daemon, "/tokenize", {"prompt": text})
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == {"tokens", "count", "max_model_len"}
    assert body["tokens"] == tokenizer.encode(text)
    assert body["count"] == len(body["tokens"]) > 0
    assert isinstance(body["max_model_len"], int) and body["max_model_len"] > body["count"]
    back = post(daemon, "/detokenize", {"tokens": body["tokens"]})
    assert back.status_code == 200, back.text
    assert back.json() == {"prompt": text}


def test_messages_are_counted_as_the_chat_endpoint_tokenizes_them(daemon: DaemonProcess, tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with_prompt = post(daemon, "/tokenize", {"messages": messages}).json()
    assert with_prompt["tokens"] == tokenizer.encode_chat(messages, True)
    without = post(daemon, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert without["tokens"] == tokenizer.encode_chat(messages, False)
    assert without["count"] < with_prompt["count"]
    # The chat endpoint's prompt_tokens agrees with the count.
    model = httpx.get(f"{daemon.base_url}/v1/models", headers=AUTH).json()["data"][0]["id"]
    chat = post(daemon, "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 1})
    assert chat.json()["usage"]["prompt_tokens"] == with_prompt["count"]


def test_tokenize_and_detokenize_need_the_api_key(daemon: DaemonProcess) -> None:
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        response = post(daemon, path, body, headers={})
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ("/tokenize", {"prompt": 42}, "prompt"),
        ("/tokenize", {"prompt": ["a", "b"]}, "prompt"),
        ("/tokenize", {"messages": "hello"}, "messages"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "b"}]}, "messages[0].role"),
        ("/tokenize", {"messages": [{"role": "user", "content": "b"}], "add_generation_prompt": "yes"}, "add_generation_prompt"),
        ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": 1}, "add_special_tokens"),
        ("/tokenize", {"prompt": "a", "model": 7}, "model"),
        ("/tokenize", {"prompt": "a", "surprise": 1}, "surprise"),
        ("/detokenize", {}, "tokens"),
        ("/detokenize", {"tokens": "1 2 3"}, "tokens"),
        ("/detokenize", {"tokens": [1, "2"]}, "tokens"),
        ("/detokenize", {"tokens": [1, True]}, "tokens"),
        ("/detokenize", {"tokens": [1, 2.5]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": [1], "extra": 1}, "extra"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(daemon: DaemonProcess, path: str, body: dict, param: str) -> None:
    response = post(daemon, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert error["message"] and "Traceback" not in error["message"]


def test_an_id_outside_the_vocabulary_is_named_with_the_vocabulary_size(daemon: DaemonProcess, tokenizer: Tokenizer) -> None:
    response = post(daemon, "/detokenize", {"tokens": [0, tokenizer.vocab_size]})
    assert response.status_code == 400
    assert f"tokens[1] is {tokenizer.vocab_size}" in response.json()["error"]["message"]


def test_a_body_that_is_not_json_and_a_wrong_model_are_refused_in_openai_shape(daemon: DaemonProcess) -> None:
    response = httpx.post(f"{daemon.base_url}/tokenize", content=b"{not json", headers=AUTH, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["message"]
    wrong = post(daemon, "/tokenize", {"prompt": "a", "model": "no-such-model"})
    assert wrong.status_code == 404
    assert wrong.json()["error"]["code"] == "model_not_found"
