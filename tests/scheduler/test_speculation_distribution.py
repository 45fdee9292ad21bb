"""Speculation never changes what is sampled: on the tiny model, the tokens generated with
drafts verified by rejection sampling follow the same distribution as without drafts.

The drafter here proposes the last token again (one test drafts from a request's predicted output
alone); the last test drafts with a package's draft head, a learned one (tests/mtp_heads.py: one
that mostly repeats the last token too, its q a real softmax under the row's temperature,
computed inside the round) and a DeepSeek-V3 checkpoint's own MTP layer (latent attention and
experts, tests/deepseek_mtp.py). Learned-style, the repeating drafter draws each draft from q (0.8
on the last token, the rest spread over the vocabulary) and reports q; otherwise q is one-hot. Drafts are often
accepted (the tiny model repeats itself at low temperature), so both the accept path and the
residual path run, and a wrong KV entry for an accepted draft would show in the later tokens.
Each configuration samples the same prompt under many seeds; a two-sample chi-square test
compares the tokens at output positions 1-3 (position 0 comes from the prompt's prefill, before
any draft). The seeds are fixed, so the test is deterministic.
"""

from __future__ import annotations

import asyncio
import io
import itertools
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
from scipy.stats import chi2_contingency

from tests.deepseek_mtp import write_mtp_checkpoint
from tests.mtp_heads import repeat_head_state, write_head_package

from flare.distill import export as distill_export
from flare.distill.distill import DistillOptions
from flare.engine.drafters import Draft
from flare.package.directory import open_package
from flare.policy.params import SamplingParams
from flare.preparation.export import ExportOptions
from flare.scheduler.request import Finished, GenerationRequest, TextDelta
from flare.scheduler.scheduler import Scheduler, SchedulerOptions
from flare.structured import GrammarSpec

SAMPLES = 480
WAVE = 96  # requests a wave, all running at once (a row's tokens depend on its seed, not its batch-mates)
PROMPT = "one two three four one two three four one two"
# The tiny random model's logits are nearly flat over 49152 tokens; scaling its (tied) embedding
# matrix scales the logits, so a few tokens carry most of the mass and the test has power.
LOGIT_SCALE = 5.0
# The tiny DeepSeek's LM head over its embedding: a few tokens share the mass at each position.
DEEPSEEK_LOGIT_SCALE = 0.55


@pytest.fixture(scope="module")
def peaked_package(make_package, package_parts):
    state = dict(package_parts["state_dict"])
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"] * LOGIT_SCALE
    return make_package(state_dict=state)


@dataclass
class _RepeatLastState:
    tokens: list[int]
    vocab_size: int
    learned: bool
    generator: torch.Generator

    def extend(self, token_ids) -> None:
        self.tokens.extend(token_ids)

    def propose(self, k: int) -> Draft:
        last = self.tokens[-1]
        if not self.learned:
            return Draft((last,) * k)
        # Rejection sampling is exact only for drafts drawn from the q the drafter reports, with
        # randomness of its own: each request's state has its own generator (a draw keyed by the
        # context alone would give every seed sharing a context the same draft).
        q = torch.full((self.vocab_size,), 0.2 / (self.vocab_size - 1))
        q[last] = 0.8
        drafts = torch.multinomial(q, k, replacement=True, generator=self.generator)
        return Draft(tuple(drafts.tolist()), q.expand(k, -1).clone())


@dataclass
class RepeatLastDrafter:
    vocab_size: int
    learned: bool
    name: str = "repeat-last"
    _states: itertools.count = field(default_factory=itertools.count)

    def new_state(self, prompt_ids) -> _RepeatLastState:
        generator = torch.Generator().manual_seed(next(self._states))
        return _RepeatLastState(list(prompt_ids), self.vocab_size, self.learned, generator)


@dataclass
class _SilentState:
    def extend(self, token_ids) -> None:
        pass

    def propose(self, k: int) -> Draft:
        return Draft(())


@dataclass
class SilentDrafter:
    """Proposes nothing: what drafts, drafts from the request's prediction alone."""

    name: str = "silent"

    def new_state(self, prompt_ids) -> _SilentState:
        return _SilentState()


_PLAIN_SAMPLES: dict[tuple[str, SamplingParams, GrammarSpec | None], tuple[list[list[int]], int]] = {}


async def sample_tokens(
    package_path,
    params: SamplingParams,
    drafter: RepeatLastDrafter | SilentDrafter | None,
    constraint: GrammarSpec | None = None,
    *,
    head: bool = False,
    tensor_parallel: int = 1,
    prediction: tuple[int, ...] = (),
) -> tuple[list[list[int]], int]:
    """Each seed's generated tokens, and how many times a row sampled (target forwards per row).
    `head`: draft with the package's learned draft head; `tensor_parallel`: ranks of the model
    (sampling then runs from per-shard statistics across them); `prediction`: every request's
    predicted output (OpenAI's `prediction`), drafted from before the drafter. Samples without
    drafts are drawn once per package, parameters and constraint (the seeds are fixed, so they are
    the same every time): several tests compare against the same ones."""
    plain = drafter is None and not head and not prediction and tensor_parallel == 1
    key = (str(package_path), params, constraint)
    if plain and key in _PLAIN_SAMPLES:
        return _PLAIN_SAMPLES[key]
    package = open_package(package_path)
    # No jump-forward: the grammar's forced tokens would be drafts of their own.
    options = SchedulerOptions(
        draft_tokens=3 if drafter is not None or head or prediction else 0,
        draft_length="fixed",
        jump_forward=False,
        tensor_parallel=tensor_parallel,
        max_concurrency=WAVE,
    )
    scheduler = Scheduler.from_package(package, options, drafter=drafter)
    loop = asyncio.create_task(scheduler.run())
    prompt = tuple(scheduler.tokenizer.encode(PROMPT))
    grammar = scheduler.grammars.compile(constraint) if constraint is not None and scheduler.grammars else None
    outputs: list[list[int]] = []
    try:
        for start in range(0, SAMPLES, WAVE):
            streams = [
                scheduler.submit(
                    GenerationRequest(
                        f"s{seed}",
                        prompt,
                        SamplingParams(**{**params.__dict__, "seed": seed}),
                        grammar=grammar,
                        prediction=prediction,
                    )
                )
                for seed in range(start, min(start + WAVE, SAMPLES))
            ]
            for stream in streams:
                ids: list[int] = []
                async for event in stream:
                    if isinstance(event, TextDelta):
                        ids.extend(event.token_ids)
                    else:
                        assert isinstance(event, Finished), event
                outputs.append(ids)
        rounds = scheduler.snapshot().device_statuses["OK"]
    finally:
        scheduler.stop()
        await loop
    if plain:
        _PLAIN_SAMPLES[key] = outputs, rounds
    return outputs, rounds


def assert_same_distribution(
    plain: list[list[int]],
    plain_rounds: int,
    speculative: list[list[int]],
    speculative_rounds: int,
    drafting: str,
    reaching: float = 0.9,
) -> None:
    """Drafts were accepted (the same number of samples took fewer target forwards), and at each
    of positions 1-3 the speculative tokens follow the plain ones' distribution (chi-square);
    `reaching`: the share of samples that must still be generating at a position."""
    assert speculative_rounds < plain_rounds
    for position in (1, 2, 3):
        a = [ids[position] for ids in plain if len(ids) > position]
        b = [ids[position] for ids in speculative if len(ids) > position]
        assert len(a) > SAMPLES * reaching and len(b) > SAMPLES * reaching
        p_value = _same_distribution(a, b)
        print(f"position {position}: {len(set(a))} distinct tokens, p = {p_value:.3f}")
        assert p_value > 1e-3, f"token {position} differs with {drafting}"
    print(f"row forwards: {plain_rounds} without drafts, {speculative_rounds} with {drafting}")


def _same_distribution(a: list[int], b: list[int]) -> float:
    """p-value of a two-sample chi-square test; rare tokens pooled so expected counts are >= 5."""
    counts_a, counts_b = Counter(a), Counter(b)
    common = [t for t in counts_a | counts_b if counts_a[t] + counts_b[t] >= 10]
    table = [[counts_a[t] for t in common], [counts_b[t] for t in common]]
    table[0].append(len(a) - sum(table[0]))
    table[1].append(len(b) - sum(table[1]))
    if table[0][-1] + table[1][-1] == 0:
        table = [row[:-1] for row in table]
    if len(table[0]) < 2:
        return 1.0  # one token only, in both samples
    return chi2_contingency(table).pvalue


@pytest.mark.parametrize(
    ("params", "learned"),
    [
        (SamplingParams(temperature=0.4, max_tokens=4), False),
        (SamplingParams(temperature=1.0, max_tokens=4), True),
        (SamplingParams(temperature=1.0, top_k=8, max_tokens=4), False),
        (SamplingParams(temperature=1.0, top_k=8, top_p=0.9, min_p=0.02, max_tokens=4), True),
    ],
    ids=["one-hot-q", "learned-q", "one-hot-q-top-k", "learned-q-filtered"],
)
async def test_speculative_sampling_follows_the_non_speculative_distribution(peaked_package, params, learned):
    vocab = open_package(peaked_package).manifest.model.vocab_size
    plain, plain_rounds = await sample_tokens(peaked_package, params, None)
    speculative, speculative_rounds = await sample_tokens(peaked_package, params, RepeatLastDrafter(vocab, learned))
    assert_same_distribution(plain, plain_rounds, speculative, speculative_rounds, "speculation")


async def test_sampling_with_a_predicted_output_follows_the_distribution_without_it(peaked_package):
    """A request's prediction drafts one-hot like lookup: the answer's distribution is the same
    with it. The prediction is the likeliest answer, so its drafts are often accepted."""
    params = SamplingParams(temperature=0.4, max_tokens=4)
    plain, plain_rounds = await sample_tokens(peaked_package, params, None)
    likeliest = tuple(Counter(ids[p] for ids in plain if len(ids) > p).most_common(1)[0][0] for p in range(4))
    predicted, predicted_rounds = await sample_tokens(peaked_package, params, SilentDrafter(), prediction=likeliest)
    assert_same_distribution(plain, plain_rounds, predicted, predicted_rounds, "a prediction")


async def test_with_a_grammar_speculative_sampling_follows_the_non_speculative_distribution(peaked_package):
    """The mask comes before verification: drafts are accepted or corrected against the masked
    p, so the constrained answer's distribution is the same with and without them."""
    vocab = open_package(peaked_package).manifest.model.vocab_size
    params = SamplingParams(temperature=1.0, max_tokens=4)
    constraint = GrammarSpec("regex", "( ?(one|two|three|four|five|a|the))+", "structured_outputs.regex")
    plain, plain_rounds = await sample_tokens(peaked_package, params, None, constraint)
    speculative, speculative_rounds = await sample_tokens(peaked_package, params, RepeatLastDrafter(vocab, False), constraint)
    # A grammar's answers may end sooner (the pattern is complete): fewer reach each position.
    assert_same_distribution(
        plain, plain_rounds, speculative, speculative_rounds, "speculation under the grammar", reaching=0.5
    )


@pytest.mark.parametrize(
    ("params", "constraint"),
    [
        (SamplingParams(temperature=0.4, max_tokens=4), None),
        (
            SamplingParams(temperature=1.0, max_tokens=4),
            GrammarSpec("regex", "( ?(one|two|three|four|five|a|the))+", "structured_outputs.regex"),
        ),
    ],
    ids=["one-hot-q", "grammar"],
)
async def test_at_tensor_parallel_2_speculative_sampling_follows_the_distribution_of_one_rank(
    peaked_package, params, constraint
):
    """Verification and sampling from per-shard statistics across two ranks (the grammar's mask
    cut into each rank's slice) draw from the distribution that one rank draws from without drafts."""
    vocab = open_package(peaked_package).manifest.model.vocab_size
    plain, plain_rounds = await sample_tokens(peaked_package, params, None, constraint)
    speculative, speculative_rounds = await sample_tokens(
        peaked_package, params, RepeatLastDrafter(vocab, False), constraint, tensor_parallel=2
    )
    assert_same_distribution(
        plain, plain_rounds, speculative, speculative_rounds, "speculation at TP 2", reaching=0.5 if constraint else 0.9
    )


@pytest.fixture(scope="module")
def peaked_head_package(make_package, package_parts):
    state = dict(package_parts["state_dict"])
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"] * LOGIT_SCALE
    vocab = torch.arange(0, package_parts["config"].vocab_size, 2)
    head = repeat_head_state(package_parts["config"], state, vocab, mix=0.3, seed=1)
    return write_head_package(make_package, package_parts, head, draft_tokens=3, state_dict=state)


@pytest.fixture(scope="module")
def deepseek_head_package(smollm2_source, tmp_path_factory):
    """A tiny DeepSeek-V3 whose checkpoint's own MTP layer (latent attention, experts) is the head
    (tests/deepseek_mtp.py: peaked, the head mostly proposes the token it reads), exported as the
    contract's DeepSeek packages are: 7 drafts, vocabulary-parallel sampling."""
    root = tmp_path_factory.mktemp("deepseek-mtp")
    checkpoint = write_mtp_checkpoint(
        root / "hf", smollm2_source.tokenizer_json, smollm2_source.chat_template, logit_scale=DEEPSEEK_LOGIT_SCALE
    )
    distill_export.export_with_draft_head(
        str(checkpoint.path),
        root / "pkg",
        ExportOptions(dtype="float32", vocabulary_parallel_sampling=True),
        DistillOptions(draft_tokens=7, prompt_limit=20, answer_tokens=32),  # a brief held-out measurement
        stderr=io.StringIO(),
    )
    return root / "pkg"


@pytest.fixture
def head_package(request):
    """The package of the fixture the test's parameter names: one per kind of draft head."""
    return request.getfixturevalue(request.param)


@pytest.mark.parametrize(
    ("head_package", "params", "tensor_parallel"),
    [
        ("peaked_head_package", SamplingParams(temperature=1.0, max_tokens=4), 1),
        ("peaked_head_package", SamplingParams(temperature=0.7, top_k=8, top_p=0.9, max_tokens=4), 1),
        ("deepseek_head_package", SamplingParams(temperature=1.0, max_tokens=4), 1),
        ("deepseek_head_package", SamplingParams(temperature=1.0, top_k=8, top_p=0.9, max_tokens=4), 1),
        ("deepseek_head_package", SamplingParams(temperature=1.0, max_tokens=4), 2),
    ],
    indirect=["head_package"],
    ids=["learned-head-q", "learned-head-q-filtered", "deepseek-mtp-head-q", "deepseek-mtp-head-q-filtered", "deepseek-mtp-head-q-tp2"],
)
async def test_sampling_with_a_draft_head_follows_the_non_speculative_distribution(head_package, params, tensor_parallel):
    """Either kind of head a package ships, a learned one (tests/mtp_heads.py) and a DeepSeek-V3
    checkpoint's own MTP layer: its q is the softmax the round computes, and the answers drawn
    with its drafts verified follow the distribution drawn without them; for DeepSeek also at
    tensor parallel 2 (the contract's scenario: the head drafts on rank 0, verification and
    sampling from both ranks' vocabulary shards) against one rank without drafts."""
    plain, plain_rounds = await sample_tokens(head_package, params, None)
    speculative, speculative_rounds = await sample_tokens(head_package, params, None, head=True, tensor_parallel=tensor_parallel)
    assert_same_distribution(plain, plain_rounds, speculative, speculative_rounds, f"the draft head at TP {tensor_parallel}")
