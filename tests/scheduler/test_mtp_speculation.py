"""Speculative rounds with a learned draft head (drafters/mtp.py) on the tiny model: greedy output
is unchanged token for token, and the drafts after every round (rejections, prefix-cache hits
and preemptions included) are what the head computes from scratch for the committed tokens."""

from __future__ import annotations

import asyncio
import re

import pytest
import torch
from prometheus_client import CollectorRegistry
from tests.mtp_heads import reference_drafts, repeat_head_state, write_head_package

from flare.package.directory import open_package
from flare.policy.params import SamplingParams
from flare.scheduler.metrics import SchedulerMetrics
from flare.scheduler.request import Finished, GenerationRequest, TextDelta
from flare.scheduler.scheduler import Scheduler, SchedulerOptions
from flare.scheduler.sequence import DRAFT_SOURCES
from flare.structured import GrammarSpec

LOGIT_SCALE = 5.0  # as in test_speculation_distribution.py: a peaked tiny model repeats itself
PROMPTS = ("one two three four one two three four", "hello hello hello world", "a b c d e f g")
K = 3
# Every speculative run drafts K a round: the adaptive length chooses from measured round times,
# so whether a row drafts at all (and so which tokens a sampled row draws) would depend on the
# machine's load.
FIXED_LENGTH = {"draft_length": "fixed"}


@pytest.fixture(scope="module")
def peaked_state(package_parts):
    state = dict(package_parts["state_dict"])
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"] * LOGIT_SCALE
    return state


@pytest.fixture(scope="module")
def head_state(package_parts, peaked_state):
    vocab = torch.arange(0, package_parts["config"].vocab_size, 3)
    return repeat_head_state(package_parts["config"], peaked_state, vocab, mix=0.5, seed=2)


@pytest.fixture(scope="module")
def head_package(make_package, package_parts, peaked_state, head_state):
    return write_head_package(make_package, package_parts, head_state, draft_tokens=K, state_dict=peaked_state)


class Recorder:
    """Every round's plan and result, by wrapping the runner's execute."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.rounds = []
        execute = scheduler.runner.execute

        def spy(plan):
            result = execute(plan)
            self.rounds.append((plan, result))
            return result

        scheduler.runner.execute = spy


def drafts_by_drafter(registry: CollectorRegistry, kind: str) -> dict[str, float]:
    """flare_draft_tokens_{kind}_total by drafter label, as a scrape of /metrics reads it."""
    return {d: registry.get_sample_value(f"flare_draft_tokens_{kind}_total", {"drafter": d}) for d in DRAFT_SOURCES}


async def generate(package_path, prompts, params, options, *, sequential=False, observer=None):
    scheduler = Scheduler.from_package(open_package(package_path), options, observer=observer)
    recorder = Recorder(scheduler)
    loop = asyncio.create_task(scheduler.run())
    outputs = {}

    async def one(i, text):
        ids = []
        async for event in scheduler.submit(GenerationRequest(f"r{i}", tuple(scheduler.tokenizer.encode(text)), params)):
            if isinstance(event, TextDelta):
                ids.extend(event.token_ids)
            else:
                assert isinstance(event, Finished), event
        outputs[i] = ids

    try:
        if sequential:
            for i, text in enumerate(prompts):
                await one(i, text)
        else:
            await asyncio.gather(*(one(i, t) for i, t in enumerate(prompts)))
    finally:
        scheduler.stop()
        await loop
    return [outputs[i] for i in range(len(prompts))], recorder, scheduler


def check_drafts_against_reference(recorder, package_parts, peaked_state, head_state, prompts_ids):
    """After each round, each drafting row's next drafts equal the reference for its tokens."""
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts_ids))}
    checked = 0
    for plan, result in recorder.rounds:
        for row, outcome in zip(plan.rows, result.rows):
            if outcome is None:
                continue
            out = outputs[row.request_id]
            del out[row.sampling.output_position :]  # a preempted sequence samples its outputs again
            out.extend(outcome.tokens)
            if outcome.next_draft is None:
                continue
            prompt = prompts_ids[int(row.request_id[1:])]
            steps = len(outcome.next_draft.token_ids)
            assert 1 <= steps <= K
            expected = reference_drafts(package_parts["config"], peaked_state, head_state, list(prompt) + out, steps)
            assert list(outcome.next_draft.token_ids) == expected, (row.request_id, len(out))
            checked += 1
    return checked


GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "bfloat16"])
async def test_greedy_output_with_the_head_equals_output_without_speculation(head_package, kv_cache_dtype):
    plain, _, _ = await generate(
        head_package, PROMPTS, GREEDY, SchedulerOptions(draft_tokens=0, kv_cache_dtype=kv_cache_dtype)
    )
    registry = CollectorRegistry()
    speculative, recorder, scheduler = await generate(
        head_package, PROMPTS, GREEDY, SchedulerOptions(kv_cache_dtype=kv_cache_dtype, **FIXED_LENGTH),
        observer=SchedulerMetrics(registry),
    )
    assert scheduler.runner.head.kv_cache.dtype == getattr(torch, kv_cache_dtype)  # the head's cache too
    assert speculative == plain
    accepted = sum(len(o.tokens) - 1 for plan, result in recorder.rounds for o in result.rows if o is not None)
    drafted = sum(len(row.draft_ids) for plan, _ in recorder.rounds for row in plan.rows)
    assert drafted > 0 and 0 < accepted < drafted  # drafts were accepted and rejected
    assert scheduler.drafter_name == "mtp"
    # /metrics: every draft is the head's, and the head's passes took time.
    assert drafts_by_drafter(registry, "proposed") == {"ngram": 0, "mtp": drafted, "prediction": 0, "grammar": 0}
    assert drafts_by_drafter(registry, "accepted") == {"ngram": 0, "mtp": accepted, "prediction": 0, "grammar": 0}
    assert registry.get_sample_value("flare_draft_head_seconds_total") > 0


async def test_drafts_after_rejections_are_those_of_the_committed_tokens(head_package, package_parts, peaked_state, head_state):
    _, recorder, scheduler = await generate(head_package, PROMPTS, GREEDY, SchedulerOptions(**FIXED_LENGTH))
    prompts_ids = [scheduler.tokenizer.encode(t) for t in PROMPTS]
    assert check_drafts_against_reference(recorder, package_parts, peaked_state, head_state, prompts_ids) > 10


async def test_a_head_paused_while_its_drafts_are_declined_drafts_for_the_committed_tokens_after(
    head_package, package_parts, peaked_state, head_state, monkeypatch
):
    """The draft-length model declines every other round's drafts: the head pauses for those rows
    (no head work at all, `HEAD_PAUSE_ROUNDS`), then catches up on every slot since from its pool
    of hidden states, and its drafts are still what it computes from scratch; output unchanged."""
    import flare.scheduler.speculation.draft_planner as speculation_module

    calls = {"n": 0}

    def every_other_round(available, acceptance, base_tokens, cost, *, requests_waiting):
        calls["n"] += 1
        return list(available) if calls["n"] % 2 else [0] * len(available)

    plain, _, _ = await generate(head_package, PROMPTS, SamplingParams(temperature=0.0, max_tokens=60), SchedulerOptions(draft_tokens=0))
    monkeypatch.setattr(speculation_module, "choose_draft_lengths", every_other_round)
    monkeypatch.setattr(speculation_module, "HEAD_PAUSE_ROUNDS", 2)  # 6 rounds for 3 rows: several pauses an answer
    # Every step the pauses leave is drafted, whatever it costs (the tiny head does not pay).
    monkeypatch.setattr(speculation_module, "worthwhile_head_steps", lambda steps, *weights: steps)
    speculative, recorder, scheduler = await generate(
        head_package, PROMPTS, SamplingParams(temperature=0.0, max_tokens=60), SchedulerOptions(drafter="mtp")
    )
    assert speculative == plain
    decode_rows = [row for plan, _ in recorder.rounds for row in plan.rows if row.sampling is not None and row.sampling.output_position > 0]
    paused = [row for row in decode_rows if row.head_steps == 0]
    resumed = [row for row in decode_rows if row.draft_head is not None and row.draft_head.first_slot < row.start_position]
    assert paused and resumed  # rows went without the head, then caught up on several slots at once
    prompts_ids = [scheduler.tokenizer.encode(t) for t in PROMPTS]
    assert check_drafts_against_reference(recorder, package_parts, peaked_state, head_state, prompts_ids) > 10


async def test_a_head_whose_steps_cost_more_than_they_save_stops_drafting(head_package, monkeypatch):
    """Once the head is timed at a second a step, no token's expected saving covers a step: rows
    draft with it no more (until then every step is taken), and the output is unchanged."""
    from flare.scheduler.speculation.draft_length import HeadCostModel

    plain, _, _ = await generate(head_package, PROMPTS, GREEDY, SchedulerOptions(draft_tokens=0))
    monkeypatch.setattr(HeadCostModel, "seconds_per_step", lambda self: 1.0 if self._recent else None)
    speculative, recorder, _ = await generate(head_package, PROMPTS, GREEDY, SchedulerOptions(drafter="mtp"))
    assert speculative == plain
    head_rounds = [plan.index for plan, _ in recorder.rounds if any(row.head_steps for row in plan.rows)]
    assert head_rounds == [recorder.rounds[0][0].index]  # the first round's pass, which timed the head


async def test_a_fixed_draft_length_verifies_all_the_head_proposes_where_adaptive_would_draft_nothing(
    head_package, monkeypatch
):
    """`flare run --draft-length fixed`: with the head timed at a second a step and no draft
    length worth its round, which stop the adaptive length drafting (the test above), every decode
    row still verifies all K drafts the head proposed (fewer only where the answer's max_tokens
    cuts them), the head drafts K after every row, and the output is unchanged."""
    import flare.scheduler.speculation.draft_planner as speculation_module
    from flare.scheduler.speculation.draft_length import HeadCostModel

    plain, _, _ = await generate(head_package, PROMPTS, GREEDY, SchedulerOptions(draft_tokens=0))
    monkeypatch.setattr(HeadCostModel, "seconds_per_step", lambda self: 1.0)
    monkeypatch.setattr(speculation_module, "choose_draft_lengths", lambda available, *rest, **waiting: [0] * len(available))
    speculative, recorder, _ = await generate(head_package, PROMPTS, GREEDY, SchedulerOptions(drafter="mtp", **FIXED_LENGTH))
    assert speculative == plain
    sampled = [row for plan, _ in recorder.rounds for row in plan.rows if row.samples]
    decode = [row for row in sampled if row.sampling.output_position > 0]
    assert decode and all(row.head_steps == K for row in sampled)
    assert [len(row.draft_ids) for row in decode] == [
        min(K, GREEDY.max_tokens - row.sampling.output_position - 1) for row in decode
    ]


async def test_a_prefix_cache_hit_drafts_as_a_miss_does(head_package, package_parts, peaked_state, head_state):
    prompt = "the same long prompt, " * 4
    outputs, recorder, scheduler = await generate(head_package, (prompt, prompt), GREEDY, SchedulerOptions(**FIXED_LENGTH), sequential=True)
    assert outputs[0] == outputs[1]
    assert scheduler.snapshot().prompt_tokens_cached > 0
    # The second request's head caught up on the cached prefix from the pooled hidden states: its
    # drafts are still what the head computes from scratch, as the first request's are.
    ids = scheduler.tokenizer.encode(prompt)
    assert check_drafts_against_reference(recorder, package_parts, peaked_state, head_state, [ids, ids]) > 10
    assert any(row.request_id == "r1" and row.start_position > 0 and row.samples and row.sampling.output_position == 0
               for plan, _ in recorder.rounds for row in plan.rows)


async def test_preempted_sequences_draft_and_decode_as_if_never_preempted(head_package, package_parts, peaked_state, head_state):
    prompts = tuple(f"{w} " * 12 for w in ("cat", "dog", "fish", "bird"))
    params = SamplingParams(temperature=0.0, max_tokens=40)
    plain, _, _ = await generate(head_package, prompts, params, SchedulerOptions(draft_tokens=0))
    # 10 blocks of 16 positions for four sequences that each grow to ~55 tokens: some are preempted.
    small = SchedulerOptions(kv_cache_memory=10 * 16 * 2 * 2 * 16 * 2 * 4, prefix_cache=False, **FIXED_LENGTH)
    speculative, recorder, scheduler = await generate(head_package, prompts, params, small)
    assert speculative == plain
    # A sequence was computed again from its start after it had output: it was preempted.
    assert any(row.start_position == 0 and row.samples and row.sampling.output_position > 0 for plan, _ in recorder.rounds for row in plan.rows)
    prompts_ids = [scheduler.tokenizer.encode(t) for t in prompts]
    assert check_drafts_against_reference(recorder, package_parts, peaked_state, head_state, prompts_ids) > 10


async def test_a_package_without_a_head_refuses_the_mtp_drafter(tiny_package):
    with pytest.raises(ValueError, match=r"--drafter mtp: the package at .* ships no draft head; re-export it"):
        Scheduler.from_package(open_package(tiny_package), SchedulerOptions(drafter="mtp"))
    auto = Scheduler.from_package(open_package(tiny_package), SchedulerOptions(drafter="auto"))
    assert auto.drafter_name == "ngram"


async def test_auto_drafts_with_both_and_keeps_greedy_output(head_package):
    prompts = PROMPTS + ("Copy this: the quick brown fox jumps over the lazy dog. The quick brown fox jumps over",)
    plain, _, _ = await generate(head_package, prompts, GREEDY, SchedulerOptions(draft_tokens=0))
    registry = CollectorRegistry()
    speculative, recorder, scheduler = await generate(
        head_package, prompts, GREEDY, SchedulerOptions(drafter="auto", **FIXED_LENGTH), observer=SchedulerMetrics(registry)
    )
    assert speculative == plain
    assert scheduler.drafter_name == "auto"
    head_drafts = {d.token_ids for plan, result in recorder.rounds for o in result.rows if o is not None
                   for d in [o.next_draft] if d is not None}
    used = [row.draft_ids for plan, _ in recorder.rounds for row in plan.rows if row.draft_ids]
    assert used and head_drafts
    # A row that drafts by n-gram lookup has the head draft nothing for the next round.
    last_head: dict[str, tuple[int, ...]] = {}
    lookup_rows = 0
    verified = {"ngram": 0, "mtp": 0}
    for plan, result in recorder.rounds:
        for row, outcome in zip(plan.rows, result.rows):
            head = last_head.get(row.request_id, ())
            if row.draft_ids and tuple(row.draft_ids) != head[: len(row.draft_ids)]:
                lookup_rows += 1
                assert row.head_steps == 0, row
            if row.draft_ids:  # a draft equal to the head's may be lookup's too: at most the head's
                verified["mtp" if tuple(row.draft_ids) == head[: len(row.draft_ids)] else "ngram"] += len(row.draft_ids)
            if outcome is not None:
                last_head[row.request_id] = outcome.next_draft.token_ids if outcome.next_draft is not None else ()
    assert lookup_rows > 0
    # /metrics counts the verified drafts by the drafter that proposed them.
    counted = drafts_by_drafter(registry, "proposed")
    assert sum(counted.values()) == sum(verified.values()) and counted["grammar"] == 0
    assert counted["ngram"] >= verified["ngram"] and counted["mtp"] <= verified["mtp"]
    assert registry.get_sample_value("flare_draft_head_seconds_total") > 0


async def test_a_vocabulary_parallel_package_drafts_with_its_head(make_package, package_parts, peaked_state, head_state):
    from flare.policy.policy import SamplingPolicy

    policy = package_parts["policy"]
    unfiltered = SamplingPolicy({**policy.defaults, "top_p": 1.0}, policy.ranges).unfiltered()
    path = write_head_package(make_package, package_parts, head_state, draft_tokens=K, state_dict=peaked_state,
                              vocabulary_parallel_sampling=True, policy=unfiltered)
    options = SchedulerOptions(vocabulary_shards=4, **FIXED_LENGTH)
    plain, _, _ = await generate(path, PROMPTS, GREEDY, SchedulerOptions(draft_tokens=0, vocabulary_shards=4))
    speculative, recorder, _ = await generate(path, PROMPTS, GREEDY, options)
    assert speculative == plain
    sampled, recorder, _ = await generate(path, PROMPTS, SamplingParams(temperature=0.8, max_tokens=24, seed=3), options)
    assert all(len(ids) == 24 for ids in sampled)  # no row failed or fell back
    assert any(row.drafts is not None and row.drafts.probs is not None for plan, _ in recorder.rounds for row in plan.rows)


async def test_parallel_choices_share_the_prompt_and_draft_from_it(head_package, package_parts, peaked_state, head_state):
    """n = 2 choices fork off the first one's prompt blocks (head KV included): greedy, both
    equal the output without speculation, and their drafts are the reference's."""
    scheduler = Scheduler.from_package(open_package(head_package), SchedulerOptions(**FIXED_LENGTH))
    recorder = Recorder(scheduler)
    loop = asyncio.create_task(scheduler.run())
    prompt = tuple(scheduler.tokenizer.encode(PROMPTS[0]))
    choices: dict[int, list[int]] = {0: [], 1: []}
    try:
        async for event in scheduler.submit(GenerationRequest("r0", prompt, GREEDY, n=2)):
            if isinstance(event, TextDelta):
                choices[event.index].extend(event.token_ids)
    finally:
        scheduler.stop()
        await loop
    plain, _, _ = await generate(head_package, PROMPTS[:1], GREEDY, SchedulerOptions(draft_tokens=0))
    assert choices[0] == choices[1] == plain[0]
    checked = 0
    outputs: dict[int, list[int]] = {0: [], 1: []}
    for plan, result in recorder.rounds:
        for row, outcome in zip(plan.rows, result.rows):
            if outcome is None:
                continue
            out = outputs[row.choice]
            del out[row.sampling.output_position :]
            out.extend(outcome.tokens)
            if outcome.next_draft is not None:
                steps = len(outcome.next_draft.token_ids)
                expected = reference_drafts(package_parts["config"], peaked_state, head_state, list(prompt) + out, steps)
                assert list(outcome.next_draft.token_ids) == expected
                checked += 1
    assert checked > 5


async def test_a_constrained_answer_drafted_by_the_head_is_the_one_without_speculation(head_package):
    # The head drafts for a grammar row, and its drafts are cut at the first token the grammar
    # refuses, as any drafter's: the answer still follows the pattern and equals the
    # non-speculative one (this tiny head's vocabulary, every third id, rarely holds a token
    # the pattern allows, so most of its drafts are cut to nothing).
    pattern = "( ?(one|two|three|four))+"
    spec = GrammarSpec("regex", pattern, "structured_outputs.regex")
    answers, drafted = {}, {}
    for name, options in {
        "plain": SchedulerOptions(draft_tokens=0, jump_forward=False),
        "head": SchedulerOptions(jump_forward=False, **FIXED_LENGTH),
    }.items():
        scheduler = Scheduler.from_package(open_package(head_package), options)
        recorder = Recorder(scheduler)
        loop = asyncio.create_task(scheduler.run())
        try:
            grammar = scheduler.grammars.compile(spec)
            prompt = tuple(scheduler.tokenizer.encode(PROMPTS[0]))
            params = SamplingParams(temperature=0.0, max_tokens=12)
            text = ""
            async for event in scheduler.submit(GenerationRequest("c", prompt, params, grammar=grammar)):
                if isinstance(event, TextDelta):
                    text += event.text
                else:
                    assert isinstance(event, Finished), event
        finally:
            scheduler.stop()
            await loop
        answers[name] = text
        drafted[name] = sum(row.head_steps for plan, _ in recorder.rounds for row in plan.rows)
    assert answers["head"] == answers["plain"]
    assert re.fullmatch(pattern, answers["head"]), answers["head"]
    assert drafted["plain"] == 0 and drafted["head"] > 0  # the head ran for the constrained row


async def test_the_head_runs_on_rank_0_at_tensor_parallel_2_and_keeps_greedy_output(head_package):
    # Under tensor parallelism the residual stream after the last layer is whole on every rank
    # (each layer ends in an all-reduce), so the head runs on rank 0 alone, whole, from rank 0's
    # hidden state; its drafts are verified across the ranks like any others.
    plain, _, _ = await generate(head_package, PROMPTS, GREEDY, SchedulerOptions(draft_tokens=0))
    speculative, recorder, scheduler = await generate(
        head_package, PROMPTS, GREEDY, SchedulerOptions(tensor_parallel=2, **FIXED_LENGTH)
    )
    assert scheduler.drafter_name == "mtp"
    assert speculative == plain
    accepted = sum(len(o.tokens) - 1 for plan, result in recorder.rounds for o in result.rows if o is not None)
    drafted = sum(len(row.draft_ids) for plan, _ in recorder.rounds for row in plan.rows)
    assert drafted > 0 and accepted > 0


async def test_seeded_sampled_answers_with_the_head_at_tensor_parallel_2_are_tensor_parallel_1s(head_package):
    # A sampled row's drafts carry the head's q over the whole vocabulary: it reaches every rank
    # with the round's sampling step, each rank verifying against its slice.
    params = SamplingParams(temperature=0.8, max_tokens=16, seed=7)
    one, _, _ = await generate(head_package, PROMPTS, params, SchedulerOptions(**FIXED_LENGTH))
    two, recorder, scheduler = await generate(head_package, PROMPTS, params, SchedulerOptions(tensor_parallel=2, **FIXED_LENGTH))
    assert scheduler.drafter_name == "mtp"
    assert sum(len(row.draft_ids) for plan, _ in recorder.rounds for row in plan.rows) > 0
    assert two == one
