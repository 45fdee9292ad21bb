"""Prefix caching and parallel choices in the scheduler, on the tiny model: what a client sees
does not depend on the cache, hits skip the prefill they should, and every block comes back."""

from __future__ import annotations

import asyncio
import random

import pytest
import structlog
from tests.scheduler.test_scheduler import GREEDY, PROMPTS, _block_bytes, collect, generate_all, request, running, wait_idle

from flare.policy.params import SamplingParams
from flare.scheduler.errors import TooManyChoices
from flare.scheduler.request import Failed, Finished, GenerationRequest, TextDelta, choice_seed
from flare.scheduler.scheduler import Scheduler

SYSTEM = (
    "You are a careful assistant. Answer briefly, cite what you use, and say when you do not know. "
    "Never invent a source. Prefer plain words to jargon. "
) * 3  # a shared preamble of several blocks


def ids(scheduler: Scheduler, text: str) -> tuple[int, ...]:
    return tuple(scheduler.tokenizer.encode(text))


async def answer(scheduler: Scheduler, rid: str, prompt_ids: tuple[int, ...], params: SamplingParams = GREEDY):
    return (await generate_all(scheduler, [GenerationRequest(rid, prompt_ids, params)]))[rid]


def assert_no_block_lost(scheduler: Scheduler) -> None:
    snapshot = scheduler.snapshot()
    # Held blocks are those neither free nor evictable (PrefixCache.counts): none held means
    # every block is free or cached for later.
    assert snapshot.kv_blocks_used == 0 and snapshot.running == 0 and snapshot.waiting == 0
    assert snapshot.kv_blocks_evictable == snapshot.kv_blocks_cached  # nothing holds a cached block but the cache


async def test_greedy_output_is_the_same_token_for_token_on_a_cache_hit_and_a_miss(tiny_package):
    prompts = [SYSTEM + "Question: what is two plus two?", SYSTEM + "Question: name a colour."]
    async with running(tiny_package, prefix_cache=False) as off:
        expected = [await answer(off, f"off{i}", ids(off, p)) for i, p in enumerate(prompts)]
        assert off.snapshot().prompt_tokens_cached == 0
    async with running(tiny_package) as on:
        first = [await answer(on, f"a{i}", ids(on, p)) for i, p in enumerate(prompts)]
        again = [await answer(on, f"b{i}", ids(on, p)) for i, p in enumerate(prompts)]
        snapshot = on.snapshot()
        assert_no_block_lost(on)
    for want, miss_or_partial, hit in zip(expected, first, again):
        assert miss_or_partial.token_ids == want.token_ids
        assert hit.token_ids == want.token_ids
    # The second prompt shares the preamble with the first; the repeats hit nearly everything.
    assert first[0].end.usage.cached_tokens == 0
    assert first[1].end.usage.cached_tokens >= len(ids(on, SYSTEM)) // 16 * 16 - 16
    for hit, prompt in zip(again, prompts):
        length = len(ids(on, prompt))
        assert hit.end.usage.cached_tokens == min(length // 16 * 16, length - 1)  # every full block
    assert snapshot.prompt_tokens_cached == sum(o.end.usage.cached_tokens for o in [*first, *again])


@pytest.mark.parametrize(("max_batched_tokens", "oldest_prefill_share"), [(64, 64), (100, 40)])
async def test_a_burst_of_prompts_with_one_preamble_computes_it_once_and_answers_as_without_the_cache(
    tiny_package, max_batched_tokens, oldest_prefill_share
):
    """Prompts that arrive together, none of their shared preamble cached yet, are admitted
    together with no hit; the first computes the preamble while the others wait for its blocks
    and take them from the cache, rather than compute them too. (64, 64): the first prompt's
    chunks end on block boundaries; (100, 40): mid-block, where the others still wait for the
    block it is in the middle of."""
    prompts = [SYSTEM + f"Question {i}: " + PROMPTS[i % len(PROMPTS)] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    async with running(tiny_package, prefix_cache=False) as off:
        expected = await generate_all(off, [request(off, f"r{i}", p, params) for i, p in enumerate(prompts)])
    options = {"max_batched_tokens": max_batched_tokens, "oldest_prefill_share": oldest_prefill_share}
    async with running(tiny_package, **options) as on:
        got = await generate_all(on, [request(on, f"r{i}", p, params) for i, p in enumerate(prompts)])
        snapshot = on.snapshot()
        assert_no_block_lost(on)
        preamble = len(ids(on, SYSTEM)) // 16 * 16 - 16  # its full blocks, less one where tokens may merge
        lengths = [len(ids(on, p)) for p in prompts]
    for rid, outcome in expected.items():
        assert isinstance(got[rid].end, Finished)
        assert got[rid].token_ids == outcome.token_ids
    hits = [got[f"r{i}"].end.usage.cached_tokens for i in range(len(prompts))]
    assert hits[0] == 0 and all(hit >= preamble for hit in hits[1:]), hits
    assert snapshot.prompt_tokens_cached == sum(hits)
    assert snapshot.prompt_tokens_computed <= sum(lengths) - (len(prompts) - 1) * preamble


async def test_a_seed_gives_the_same_tokens_hit_or_miss(tiny_package):
    seeded = SamplingParams(temperature=1.0, seed=77, max_tokens=16)
    prompt = SYSTEM + "Tell me a story."
    async with running(tiny_package, prefix_cache=False) as off:
        miss = await answer(off, "m", ids(off, prompt), seeded)
    async with running(tiny_package) as on:
        await answer(on, "warm", ids(on, prompt), seeded)
        hit = await answer(on, "h", ids(on, prompt), seeded)
    assert hit.end.usage.cached_tokens > 0
    assert hit.token_ids == miss.token_ids


async def test_a_prompt_of_whole_cached_blocks_copies_its_last_block_and_answers_the_same(tiny_package):
    async with running(tiny_package, draft_tokens=0) as scheduler:
        prompt = ids(scheduler, SYSTEM)
        prompt = prompt[: len(prompt) // 16 * 16]  # ends exactly at a block boundary
        first = await answer(scheduler, "first", prompt)
        with structlog.testing.capture_logs() as logs:
            again = await answer(scheduler, "again", prompt)
        assert_no_block_lost(scheduler)
    assert again.end.usage.cached_tokens == len(prompt) - 1  # all but the token that gives logits
    assert again.token_ids == first.token_ids
    assert any(e["event"] == "round_completed" and e["copies"] == 1 for e in logs)


async def test_each_turn_of_a_chat_reuses_the_history_and_its_answers(tiny_package):
    """Turn t resends turns 1..t-1 with their answers: the cache serves all of it but the
    block boundary, so each turn computes little more than its new message."""
    async with running(tiny_package, prefix_cache=False) as off, running(tiny_package) as on:
        history: list[int] = list(ids(on, SYSTEM))
        for turn in range(4):
            history += ids(on, f" User: question number {turn} about the weather? Assistant:")
            want = await answer(off, f"off{turn}", tuple(history))
            got = await answer(on, f"on{turn}", tuple(history))
            assert got.token_ids == want.token_ids
            if turn:
                # Everything up to the last full block before this turn's message was cached.
                assert got.end.usage.cached_tokens >= (len(history) - 40) // 16 * 16 - 16
            history += want.token_ids
        assert_no_block_lost(on)


async def test_a_cache_hit_drafts_as_much_as_a_miss(tiny_package):
    prompt = "one two three four one two three four one two three four one two three four " * 2
    drafts = []
    async with running(tiny_package, draft_length="fixed") as scheduler:
        for rid in ("miss", "hit"):
            with structlog.testing.capture_logs() as logs:
                outcome = await answer(scheduler, rid, ids(scheduler, prompt))
            drafts.append(sum(e["drafts"] for e in logs if e["event"] == "round_completed"))
            if rid == "hit":
                assert outcome.end.usage.cached_tokens > 0
    assert drafts[0] > 0 and drafts[1] == drafts[0]


async def test_cached_blocks_give_way_under_kv_pressure_and_nothing_is_refused_or_lost(tiny_package):
    """A soak of random shared prefixes in a cache too small for them all: every request
    finishes with the output the cache-off server gives, and at the end every block is free
    or cached, never lost or freed twice."""
    rng = random.Random(5)
    prefixes = [SYSTEM[: rng.randrange(40, len(SYSTEM))] for _ in range(4)]
    prompts = [rng.choice(prefixes) + f" Q{i}: " + " ".join(rng.choice(PROMPTS).split()[:5]) for i in range(24)]
    params = SamplingParams(temperature=0.0, max_tokens=20)
    async with running(tiny_package, prefix_cache=False) as off:
        expected = await generate_all(off, [request(off, f"r{i}", p, params) for i, p in enumerate(prompts)])
    tight = 20 * _block_bytes(tiny_package)
    async with running(tiny_package, kv_cache_memory=tight, max_concurrency=4) as on:
        got: dict = {}
        for wave in range(0, len(prompts), 6):  # waves, so later ones meet blocks earlier ones left
            got |= await generate_all(on, [request(on, f"r{i}", prompts[i], params) for i in range(wave, wave + 6)])
        snapshot = on.snapshot()
        assert_no_block_lost(on)
        cleared = on.clear_prefix_cache()
        assert cleared == snapshot.kv_blocks_evictable and on.snapshot().kv_blocks_cached == 0
    for rid, outcome in expected.items():
        assert isinstance(got[rid].end, Finished)
        assert got[rid].token_ids == outcome.token_ids
    assert snapshot.prompt_tokens_cached > 0


async def test_a_request_cancelled_during_its_prefill_from_the_cache_frees_every_block(tiny_package):
    async with running(tiny_package) as scheduler:
        prompt = ids(scheduler, SYSTEM * 3)
        await answer(scheduler, "warm", prompt[:200])
        stream = scheduler.submit(GenerationRequest("victim", prompt, SamplingParams(temperature=0.0, max_tokens=300)))
        first = await stream.__anext__()
        assert isinstance(first, TextDelta)
        assert scheduler.cancel("victim")
        outcome = await collect(stream)
        await wait_idle(scheduler)
        assert_no_block_lost(scheduler)
    assert isinstance(outcome.end, Failed) and outcome.end.failure.code == "cancelled"


# ----------------------------------------------------------------- parallel choices


async def collect_choices(stream, n: int) -> tuple[dict[int, list[int]], dict[int, Finished], Failed | None]:
    tokens: dict[int, list[int]] = {i: [] for i in range(n)}
    ends: dict[int, Finished] = {}
    async for event in stream:
        if isinstance(event, TextDelta):
            tokens[event.index].extend(event.token_ids)
        elif isinstance(event, Finished):
            ends[event.index] = event
        else:
            return tokens, ends, event
    return tokens, ends, None


@pytest.mark.parametrize("prefix_cache", [True, False], ids=["cache-on", "cache-off"])
async def test_n_choices_sample_independently_each_as_its_own_seeded_request_would(tiny_package, prefix_cache):
    params = SamplingParams(temperature=1.0, seed=2024, max_tokens=12)
    prompt = SYSTEM + "Write a line of verse."
    async with running(tiny_package, prefix_cache=False) as reference:
        alone = []
        for i in range(3):
            seeded = SamplingParams(temperature=1.0, seed=choice_seed(2024, i), max_tokens=12)
            alone.append((await answer(reference, f"alone{i}", ids(reference, prompt), seeded)).token_ids)
    async with running(tiny_package, prefix_cache=prefix_cache) as scheduler:
        prompt_ids = ids(scheduler, prompt)
        stream = scheduler.submit(GenerationRequest("n3", prompt_ids, params, n=3))
        tokens, ends, failed = await collect_choices(stream, 3)
        snapshot = scheduler.snapshot()
        assert_no_block_lost(scheduler)
    assert failed is None and sorted(ends) == [0, 1, 2]
    assert [tokens[i] for i in range(3)] == alone
    assert len({tuple(t) for t in tokens.values()}) == 3
    for i, end in ends.items():
        assert end.usage.prompt_tokens == len(prompt_ids) and end.usage.completion_tokens == len(tokens[i])
    # The prompt was computed once, plus its last token once more for each other choice.
    assert snapshot.prompt_tokens_computed == len(prompt_ids) + 2


async def test_greedy_choices_are_identical_and_share_the_prompts_blocks(tiny_package):
    async with running(tiny_package) as scheduler:
        prompt_ids = ids(scheduler, PROMPTS[1] * 3)
        single = await answer(scheduler, "single", prompt_ids)
        scheduler.clear_prefix_cache()
        stream = scheduler.submit(GenerationRequest("n4", prompt_ids, GREEDY, n=4))
        tokens, ends, failed = await collect_choices(stream, 4)
        assert_no_block_lost(scheduler)
    assert failed is None
    assert all(t == single.token_ids for t in tokens.values())


async def test_more_choices_than_max_concurrency_are_refused_and_choices_count_toward_it(tiny_package):
    async with running(tiny_package, max_concurrency=3) as scheduler:
        with pytest.raises(TooManyChoices) as refused:
            scheduler.submit(GenerationRequest("too-many", ids(scheduler, PROMPTS[0]), GREEDY, n=4))
        assert refused.value.limit == 3
        long = SamplingParams(temperature=1.0, seed=1, max_tokens=30)
        three = scheduler.submit(GenerationRequest("three", ids(scheduler, PROMPTS[0]), long, n=3))
        other = scheduler.submit(GenerationRequest("other", ids(scheduler, PROMPTS[1]), GREEDY))
        first = await three.__anext__()
        # The three choices fill every slot: the other request waits until they end.
        assert isinstance(first, TextDelta)
        assert scheduler.snapshot().running == 3 and scheduler.snapshot().waiting == 1
        _, ends, failed = await collect_choices(three, 3)
        assert failed is None and len(ends) == 3
        assert isinstance((await collect(other)).end, Finished)


async def test_cancelling_a_request_with_choices_ends_all_of_them_with_one_failure(tiny_package):
    async with running(tiny_package) as scheduler:
        long = SamplingParams(temperature=1.0, seed=3, max_tokens=300)
        stream = scheduler.submit(GenerationRequest("n3", ids(scheduler, SYSTEM), long, n=3))
        assert isinstance(await stream.__anext__(), TextDelta)
        assert scheduler.cancel("n3")
        _, ends, failed = await collect_choices(stream, 3)
        await wait_idle(scheduler)
        assert_no_block_lost(scheduler)
    assert isinstance(failed, Failed) and failed.failure.code == "cancelled" and not ends
    assert failed.usage.prompt_tokens == len(ids(scheduler, SYSTEM))


async def test_choices_under_kv_pressure_are_preempted_and_recomputed_with_unchanged_output(tiny_package):
    params = SamplingParams(temperature=1.0, seed=9, max_tokens=40)
    async with running(tiny_package, draft_tokens=0) as roomy:
        stream = roomy.submit(GenerationRequest("n", ids(roomy, PROMPTS[0]), params, n=4))
        expected, _, _ = await collect_choices(stream, 4)
    async with running(tiny_package, draft_tokens=0, kv_cache_memory=9 * _block_bytes(tiny_package)) as tight:
        streams = [tight.submit(GenerationRequest(f"n{k}", ids(tight, PROMPTS[0]), params, n=4)) for k in range(2)]
        results = await asyncio.gather(*(collect_choices(s, 4) for s in streams))
        assert_no_block_lost(tight)
    for tokens, ends, failed in results:
        assert failed is None and len(ends) == 4
        assert tokens == expected
