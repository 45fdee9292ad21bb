"""The real daemon, started as `flare run <tiny package> --port 0`, driven by the official OpenAI client."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from tests.integration.daemon_process import DaemonProcess, start_daemon

CHAT = [{"role": "user", "content": "Write a short poem about the sea."}]


@pytest.fixture(scope="module")
def daemon(tiny_package: Path) -> Iterator[DaemonProcess]:
    process = start_daemon(tiny_package, ["--fault-injection", "--max-concurrency", "8"])
    yield process
    assert process.stop() == 0, process.log()


async def test_models_lists_the_one_served_model(client: openai.AsyncOpenAI) -> None:
    models = await client.models.list()
    assert len(models.data) == 1 and models.data[0].id
    assert (await client.models.retrieve(models.data[0].id)).id == models.data[0].id


async def test_concurrent_greedy_streams_complete_with_identical_text(client: openai.AsyncOpenAI, model: str) -> None:
    async def one_stream() -> tuple[str, str | None, int]:
        stream = await client.chat.completions.create(
            model=model, messages=CHAT, stream=True, temperature=0, max_tokens=24,
            stream_options={"include_usage": True},
        )
        texts, finish_reason, completion_tokens = [], None, -1
        async for chunk in stream:
            if chunk.choices:
                texts.append(chunk.choices[0].delta.content or "")
                finish_reason = chunk.choices[0].finish_reason or finish_reason
            if chunk.usage is not None:
                completion_tokens = chunk.usage.completion_tokens
        return "".join(texts), finish_reason, completion_tokens

    results = await asyncio.gather(*(one_stream() for _ in range(6)))
    texts = {text for text, _, _ in results}
    assert len(texts) == 1 and texts.pop()
    assert all(reason in ("stop", "length") for _, reason, _ in results)
    assert all(1 <= tokens <= 24 for _, _, tokens in results)


async def test_non_streaming_chat_reports_the_applied_sampling(client: openai.AsyncOpenAI, model: str) -> None:
    raw = await client.chat.completions.with_raw_response.create(
        model=model, messages=CHAT, max_tokens=8, top_p=0.01, temperature=0.5
    )
    assert raw.headers["Flare-Sampling-Adjusted"] == "top_p"
    completion = raw.parse()
    assert completion.object == "chat.completion" and completion.id.startswith("chatcmpl-")
    assert completion.choices[0].message.role == "assistant"
    assert completion.usage is not None and 1 <= completion.usage.completion_tokens <= 8
    flare = (completion.model_extra or {})["flare"]
    assert flare["sampling"]["top_p"] == 0.05 and flare["sampling"]["temperature"] == 0.5
    assert [a["param"] for a in flare["adjusted"]] == ["top_p"]


async def test_completions_endpoint_streams_and_answers(client: openai.AsyncOpenAI, model: str) -> None:
    completion = await client.completions.create(model=model, prompt="The sea is", max_tokens=6, temperature=0)
    assert completion.object == "text_completion" and completion.choices[0].finish_reason in ("stop", "length")
    stream = await client.completions.create(model=model, prompt="The sea is", max_tokens=6, temperature=0, stream=True)
    streamed = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
    assert streamed == completion.choices[0].text


async def test_bad_requests_get_openai_errors(client: openai.AsyncOpenAI, model: str, daemon: DaemonProcess) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        await client.chat.completions.create(model="gpt-4", messages=CHAT)
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad_max_tokens:
        await client.chat.completions.create(model=model, messages=CHAT, max_tokens=0)
    assert bad_max_tokens.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as empty:
        await client.chat.completions.create(model=model, messages=[])
    assert empty.value.param == "messages"
    long_prompt = [{"role": "user", "content": "sea " * 2000}]
    with pytest.raises(openai.BadRequestError) as too_long:
        await client.chat.completions.create(model=model, messages=long_prompt)
    assert too_long.value.code == "context_length_exceeded"

    async with httpx.AsyncClient(base_url=daemon.base_url) as http:
        malformed = await http.post("/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"})
        assert malformed.status_code == 400 and set(malformed.json()["error"]) == {"message", "type", "param", "code"}
        assert (await http.get("/health")).status_code == 200


async def test_injected_fault_fails_only_that_request(client: openai.AsyncOpenAI, model: str) -> None:
    fault = {"X-Flare-Fault": "NONFINITE_LOGITS"}

    async def faulty_stream() -> openai.APIError:
        stream = await client.chat.completions.create(
            model=model, messages=CHAT, stream=True, max_tokens=16, extra_headers=fault
        )
        with pytest.raises(openai.APIError) as raised:
            async for _ in stream:
                pass
        return raised.value

    async def healthy() -> str | None:
        completion = await client.chat.completions.create(model=model, messages=CHAT, max_tokens=16, temperature=0)
        return completion.choices[0].finish_reason

    error, finish_reason = await asyncio.gather(faulty_stream(), healthy())
    assert error.code == "NONFINITE_LOGITS"
    assert finish_reason in ("stop", "length")

    with pytest.raises(openai.APIStatusError) as non_streaming:
        await client.chat.completions.create(model=model, messages=CHAT, max_tokens=16, extra_headers=fault)
    assert non_streaming.value.status_code == 502
    body = non_streaming.value.body
    assert isinstance(body, dict) and body["flare"]["status_name"] == "NONFINITE_LOGITS"


def test_sigterm_lets_a_stream_in_flight_finish_and_exits_0(tiny_package: Path) -> None:
    daemon = start_daemon(tiny_package)
    try:
        body = {
            "model": daemon.model_name(), "messages": CHAT, "stream": True, "max_tokens": 64,
            "temperature": 0, "stream_options": {"include_usage": True},
        }
        with httpx.stream("POST", f"{daemon.base_url}/v1/chat/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line)
            assert first.startswith("data: ")
            daemon.process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        last = json.loads(rest[-2].removeprefix("data: "))
        assert "error" not in last and last["usage"]["completion_tokens"] >= 1
        assert daemon.stop() == 0, daemon.log()
        assert daemon.events("draining") and daemon.events("stopped")
    finally:
        daemon.kill()


def test_sigterm_past_the_grace_period_ends_streams_with_a_shutdown_error(tiny_package: Path) -> None:
    daemon = start_daemon(tiny_package, ["--drain-grace-s", "0", "--draft-tokens", "0"])
    try:
        body = {"model": daemon.model_name(), "messages": CHAT, "stream": True, "max_tokens": 400, "temperature": 1.0}
        with httpx.stream("POST", f"{daemon.base_url}/v1/chat/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            next(line for line in lines if line)
            daemon.process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        last = json.loads(rest[-2].removeprefix("data: "))
        # Either the stream finished within the round that was running, or it was ended cleanly.
        assert ("error" in last and last["error"]["code"] == "shutdown") or last["choices"][0]["finish_reason"]
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.kill()


def test_socket_activation_serves_on_the_socket_systemd_passes(tiny_package: Path) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    # What systemd does: the listening socket as fd 3, LISTEN_PID naming the daemon, LISTEN_FDS=1.
    activate = (
        "import os, sys; os.dup2(int(sys.argv[1]), 3); "
        "os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS='1'); os.execv(sys.argv[2], sys.argv[2:])"
    )
    wrapper = [sys.executable, "-c", activate, str(listener.fileno())]
    daemon = start_daemon(tiny_package, wrapper=wrapper, pass_fds=[listener.fileno()])
    try:
        listener.close()  # the daemon holds its own copy
        assert daemon.events("listening")[0]["port"] == port
        completion = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": daemon.model_name(), "prompt": "The sea", "max_tokens": 2},
            timeout=60,
        )
        assert completion.status_code == 200
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.kill()


async def test_a_client_that_disconnects_mid_stream_cancels_its_request(
    daemon: DaemonProcess, model: str, client: openai.AsyncOpenAI
) -> None:
    body = {"model": model, "messages": CHAT, "stream": True, "max_tokens": 400, "temperature": 1.0}
    async with httpx.AsyncClient(base_url=daemon.base_url, timeout=60) as http:
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            first = await anext(response.aiter_lines())
            completion_id = json.loads(first.removeprefix("data: "))["id"]
    for _ in range(600):
        if any(e.get("completion_id") == completion_id for e in daemon.events("generation_cancelled")):
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError(f"no generation_cancelled event for {completion_id}:\n{daemon.log()}")
    completion = await client.chat.completions.create(model=model, messages=CHAT, max_tokens=4)
    assert completion.choices[0].finish_reason in ("stop", "length")


async def test_overload_is_429_with_retry_after_and_api_keys_are_enforced(tiny_package: Path) -> None:
    daemon = start_daemon(tiny_package, ["--max-concurrency", "1", "--max-waiting", "1", "--api-key", "sk-test"])
    try:
        anonymous = openai.AsyncOpenAI(base_url=f"{daemon.base_url}/v1", api_key="sk-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await anonymous.models.list()
        assert daemon.health() == 200  # /health stays public

        keyed = openai.AsyncOpenAI(base_url=f"{daemon.base_url}/v1", api_key="sk-test", max_retries=0)
        model = (await keyed.models.list()).data[0].id

        async def one() -> int:
            try:
                await keyed.chat.completions.create(
                    model=model, messages=CHAT, max_tokens=48, temperature=1.0
                )
            except openai.RateLimitError as error:
                assert int(error.response.headers["Retry-After"]) >= 1
                return 429
            return 200

        statuses = await asyncio.gather(*(one() for _ in range(6)))
        assert 200 in statuses and 429 in statuses
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.kill()


FAULT_STATUSES = {
    # status name: (HTTP status of a non-streaming request, OpenAI error type)
    "NONFINITE_LOGITS": (502, "server_error"),
    "INVALID_DRAFT_TOKEN": (502, "server_error"),
    "INVALID_DRAFT_PROBABILITY": (502, "server_error"),
    "EMPTY_DISTRIBUTION": (422, "invalid_request_error"),
    "INVALID_SAMPLING_PARAMETERS": (422, "invalid_request_error"),
}


@pytest.mark.parametrize("status_name", list(FAULT_STATUSES))
async def test_every_device_status_reaches_the_client_in_the_documented_shape(
    daemon: DaemonProcess, model: str, status_name: str
) -> None:
    http_status, error_type = FAULT_STATUSES[status_name]
    body = {"model": model, "messages": CHAT, "max_tokens": 16, "temperature": 0}
    headers = {"X-Flare-Fault": f"{status_name}@1"}
    async with httpx.AsyncClient(base_url=daemon.base_url, timeout=60) as http:
        plain = await http.post("/v1/chat/completions", json=body, headers=headers)
        assert plain.status_code == http_status, plain.text
        error = plain.json()["error"]
        assert (error["code"], error["type"]) == (status_name, error_type)
        assert error["flare"]["status_name"] == status_name and error["flare"]["round"] is not None

        streamed = await http.post("/v1/chat/completions", json={**body, "stream": True}, headers=headers)
        events = [e.removeprefix("data: ") for e in streamed.text.split("\n\n") if e]
        assert streamed.status_code == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == status_name


async def test_invalid_speculation_falls_back_and_says_so(daemon: DaemonProcess, model: str) -> None:
    body = {"model": model, "messages": CHAT, "max_tokens": 8, "temperature": 0}
    async with httpx.AsyncClient(base_url=daemon.base_url, timeout=60) as http:
        response = await http.post("/v1/chat/completions", json=body, headers={"X-Flare-Fault": "INVALID_SPECULATION@1"})
    assert response.status_code == 200, response.text
    assert response.json()["flare"]["fell_back"] is True


LONG_SYSTEM = "You are a patient tutor. Explain every step, check the arithmetic twice, and be brief. " * 4


async def test_a_repeated_prompt_is_served_from_the_prefix_cache_with_the_same_answer(
    client: openai.AsyncOpenAI, model: str
) -> None:
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "What is 7 times 8?"}]
    first = await client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=12)
    again = await client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=12)
    assert first.usage is not None and again.usage is not None
    assert first.usage.prompt_tokens_details is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // 16 * 16 - 16 > 0
    assert again.choices[0].message.content == first.choices[0].message.content


async def test_n_choices_stream_interleaved_by_index_through_the_openai_client(
    client: openai.AsyncOpenAI, model: str
) -> None:
    stream = await client.chat.completions.create(
        model=model, messages=CHAT, stream=True, temperature=1.0, seed=5, max_tokens=16, n=3,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = {0: "", 1: "", 2: ""}
    reasons: dict[int, str] = {}
    usage = None
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
        usage = chunk.usage or usage
    assert sorted(reasons) == [0, 1, 2] and len(set(texts.values())) == 3
    assert usage is not None and 3 <= usage.completion_tokens <= 48
    single = await client.chat.completions.create(model=model, messages=CHAT, temperature=1.0, seed=5, max_tokens=16)
    assert single.choices[0].message.content == texts[0]  # choice 0 samples with the request's seed
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model=model, messages=CHAT, max_tokens=4, n=9)
    assert refused.value.body["param"] == "n"  # type: ignore[index]
