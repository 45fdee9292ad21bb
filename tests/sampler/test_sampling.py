"""Plain sampling (K = 0) through sample_round: distributions, seeds, greedy, vocabulary shards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flare.sampler.round import sample_round
from flare.sampler.shards import LocalShards
from flare.sampler.status import DeviceStatus
from flare.policy.params import SamplingParams

from .helpers import assert_matches_distribution, make_batch, no_drafts
from .reference import target_distribution

VOCAB = 24
DRAWS = 20000


def _logits(seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, generator=generator) * 1.5


def _draw(params: SamplingParams, logits: torch.Tensor, vocab_shards: int = 1, **rows: list) -> np.ndarray:
    """DRAWS independent samples: one row per draw, each with its own seed."""
    batch = make_batch([params] * DRAWS, seeds=range(1000, 1000 + DRAWS), **rows)
    num_drafts, draft_tokens = no_drafts(DRAWS)
    result = sample_round(logits.expand(DRAWS, VOCAB).contiguous(), num_drafts, draft_tokens, None, batch, LocalShards(vocab_shards))
    assert (result.status == 0).all() and (result.num_emitted == 1).all()
    return result.tokens[:, 0].numpy()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.1),
        SamplingParams(temperature=0.9, top_k=10, top_p=0.7, min_p=0.05),
    ],
    ids=["plain", "temperature", "top_k", "top_p", "min_p", "all_filters"],
)
def test_sampled_frequencies_match_filtered_softmax(params: SamplingParams) -> None:
    logits = _logits()
    assert_matches_distribution(_draw(params, logits), target_distribution(logits.tolist(), params))


def test_sampled_frequencies_match_penalised_softmax() -> None:
    params = SamplingParams(temperature=1.0, repetition_penalty=1.8, presence_penalty=0.5, frequency_penalty=0.4)
    logits = _logits(1)
    prompt, output = [0, 1, 2, 3], [3, 4, 4, 4, 5]
    samples = _draw(params, logits, prompt_ids=[prompt] * DRAWS, output_ids=[output] * DRAWS)
    expected = target_distribution(logits.tolist(), params, prompt, output)
    assert_matches_distribution(samples, expected)
    # The penalties move real mass: the unpenalised distribution must be rejected.
    with pytest.raises(AssertionError):
        assert_matches_distribution(samples, target_distribution(logits.tolist(), SamplingParams()))


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_vocabulary_parallel_sampling_matches_unsharded_distribution(shards: int) -> None:
    logits = _logits(2)
    params = SamplingParams(temperature=0.8)
    samples = _draw(params, logits, vocab_shards=shards)
    assert_matches_distribution(samples, target_distribution(logits.tolist(), params))
    # The noise is keyed by vocabulary index, so sharding draws the very same tokens.
    assert np.array_equal(samples, _draw(params, logits, vocab_shards=1))


@pytest.mark.parametrize(
    "filtered", [SamplingParams(top_k=3), SamplingParams(top_p=0.9), SamplingParams(min_p=0.2)], ids=["top_k", "top_p", "min_p"]
)
def test_vocabulary_parallel_sampling_refuses_filtered_rows(filtered: SamplingParams) -> None:
    params = [SamplingParams(), filtered, SamplingParams(temperature=0.0, top_k=3)]
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(6))
    num_drafts, draft_tokens = no_drafts(3)
    result = sample_round(logits, num_drafts, draft_tokens, None, make_batch(params), LocalShards(2))
    assert result.status.tolist() == [0, int(DeviceStatus.INVALID_SPECULATION), 0]
    assert result.num_emitted.tolist() == [1, 0, 1]
    assert result.tokens[1].tolist() == [-1]
    # A greedy row's argmax does not depend on filters, so it is served.
    assert int(result.tokens[2, 0]) == int(logits[2].argmax())


def test_greedy_rows_emit_the_argmax_lowest_index_on_ties() -> None:
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(7))
    logits[3, 7] = logits[3, 11] = logits[3].max() + 1.0
    num_drafts, draft_tokens = no_drafts(5)
    for shards in (1, 2, 4):
        result = sample_round(logits, num_drafts, draft_tokens, None, make_batch([SamplingParams(temperature=0.0)] * 5), LocalShards(shards))
        expected = logits.argmax(-1)
        expected[3] = 7
        assert result.tokens[:, 0].tolist() == expected.tolist()


def test_same_seed_gives_same_tokens_alone_and_inside_a_batch_of_32() -> None:
    vocab = 1000
    generator = torch.Generator().manual_seed(5)
    params = SamplingParams(temperature=0.9, top_p=0.95, repetition_penalty=1.1)
    row_logits = torch.randn(3, vocab, generator=generator)  # one row, 2 drafts
    draft = torch.tensor([[int(row_logits[0].argmax()), 17]])
    alone = sample_round(
        row_logits, torch.tensor([2]), draft, None,
        make_batch([params], seeds=[77], positions=[4], prompt_ids=[[1, 2]], output_ids=[[3]]),
    )
    others = [SamplingParams(temperature=t, top_k=k) for t, k in zip(np.linspace(0, 1.5, 31), range(31))]
    batch_params = others[:13] + [params] + others[13:]
    drafts_per_row = [int(n) for n in torch.randint(0, 4, (32,), generator=generator)]
    drafts_per_row[13] = 2
    chunks = [torch.randn(n + 1, vocab, generator=generator) for n in drafts_per_row]
    chunks[13] = row_logits
    draft_tokens = torch.randint(0, vocab, (32, 3), generator=generator)
    draft_tokens[13] = torch.tensor([int(draft[0, 0]), 17, -1])
    batch = make_batch(
        batch_params,
        seeds=[77 if r == 13 else 1000 + r for r in range(32)],
        positions=[4 if r == 13 else r for r in range(32)],
        prompt_ids=[[1, 2] if r == 13 else [r] for r in range(32)],
        output_ids=[[3] if r == 13 else [] for r in range(32)],
    )
    together = sample_round(torch.cat(chunks), torch.tensor(drafts_per_row), draft_tokens, None, batch)
    assert together.status[13] == alone.status[0] == 0
    emitted = int(alone.num_emitted[0])
    assert int(together.num_emitted[13]) == emitted
    assert together.tokens[13, :emitted].tolist() == alone.tokens[0, :emitted].tolist()


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.0)])
def test_a_round_without_drafts_samples_the_same_tokens_whatever_the_width_of_its_draft_slots(params: SamplingParams) -> None:
    # The scheduler passes draft slots of width 1 or more even when no row drafts: the round
    # skips the verification, and must draw exactly what a round without slots draws.
    rows = 64
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(4)) * 2
    batch = make_batch([params] * rows, seeds=range(rows))
    without = sample_round(logits, *no_drafts(rows), None, batch)
    for width in (1, 3):
        slots = sample_round(logits, torch.zeros(rows, dtype=torch.int64), torch.full((rows, width), -1), None, batch)
        assert torch.equal(slots.tokens[:, 0], without.tokens[:, 0]) and (slots.tokens[:, 1:] == -1).all()
        assert torch.equal(slots.status, without.status) and torch.equal(slots.num_emitted, without.num_emitted)
