"""Grammar-constrained generation through the scheduler on the tiny random model: answers follow
their grammar, speculation and jump-forward change nothing but the number of rounds, and every
choice and shard layout is served."""

from __future__ import annotations

import json
import re

import pytest
from prometheus_client import CollectorRegistry
from tests.running_scheduler import running

from flare.sampler.status import DeviceStatus
from flare.policy.params import SamplingParams
from flare.scheduler.metrics import SchedulerMetrics
from flare.scheduler.request import Failed, FaultSpec, Finished, GenerationRequest, TextDelta
from flare.scheduler.scheduler import Scheduler
from flare.structured import GrammarSpec

SCHEMA = {
    "type": "object",
    "properties": {
        "favourite_colour_of_the_user": {"enum": ["red", "green", "blue"]},
        "is_the_user_happy_today": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["favourite_colour_of_the_user", "is_the_user_happy_today", "count"],
    "additionalProperties": False,
}



async def _answers(scheduler: Scheduler, spec: GrammarSpec, params: SamplingParams, n: int = 1) -> list[tuple[str, str]]:
    assert scheduler.grammars is not None
    grammar = scheduler.grammars.compile(spec)
    prompt = tuple(scheduler.tokenizer.encode("Tell me about the user in JSON."))
    texts = [""] * n
    reasons = [""] * n
    async for event in scheduler.submit(GenerationRequest("r", prompt, params, n=n, grammar=grammar)):
        if isinstance(event, TextDelta):
            texts[event.index] += event.text
        else:
            assert isinstance(event, Finished), event
            reasons[event.index] = event.reason
    return list(zip(texts, reasons))


def _valid(text: str) -> bool:
    value = json.loads(text)
    return (
        set(value) == set(SCHEMA["required"])
        and value["favourite_colour_of_the_user"] in ("red", "green", "blue")
        and isinstance(value["is_the_user_happy_today"], bool)
        and 0 <= value["count"] <= 9
    )


async def test_greedy_answers_follow_the_schema_alike_with_and_without_speculation_and_jump_forward(tiny_package):
    spec = GrammarSpec.json_schema(SCHEMA, "response_format")
    greedy = SamplingParams(temperature=0.0, max_tokens=80)
    results, forced = {}, {}
    for name, options in {
        "plain": {"draft_tokens": 0, "jump_forward": False},
        "jump_forward": {"draft_tokens": 0},
        "speculative": {"draft_length": "fixed"},
    }.items():
        async with running(tiny_package, **options) as scheduler:
            registry = CollectorRegistry()
            scheduler.observer = SchedulerMetrics(registry)
            rounds_before = scheduler.snapshot().rounds
            ((text, reason),) = await _answers(scheduler, spec, greedy)
            results[name] = (text, reason, scheduler.snapshot().rounds - rounds_before)
            forced[name] = registry.get_sample_value("flare_draft_tokens_proposed_total", {"drafter": "grammar"})
    for text, reason, _ in results.values():
        assert reason == "stop" and _valid(text), text
    assert results["plain"][0] == results["jump_forward"][0] == results["speculative"][0]
    # The long key names are forced: one round verifies each run of them, counted as the grammar's drafts.
    assert results["jump_forward"][2] < results["plain"][2] / 2
    assert forced["plain"] == 0 and forced["jump_forward"] > 20


async def test_sampled_choices_each_follow_the_schema_and_differ(tiny_package):
    async with running(tiny_package) as scheduler:
        answers = await _answers(
            scheduler, GrammarSpec.json_schema(SCHEMA, "response_format"),
            SamplingParams(temperature=1.5, seed=11, max_tokens=80), n=4,
        )
    assert all(reason == "stop" and _valid(text) for text, reason in answers), answers
    assert len({text for text, _ in answers}) > 1


async def test_a_regex_and_a_choice_constrain_the_answer_on_a_vocabulary_parallel_package(vocabulary_parallel_package):
    async with running(vocabulary_parallel_package, vocabulary_shards=4) as scheduler:
        ((date, reason),) = await _answers(
            scheduler, GrammarSpec("regex", r"20[0-9]{2}-(0[1-9]|1[0-2])", "structured_outputs.regex"),
            SamplingParams(temperature=1.0, seed=2, max_tokens=20),
        )
        ((choice, _),) = await _answers(
            scheduler, GrammarSpec("choice", json.dumps(["yes", "no", "maybe later"]), "structured_outputs.choice"),
            SamplingParams(temperature=0.0, max_tokens=20),
        )
    assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])", date) and reason == "stop"
    assert choice in ("yes", "no", "maybe later")


async def test_an_answer_cut_by_max_tokens_is_a_prefix_of_a_valid_one(tiny_package):
    async with running(tiny_package) as scheduler:
        ((text, reason),) = await _answers(
            scheduler, GrammarSpec.json_schema(SCHEMA, "response_format"), SamplingParams(temperature=0.0, max_tokens=5)
        )
    assert reason == "length"
    assert text.startswith('{"') and len(text) > 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


async def test_a_grammar_that_fails_mid_answer_ends_its_row_with_a_grammar_error_not_stop(tiny_package):
    # An ambiguous grammar's Earley items grow with every token until a mask passes
    # llguidance's step limit (about 40 tokens in); the mask then allows only the end of the
    # answer, which must not read as a complete answer ("stop").
    spec = GrammarSpec("lark", 'start: a\na: a a a | a a | a | "x" | "y" | "xy"', "structured_outputs.grammar")
    async with running(tiny_package, draft_tokens=0) as scheduler:
        assert scheduler.grammars is not None
        grammar = scheduler.grammars.compile(spec)
        eos = scheduler.tokenizer.eos_token_ids
        params = SamplingParams(
            temperature=1.0, seed=5, max_tokens=400, logit_bias=tuple((t, -100.0) for t in sorted(eos))
        )
        prompt = tuple(scheduler.tokenizer.encode("Say x."))
        events = [event async for event in scheduler.submit(GenerationRequest("r", prompt, params, grammar=grammar))]
    ended = events[-1]
    assert isinstance(ended, Failed), ended
    assert ended.failure.code == "grammar_error" and ended.failure.param == "structured_outputs.grammar"
    assert ended.failure.http_status == 422 and "<state>" not in ended.failure.message


async def test_an_empty_distribution_under_a_grammar_names_the_constraint(tiny_package):
    spec = GrammarSpec.json_schema(SCHEMA, "response_format.json_schema.schema")
    async with running(tiny_package, fault_injection=True, draft_tokens=0) as scheduler:
        assert scheduler.grammars is not None
        grammar = scheduler.grammars.compile(spec)
        prompt = tuple(scheduler.tokenizer.encode("Tell me about the user in JSON."))
        request = GenerationRequest(
            "r", prompt, SamplingParams(temperature=1.0, seed=1, max_tokens=20),
            fault=FaultSpec(DeviceStatus.EMPTY_DISTRIBUTION), grammar=grammar,
        )
        events = [event async for event in scheduler.submit(request)]
    ended = events[-1]
    assert isinstance(ended, Failed), ended
    assert ended.failure.code == "EMPTY_DISTRIBUTION" and ended.failure.http_status == 422
    assert ended.failure.param == "response_format.json_schema.schema"
    assert "response_format.json_schema.schema allowed no token" in ended.failure.message
