"""OpenAI's predicted outputs through the scheduler on the tiny model: the prediction's tokens are
drafts, verified like any drafter's, so the answer is the one without a prediction (greedy: token
for token), and the usage counts the predicted tokens accepted and rejected."""

from __future__ import annotations

import dataclasses

from tests.running_scheduler import running
from tests.scheduler.test_scheduler import PROMPTS, collect, generate_all, request

from flare.policy.params import SamplingParams
from flare.scheduler.request import Finished, TextDelta

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


async def greedy_answers(package, **options) -> dict[str, list[int]]:
    async with running(package, draft_tokens=0, **options) as scheduler:
        outcomes = await generate_all(scheduler, [request(scheduler, f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
    return {rid: outcome.token_ids for rid, outcome in outcomes.items()}


async def test_a_prediction_of_the_answer_itself_is_accepted_and_changes_no_token(tiny_package):
    expected = await greedy_answers(tiny_package)
    async with running(tiny_package, draft_length="fixed") as scheduler:
        requests = [
            dataclasses.replace(request(scheduler, f"r{i}", p, GREEDY), prediction=tuple(expected[f"r{i}"]))
            for i, p in enumerate(PROMPTS)
        ]
        got = await generate_all(scheduler, requests)
    for rid, outcome in got.items():
        assert outcome.token_ids == expected[rid]
        assert isinstance(outcome.end, Finished)
        # The first token comes from the prompt's round; every later one could be a draft.
        assert outcome.end.usage.accepted_prediction_tokens > 0
        assert outcome.end.usage.rejected_prediction_tokens == 0


async def test_a_wrong_prediction_is_rejected_and_changes_no_token(tiny_package):
    expected = await greedy_answers(tiny_package)
    async with running(tiny_package, draft_length="fixed") as scheduler:
        requests = []
        for i, p in enumerate(PROMPTS):
            answer = expected[f"r{i}"]
            wrong = tuple(t for t in range(1, 200) if t not in answer)[:20]
            # The answer's first token puts the prediction in step; the rest is never the answer.
            requests.append(dataclasses.replace(request(scheduler, f"r{i}", p, GREEDY), prediction=(answer[0], *wrong)))
        got = await generate_all(scheduler, requests)
    for rid, outcome in got.items():
        assert outcome.token_ids == expected[rid]
        assert isinstance(outcome.end, Finished)
        assert outcome.end.usage.rejected_prediction_tokens > 0
        assert outcome.end.usage.accepted_prediction_tokens == 0


async def test_every_choice_drafts_from_the_same_prediction(tiny_package):
    expected = await greedy_answers(tiny_package)
    async with running(tiny_package, draft_length="fixed") as scheduler:
        stream = scheduler.submit(
            dataclasses.replace(request(scheduler, "r0", PROMPTS[0], GREEDY), n=2, prediction=tuple(expected["r0"]))
        )
        ids: dict[int, list[int]] = {0: [], 1: []}
        ends: dict[int, Finished] = {}
        async for event in stream:
            if isinstance(event, TextDelta):
                ids[event.index].extend(event.token_ids)
            elif isinstance(event, Finished):
                ends[event.index] = event
    assert ids[0] == ids[1] == expected["r0"]
    assert all(end.usage.accepted_prediction_tokens > 0 for end in ends.values())


async def test_sampled_answers_with_a_prediction_stay_valid_and_seeded_greedy_is_unchanged(tiny_package):
    expected = await greedy_answers(tiny_package)
    sampled = SamplingParams(temperature=0.9, max_tokens=24, seed=7)
    async with running(tiny_package) as scheduler:
        prediction = tuple(expected["r1"])
        outcome = await collect(
            scheduler.submit(dataclasses.replace(request(scheduler, "s", PROMPTS[1], sampled), prediction=prediction))
        )
        seeded_greedy = dataclasses.replace(GREEDY, seed=7)
        greedy = await collect(
            scheduler.submit(dataclasses.replace(request(scheduler, "g", PROMPTS[1], seeded_greedy), prediction=prediction))
        )
    assert isinstance(outcome.end, Finished)
    assert 0 < len(outcome.token_ids) == outcome.end.usage.completion_tokens <= sampled.max_tokens
    assert outcome.text == scheduler.tokenizer.decode(outcome.token_ids)
    assert greedy.token_ids == expected["r1"]
