"""The prefill policy (docs/architecture.md, "Prefill policy"): a short prompt behind a long one
gets its first token within a round or two, decode streams get a token every round meanwhile,
and the long prompt still progresses every round and completes. Counted in rounds, not seconds."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace

import pytest
from tests.running_scheduler import running

from flare.package.manifest import ServingConfig
from flare.policy.params import SamplingParams
from flare.scheduler.prefill_budget import share_prefill_budget
from flare.scheduler.request import Finished, GenerationRequest, TextDelta
from flare.scheduler.round.plan import RoundPlan
from flare.scheduler.scheduler import Scheduler

# Several thousand tokens of prompt: the tiny model's context is raised for this package.
LONG_CONTEXT = 4096
LONG_PROMPT_TOKENS = 3000
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def long_context_package(make_package, package_parts):
    config = replace(package_parts["config"], max_position_embeddings=LONG_CONTEXT)
    return make_package(config=config, serving=ServingConfig(max_context=LONG_CONTEXT))


@dataclass
class Rounds:
    """Every round the scheduler ran: per round, each request's row as (tokens fed, samples)."""

    plans: list[dict[str, tuple[int, bool]]] = field(default_factory=list)

    def watch(self, scheduler: Scheduler) -> None:
        execute = scheduler.runner.execute

        def spy(plan: RoundPlan):
            self.plans.append({row.request_id: (len(row.token_ids), row.sampling is not None) for row in plan.rows})
            return execute(plan)

        scheduler.runner.execute = spy

    def first_sampled(self, request_id: str) -> int:
        return next(i for i, plan in enumerate(self.plans) if plan.get(request_id, (0, False))[1])

    def rows_of(self, request_id: str) -> list[int]:
        return [i for i, plan in enumerate(self.plans) if request_id in plan]


def long_prompt(scheduler: Scheduler) -> tuple[int, ...]:
    words = " ".join(f"item {i} of the list is the number {i * 7 % 1000}." for i in range(LONG_PROMPT_TOKENS))
    ids = tuple(scheduler.tokenizer.encode(words))[:LONG_PROMPT_TOKENS]
    assert len(ids) == LONG_PROMPT_TOKENS
    return ids


async def collect(stream) -> tuple[list[int], Finished]:
    ids: list[int] = []
    async for event in stream:
        if isinstance(event, TextDelta):
            ids.extend(event.token_ids)
        else:
            assert isinstance(event, Finished), event
            return ids, event
    raise AssertionError("stream ended without a terminal event")


async def first_token(stream) -> None:
    async for event in stream:
        assert isinstance(event, TextDelta), event
        return


async def alone(package, request: GenerationRequest) -> list[int]:
    async with running(package, draft_tokens=0) as scheduler:
        ids, _ = await collect(scheduler.submit(request))
    return ids


async def test_a_short_prompt_behind_a_long_one_gets_its_first_token_next_round_while_decoding_keeps_pace(
    long_context_package,
):
    rounds = Rounds()
    async with running(long_context_package, draft_tokens=0) as scheduler:
        rounds.watch(scheduler)
        budget, share = scheduler.options.max_batched_tokens, scheduler.options.oldest_prefill_share
        tokenize = scheduler.tokenizer.encode
        # A stream already decoding, then the long prompt; once the long one is prefilling, two
        # short chats arrive.
        counting = tuple(tokenize("Count with me: one two three"))
        decoding = GenerationRequest("decoding", counting, replace(GREEDY, max_tokens=40))
        decoding_stream = scheduler.submit(decoding)
        decoding_task = asyncio.create_task(collect(decoding_stream))
        while not rounds.plans:
            await asyncio.sleep(0.001)
        long = GenerationRequest("long", long_prompt(scheduler), GREEDY)
        long_task = asyncio.create_task(collect(scheduler.submit(long)))
        while not rounds.rows_of("long"):
            await asyncio.sleep(0.001)
        arrived = len(rounds.plans)  # the round in flight, or the next one, is the first that can see them
        shorts = [
            GenerationRequest("short-1", tuple(tokenize("Hi! How are you?")), GREEDY),
            GenerationRequest("short-2", tuple(tokenize("What is the capital of France?")), GREEDY),
        ]
        short_tasks = [asyncio.create_task(collect(scheduler.submit(r))) for r in shorts]
        short_outputs = await asyncio.gather(*short_tasks)
        long_ids, long_end = await long_task
        decoding_ids, _ = await decoding_task

    # Each short prompt is computed whole and samples its first token in the first round that
    # plans it, at most one round after it arrived.
    for request in shorts:
        assert rounds.rows_of(request.request_id)[0] == rounds.first_sampled(request.request_id)
        assert rounds.first_sampled(request.request_id) <= arrived + 1
    # The long prompt was still prefilling when they were served: it had not yet sampled.
    long_sampled = rounds.first_sampled("long")
    assert max(rounds.first_sampled(r.request_id) for r in shorts) < long_sampled - 1
    # It progressed every round until computed, at least its share even in the rounds the short
    # prompts took, and within the round's budget.
    long_rows = rounds.rows_of("long")
    assert [i for i in long_rows if i <= long_sampled] == list(range(long_rows[0], long_sampled + 1))
    for i in range(long_rows[0], long_sampled + 1):
        fed = rounds.plans[i]["long"][0]
        assert fed >= min(share, LONG_PROMPT_TOKENS), (i, fed)
        assert sum(tokens for tokens, _ in rounds.plans[i].values()) <= budget
    assert long_end.usage.prompt_tokens == LONG_PROMPT_TOKENS and long_end.usage.completion_tokens == len(long_ids) > 0
    # The decoding stream had a sampling row in every round from its first token to its last,
    # the long prompt's whole prefill included.
    decoding_rows = rounds.rows_of("decoding")
    assert decoding_rows == list(range(decoding_rows[0], decoding_rows[-1] + 1))
    assert all(rounds.plans[i]["decoding"] == (1, True) for i in decoding_rows[1:])
    assert len(decoding_ids) == len(decoding_rows), "one token a round"
    assert decoding_rows[-1] >= long_sampled, "the stream should outlast the long prompt's prefill"
    # Nothing of this changes what anyone generates (greedy: token for token).
    for request, (ids, _) in zip(shorts, short_outputs):
        assert ids == await alone(long_context_package, request)
    assert long_ids == await alone(long_context_package, long)
    assert decoding_ids == await alone(long_context_package, decoding)


async def test_a_long_prompt_alone_takes_the_whole_budget_every_round(long_context_package):
    rounds = Rounds()
    async with running(long_context_package, draft_tokens=0) as scheduler:
        rounds.watch(scheduler)
        budget = scheduler.options.max_batched_tokens
        await collect(scheduler.submit(GenerationRequest("long", long_prompt(scheduler), GREEDY)))
    chunks = [plan["long"][0] for plan in rounds.plans[: rounds.first_sampled("long") + 1]]
    assert chunks == [budget] * (LONG_PROMPT_TOKENS // budget) + [LONG_PROMPT_TOKENS % budget]


def test_a_prompt_alone_gets_the_whole_budget_as_in_arrival_order():
    assert share_prefill_budget([3000], 256, 64) == [256]
    assert share_prefill_budget([100], 256, 64) == [100]


def test_shorter_prompts_go_first_while_the_oldest_keeps_its_share():
    # The oldest (3000 left) keeps 64; the 4-token chat and the 150-token prompt are computed
    # whole; what is left goes to the 1000-token one, which has fewer left than the oldest.
    assert share_prefill_budget([3000, 1000, 4, 150], 256, 64) == [64, 38, 4, 150]
    assert share_prefill_budget([3000, 4000, 4], 256, 64) == [64 + 188, 0, 4]


def test_the_oldest_prompt_progresses_even_when_decode_rows_fill_the_round():
    assert share_prefill_budget([3000, 4], 0, 64) == [64, 0]
    assert share_prefill_budget([3000, 4], -10, 64) == [64, 0]


def test_equal_prompts_are_served_oldest_first():
    assert share_prefill_budget([500, 500, 500], 256, 64) == [256, 0, 0]
