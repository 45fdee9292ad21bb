"""logprobs, top_logprobs, echo and logit_bias over the real daemon (tiny package), read with the
official OpenAI client in OpenAI's shapes, streaming and not."""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import pytest
from tests.integration.daemon_process import DaemonProcess

from flare.engine.tokenizer import Tokenizer
from flare.package.directory import open_package

CHAT = [{"role": "user", "content": "Write a short poem about the sea."}]


@pytest.fixture(scope="module")
def daemon(tiny_daemon: DaemonProcess) -> DaemonProcess:
    return tiny_daemon


async def test_chat_logprobs_are_consistent_with_greedy_choices_streaming_and_not(client, model) -> None:
    answer = await client.chat.completions.create(
        model=model, messages=CHAT, temperature=0, max_tokens=12, logprobs=True, top_logprobs=3
    )
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    assert "".join(entry.token for entry in content) == answer.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert bytes(entry.bytes).decode("utf-8") == entry.token
        assert entry.logprob <= 0
    stream = await client.chat.completions.create(
        model=model, messages=CHAT, temperature=0, max_tokens=12, logprobs=True, top_logprobs=3, stream=True
    )
    streamed = [e for chunk in [c async for c in stream] if chunk.choices and chunk.choices[0].logprobs
                for e in chunk.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)


async def test_chat_without_logprobs_reports_none(client, model) -> None:
    answer = await client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=4)
    assert answer.choices[0].logprobs is None


async def test_logit_bias_minus_100_removes_the_greedy_token_and_the_flare_object_shows_it(
    client, model, daemon: DaemonProcess, tiny_package: Path
) -> None:
    plain = await client.chat.completions.create(
        model=model, messages=CHAT, temperature=0, max_tokens=1, logprobs=True, top_logprobs=2
    )
    first = plain.choices[0].logprobs.content[0]
    tokenizer = Tokenizer.from_package(open_package(tiny_package))
    ids = tokenizer.encode(first.token, add_special_tokens=False)
    assert len(ids) == 1 and tokenizer.token_bytes(ids[0]) == bytes(first.bytes)
    biased = await client.chat.completions.create(
        model=model, messages=CHAT, temperature=0, max_tokens=1, logprobs=True, logit_bias={str(ids[0]): -100}
    )
    assert biased.choices[0].logprobs.content[0].token == first.top_logprobs[1].token
    assert biased.model_extra["flare"]["sampling"]["logit_bias"] == {str(ids[0]): -100.0}
    async with httpx.AsyncClient(base_url=daemon.base_url) as http:
        outside = await http.post(
            "/v1/chat/completions",
            json={"model": model, "messages": CHAT, "max_tokens": 1, "logit_bias": {str(tokenizer.vocab_size): -100}},
        )
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "logit_bias"


async def test_completions_echo_scores_the_prompt_and_streams_it_first(client, model) -> None:
    prompt = "one two three four one two three"
    answer = await client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2)
    choice = answer.choices[0]
    assert choice.text.startswith(prompt)
    logprobs = choice.logprobs
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in logprobs.token_logprobs[1:])
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    completion_tokens = answer.usage.completion_tokens
    assert len(logprobs.tokens) == answer.usage.prompt_tokens + completion_tokens
    assert all(len(top) <= 2 for top in logprobs.top_logprobs[1:])
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2, stream=True
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None
    assert streamed[1:] == pytest.approx(logprobs.token_logprobs[1:], abs=1e-4)


async def test_echo_without_logprobs_prepends_the_prompt(client, model) -> None:
    answer = await client.completions.create(model=model, prompt="Hello there", max_tokens=3, temperature=0, echo=True)
    assert answer.choices[0].text.startswith("Hello there") and answer.choices[0].logprobs is None
    stream = await client.completions.create(
        model=model, prompt="Hello there", max_tokens=3, temperature=0, echo=True, stream=True
    )
    text = "".join([c.choices[0].text async for c in stream if c.choices])
    assert text == answer.choices[0].text


async def test_sampled_logprobs_sum_to_at_most_one_and_are_finite(client, model) -> None:
    answer = await client.chat.completions.create(
        model=model, messages=CHAT, temperature=0.8, seed=5, max_tokens=8, logprobs=True, top_logprobs=5
    )
    for entry in answer.choices[0].logprobs.content:
        assert sum(math.exp(t.logprob) for t in entry.top_logprobs) <= 1 + 1e-4
        assert entry.logprob > -9999


async def test_logprobs_mode_raw_reports_the_models_distribution_and_the_flare_object_says_which(client, model) -> None:
    answers = {}
    for mode in ("processed", "raw"):
        answers[mode] = await client.chat.completions.create(
            model=model, messages=CHAT, temperature=0.5, seed=9, max_tokens=6, logprobs=True, top_logprobs=2,
            extra_body={"logprobs_mode": mode},
        )
    processed, raw = (answers[m].choices[0].logprobs.content for m in ("processed", "raw"))
    assert [e.token for e in processed] == [e.token for e in raw]  # the same sampling
    assert all(r.logprob != pytest.approx(p.logprob, abs=1e-3) for p, r in zip(processed, raw))
    assert answers["processed"].model_extra["flare"]["logprobs"]["mode"] == "processed"
    assert answers["processed"].model_extra["flare"]["logprobs"]["temperature"] == 0.5
    assert answers["raw"].model_extra["flare"]["logprobs"] == {"mode": "raw", "temperature": 1.0, "filtered": False}
    greedy = await client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=2, logprobs=True)
    assert greedy.model_extra["flare"]["logprobs"]["temperature"] == 1.0
