"""The default model (SmolLM2-135M-Instruct) behind flare, driven unchanged by the official
`ollama` Python client: chat (streamed and not), generate, a JSON-schema format, list, show and
ps, and an unknown model's error as the client raises it."""

from __future__ import annotations

import json

import ollama
import pytest
from tests.integration.daemon_process import DaemonProcess

pytestmark = pytest.mark.real_model
MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"
GREEDY = {"temperature": 0, "num_predict": 24}


@pytest.fixture(scope="module")
def daemon(default_model_daemon: DaemonProcess) -> DaemonProcess:
    return default_model_daemon


@pytest.fixture
def client(daemon: DaemonProcess) -> ollama.Client:
    return ollama.Client(host=daemon.base_url)


def test_chat_answers_paris_with_ollamas_counters(client: ollama.Client) -> None:
    response = client.chat(model=f"{MODEL}:latest", messages=[{"role": "user", "content": QUESTION}], options=GREEDY)
    assert "Paris" in response.message.content
    assert response.done and response.done_reason in ("stop", "length")
    assert response.prompt_eval_count and response.eval_count
    # Ollama's durations in nanoseconds: the prompt's up to the first token, then the answer's.
    assert response.prompt_eval_duration and response.eval_duration
    assert abs(response.total_duration - (response.prompt_eval_duration + response.eval_duration)) <= 1


def test_chat_streams_the_same_answer(client: ollama.Client) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    whole = client.chat(model=MODEL, messages=messages, options=GREEDY).message.content
    parts = list(client.chat(model=MODEL, messages=messages, options=GREEDY, stream=True))
    assert "".join(part.message.content for part in parts) == whole
    assert parts[-1].done and not any(part.done for part in parts[:-1])


def test_generate_answers_and_options_are_clamped(client: ollama.Client) -> None:
    response = client.generate(model=MODEL, prompt=QUESTION, options={**GREEDY, "num_ctx": 99999})
    assert "Paris" in response.response
    assert response.eval_count is not None and 0 < response.eval_count <= 24


def test_format_schema_holds_the_answer(client: ollama.Client) -> None:
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}}, "required": ["capital"]}
    response = client.chat(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], format=schema, options={"temperature": 0}
    )
    assert set(json.loads(response.message.content)) == {"capital"}


def test_list_show_and_ps_describe_the_served_model(client: ollama.Client) -> None:
    assert [model.model for model in client.list().models] == [f"{MODEL}:latest"]
    shown = client.show(MODEL)
    assert shown.details is not None and shown.details.family
    assert shown.modelinfo is not None and "completion" in (shown.capabilities or [])
    assert [model.model for model in client.ps().models] == [f"{MODEL}:latest"]


def test_an_unknown_model_is_the_clients_404(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as raised:
        client.chat(model="llama3:8b", messages=[{"role": "user", "content": "Hi"}])
    assert raised.value.status_code == 404 and "llama3:8b" in raised.value.error
