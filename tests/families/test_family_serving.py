"""Non-Llama families through what the scheduler adds to a forward pass: n-gram speculation, the
prefix cache, structured output and parallel choices. Qwen2 (biases, windows on some layers) and
Gemma 2 (windows on alternate layers, soft-caps, sandwich norms, GeGLU), as tiny checkpoints
exported from their Hugging Face directories (tests/family_checkpoints.py): each feature leaves a greedy
answer token for token what the plain scheduler gives, which test_transformers_parity.py holds
to transformers."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import structlog
from tests.family_checkpoints import write_checkpoint
from tests.running_scheduler import running

from flare.preparation.export import ExportOptions, export_package
from flare.preparation.source import ModelSource
from flare.policy.params import SamplingParams
from flare.scheduler.request import Finished, GenerationRequest, TextDelta
from flare.scheduler.scheduler import Scheduler
from flare.structured import GrammarSpec

pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
# Repetitive text gives the n-gram drafter something to propose; each is longer than the windows.
PROMPTS = (
    "one two three four one two three four one two three four one two three four one two three",
    "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat. The cat sat on the",
)
SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green", "blue"]}, "happy": {"type": "boolean"}},
    "required": ["colour", "happy"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", params=("qwen2", "gemma2"))
def package(request: pytest.FixtureRequest, smollm2_source: ModelSource, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp(request.param)
    checkpoint = write_checkpoint(request.param, root / request.param, smollm2_source.tokenizer_json, smollm2_source.chat_template)
    export_package(str(checkpoint.path), root / "package", ExportOptions(dtype="float32"), stderr=io.StringIO())
    return root / "package"


async def answers(scheduler: Scheduler, request: GenerationRequest) -> tuple[list[list[int]], list[Finished]]:
    """Each choice's tokens and its end, in choice order."""
    tokens: list[list[int]] = [[] for _ in range(request.n)]
    ends: list[Finished | None] = [None] * request.n
    async for event in scheduler.submit(request):
        if isinstance(event, TextDelta):
            tokens[event.index] += event.token_ids
        else:
            assert isinstance(event, Finished), event
            ends[event.index] = event
    assert all(end is not None for end in ends)
    return tokens, ends  # type: ignore[return-value]


def prompt_ids(scheduler: Scheduler, text: str) -> tuple[int, ...]:
    return tuple(scheduler.tokenizer.encode(text))


async def test_speculation_and_prefix_cache_hits_give_the_plain_greedy_tokens(package: Path) -> None:
    async with running(package, draft_tokens=0, prefix_cache=False) as plain:
        expected = [(await answers(plain, GenerationRequest(f"p{i}", prompt_ids(plain, p), GREEDY)))[0][0] for i, p in enumerate(PROMPTS)]
    with structlog.testing.capture_logs() as logs:
        async with running(package, draft_length="fixed", block_size=4) as speculative:
            first = [await answers(speculative, GenerationRequest(f"a{i}", prompt_ids(speculative, p), GREEDY)) for i, p in enumerate(PROMPTS)]
            again = [await answers(speculative, GenerationRequest(f"b{i}", prompt_ids(speculative, p), GREEDY)) for i, p in enumerate(PROMPTS)]
    rounds = [entry for entry in logs if entry["event"] == "round_completed"]
    assert sum(r["drafts"] for r in rounds) > 0, "the n-gram drafter proposed nothing"
    for want, (miss, _), (hit, hit_ends) in zip(expected, first, again):
        assert miss[0] == want
        assert hit[0] == want
        assert hit_ends[0].usage.cached_tokens > 0


async def test_json_schema_answers_and_parallel_choices(package: Path) -> None:
    async with running(package) as scheduler:
        assert scheduler.grammars is not None
        grammar = scheduler.grammars.compile(GrammarSpec.json_schema(SCHEMA, "response_format"))
        prompt = prompt_ids(scheduler, "Describe the user as JSON, with their colour and mood.")
        (single,), _ = await answers(scheduler, GenerationRequest("one", prompt, GREEDY))
        greedy_choices, _ = await answers(scheduler, GenerationRequest("greedy3", prompt, GREEDY, n=3))
        params = SamplingParams(temperature=1.0, seed=7, max_tokens=40)
        structured, ends = await answers(scheduler, GenerationRequest("json3", prompt, params, n=3, grammar=grammar))
        texts = [scheduler.tokenizer.decode(tokens) for tokens in structured]
    assert greedy_choices == [single] * 3
    for text, end in zip(texts, ends):
        assert end.reason == "stop", text
        value = json.loads(text)
        assert value["colour"] in ("red", "green", "blue") and isinstance(value["happy"], bool)
