"""Log-probabilities through the scheduler: output tokens' (with and without speculation and
vocabulary shards) and prompt tokens' (echo), as a client of the scheduler reads them."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from tests.running_scheduler import running

from flare.policy.params import SamplingParams
from flare.scheduler.request import Finished, GenerationRequest, TextDelta

PROMPTS = [
    "one two three four one two three four one two three four one two",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "a b c d e f g a b c d e f g a b c",
    "Hello, world! Hello, world! Hello, world!",
]


GREEDY = SamplingParams(temperature=0.0, max_tokens=10)


async def _generate(scheduler, request: GenerationRequest) -> list[TextDelta]:
    deltas = []
    async for event in scheduler.submit(request):
        if isinstance(event, TextDelta):
            deltas.append(event)
        else:
            assert isinstance(event, Finished), event
    return deltas


def _request(scheduler, rid: str, prompt: str, **fields) -> GenerationRequest:
    return GenerationRequest(rid, tuple(scheduler.tokenizer.encode(prompt)), fields.pop("params", GREEDY), **fields)


async def test_greedy_tokens_are_their_top_logprob_alike_with_and_without_speculation(tiny_package):
    results = []
    for options in ({"draft_tokens": 0}, {"draft_length": "fixed"}):
        async with running(tiny_package, **options) as scheduler:
            deltas = await _generate(scheduler, _request(scheduler, "r", PROMPTS[0], logprobs=3))
        entries = [e for d in deltas for e in d.logprobs]
        assert [e.token_id for e in entries] == [t for d in deltas for t in d.token_ids]
        for entry in entries:
            assert len(entry.top) == 3
            assert entry.top[0][0] == entry.token_id
            assert entry.logprob == pytest.approx(entry.top[0][1])
            assert entry.logprob <= 0 and entry.top[0][1] >= entry.top[1][1] >= entry.top[2][1]
        results.append(entries)
    plain, speculative = results
    assert [e.token_id for e in plain] == [e.token_id for e in speculative]
    for a, b in zip(plain, speculative):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


async def test_vocabulary_parallel_logprobs_equal_the_unsharded_ones(tiny_package, vocabulary_parallel_package):
    got = []
    for package, options in ((tiny_package, {}), (vocabulary_parallel_package, {"vocabulary_shards": 4})):
        async with running(package, draft_tokens=0, **options) as scheduler:
            deltas = await _generate(scheduler, _request(scheduler, "r", PROMPTS[1], logprobs=2))
        got.append([e for d in deltas for e in d.logprobs])
    assert [e.token_id for e in got[0]] == [e.token_id for e in got[1]]
    for a, b in zip(*got):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


async def test_prompt_scores_agree_with_the_generated_tokens_logprob_and_ignore_the_prefix_cache(tiny_package):
    async with running(tiny_package, draft_tokens=0, max_batched_tokens=8) as scheduler:
        prompt_ids = tuple(scheduler.tokenizer.encode(PROMPTS[2]))
        first = await _generate(scheduler, GenerationRequest("g", prompt_ids, dataclasses.replace(GREEDY, max_tokens=1), logprobs=0))
        token, logprob = first[0].logprobs[0].token_id, first[0].logprobs[0].logprob
        # The same prompt again (now in the prefix cache) plus that token, scored.
        extended = prompt_ids + (token,)
        for rid in ("s1", "s2"):
            deltas = await _generate(scheduler, GenerationRequest(rid, extended, dataclasses.replace(GREEDY, max_tokens=1), prompt_logprobs=2))
            scored = deltas[0].prompt_logprobs
            assert scored is not None and len(scored) == len(extended) - 1
            assert [e.token_id for e in scored] == list(extended[1:])
            assert all(len(e.top) == 2 and e.logprob <= e.top[0][1] + 1e-6 for e in scored)
            # Greedy at temperature 1 without penalties reports the raw model distribution.
            assert scored[-1].logprob == pytest.approx(logprob, abs=1e-4)


async def test_every_choice_carries_the_prompt_scores(tiny_package):
    async with running(tiny_package, draft_tokens=0) as scheduler:
        request = _request(
            scheduler, "n", PROMPTS[3], params=SamplingParams(temperature=1.0, seed=3, max_tokens=3), n=2, prompt_logprobs=0
        )
        deltas = await _generate(scheduler, request)
    firsts = {d.index: d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None}
    assert set(firsts) == {0, 1}
    assert firsts[0] == firsts[1] and len(firsts[0]) == len(request.prompt_token_ids) - 1


async def test_logprobs_are_kept_in_a_round_whose_rows_sample_in_two_groups(tiny_package):
    from flare.sampler.status import DeviceStatus
    from flare.scheduler.request import FaultSpec

    # An INVALID_SPECULATION fault samples its row with the sharded sampler, the other row with
    # the package's: two groups in the same rounds, only one of them asking for logprobs.
    async with running(tiny_package, fault_injection=True) as scheduler:
        faulted = _request(scheduler, "f", PROMPTS[1], fault=FaultSpec(DeviceStatus.INVALID_SPECULATION, round=1))
        asked = _request(scheduler, "a", PROMPTS[1], logprobs=2)
        _, deltas = await asyncio.gather(_generate(scheduler, faulted), _generate(scheduler, asked))
    entries = [e for d in deltas for e in d.logprobs]
    assert [e.token_id for e in entries] == [t for d in deltas for t in d.token_ids]
    assert len(entries) == GREEDY.max_tokens
