"""Speculative verification: the emitted tokens follow the non-speculative distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flare.sampler.round import sample_round
from flare.sampler.shards import LocalShards
from flare.policy.params import SamplingParams

from .helpers import assert_matches_distribution, dirichlet, make_batch, no_drafts
from .reference import target_distribution

VOCAB = 8
DRAWS = 20000
START = VOCAB  # the "no previous token" state of the toy model


def _toy_model(seed: int) -> torch.Tensor:
    """Next-token logits of a first-order Markov chain: row t is the distribution after token t."""
    return torch.randn(VOCAB + 1, VOCAB, generator=torch.Generator().manual_seed(seed)) * 1.5


def _speculative_pairs(params: SamplingParams, table: torch.Tensor, random_q: bool, drafts: int = 2) -> tuple[np.ndarray, np.ndarray, float]:
    """The first two output tokens of DRAWS independent requests decoded with speculation."""
    generator = torch.Generator().manual_seed(11)
    if random_q:
        q = dirichlet(0.7, VOCAB, (DRAWS, drafts), seed=12)
        draft_tokens = torch.multinomial(q.view(-1, VOCAB), 1, generator=generator).view(DRAWS, drafts)
        draft_probs = q
    else:
        draft_tokens = torch.randint(0, VOCAB, (DRAWS, drafts), generator=generator)
        # A deterministic drafter often proposes the likely token: bias half the drafts to it.
        likely = table[START].argmax().expand(DRAWS)
        draft_tokens[: DRAWS // 2, 0] = likely[: DRAWS // 2]
        draft_probs = None
    previous = torch.cat([torch.full((DRAWS, 1), START), draft_tokens], 1)
    logits = table[previous].reshape(DRAWS * (drafts + 1), VOCAB)
    seeds = range(50_000, 50_000 + DRAWS)
    first_round = sample_round(
        logits, torch.full((DRAWS,), drafts), draft_tokens, draft_probs, make_batch([params] * DRAWS, seeds=seeds)
    )
    assert (first_round.status == 0).all()
    first = first_round.tokens[:, 0]
    second = first_round.tokens[:, 1].clone()
    # Requests that emitted one token decode their second one in a plain round at position 1.
    num_drafts, no_draft_tokens = no_drafts(DRAWS)
    next_round = sample_round(
        table[first], num_drafts, no_draft_tokens, None, make_batch([params] * DRAWS, seeds=seeds, positions=[1] * DRAWS)
    )
    single = first_round.num_emitted == 1
    second[single] = next_round.tokens[single, 0]
    return first.numpy(), second.numpy(), float(first_round.num_emitted.float().mean())


def _pair_distribution(params: SamplingParams, table: torch.Tensor) -> np.ndarray:
    p_first = target_distribution(table[START].tolist(), params)
    return np.concatenate([p_first[a] * target_distribution(table[a].tolist(), params) for a in range(VOCAB)])


FILTERS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_k=4),
    SamplingParams(temperature=1.0, top_p=0.75),
    SamplingParams(temperature=1.2, min_p=0.15),
]


@pytest.mark.parametrize("random_q", [False, True], ids=["one_hot_q", "random_q"])
@pytest.mark.parametrize("params", FILTERS, ids=["unfiltered", "top_k", "top_p", "min_p"])
def test_speculation_preserves_first_token_and_pair_distribution(params: SamplingParams, random_q: bool) -> None:
    table = _toy_model(3)
    first, second, mean_emitted = _speculative_pairs(params, table, random_q)
    assert mean_emitted > 1.2, "the test should exercise accepted drafts"
    assert_matches_distribution(first, target_distribution(table[START].tolist(), params))
    assert_matches_distribution(first * VOCAB + second, _pair_distribution(params, table))


@pytest.mark.parametrize("shards", [2, 4])
@pytest.mark.parametrize("random_q", [False, True], ids=["one_hot_q", "random_q"])
def test_vocabulary_parallel_verification_preserves_the_distribution(shards: int, random_q: bool) -> None:
    table = _toy_model(4)
    params = SamplingParams(temperature=0.9)
    generator = torch.Generator().manual_seed(2)
    if random_q:
        draft_probs = dirichlet(0.7, VOCAB, (DRAWS, 1), seed=13)
        draft_tokens = torch.multinomial(draft_probs.view(-1, VOCAB), 1, generator=generator).view(DRAWS, 1)
    else:
        draft_probs, draft_tokens = None, torch.randint(0, VOCAB, (DRAWS, 1), generator=generator)
    logits = table[torch.cat([torch.full((DRAWS, 1), START), draft_tokens], 1)].reshape(-1, VOCAB)
    batch = make_batch([params] * DRAWS, seeds=range(DRAWS))
    sharded = sample_round(logits, torch.ones(DRAWS, dtype=torch.int64), draft_tokens, draft_probs, batch, LocalShards(shards))
    unsharded = sample_round(logits, torch.ones(DRAWS, dtype=torch.int64), draft_tokens, draft_probs, batch)
    assert (sharded.status == 0).all()
    assert_matches_distribution(sharded.tokens[:, 0].numpy(), target_distribution(table[START].tolist(), params))
    # Same streams, same statistics up to rounding: the same tokens (up to rare near-ties).
    agreement = (sharded.tokens == unsharded.tokens).all(1).float().mean()
    assert float(agreement) > 0.999


def test_greedy_verification_accepts_exactly_the_argmax_prefix() -> None:
    table = _toy_model(5)
    chain = [START]
    for _ in range(4):
        chain.append(int(table[chain[-1]].argmax()))
    greedy_chain = chain[1:]  # the argmax continuation
    rows = []
    for matching in range(4):  # drafts agree with the argmax for `matching` tokens, then differ
        drafts = greedy_chain[:matching] + [(t + 1) % VOCAB for t in greedy_chain[matching:3]]
        rows.append(drafts)
    draft_tokens = torch.tensor(rows)
    previous = torch.cat([torch.full((4, 1), START), draft_tokens], 1)
    logits = table[previous].reshape(-1, VOCAB)
    result = sample_round(
        logits, torch.full((4,), 3), draft_tokens, None, make_batch([SamplingParams(temperature=0.0)] * 4)
    )
    for matching in range(4):
        assert int(result.num_emitted[matching]) == matching + 1
        assert result.tokens[matching, : matching + 1].tolist() == greedy_chain[: matching + 1]


def test_penalties_at_a_draft_position_count_the_earlier_drafts_as_output() -> None:
    vocab = 10
    logits = torch.zeros(3, vocab)
    logits[0, 5] = 3.0  # position 0: argmax 5, drafted and accepted
    logits[1, 5], logits[1, 6] = 2.0, 1.5  # position 1: 5 wins unless 5 is already in the output
    logits[2, 5], logits[2, 6], logits[2, 7] = 1.8, 1.9, 1.0
    params = SamplingParams(temperature=0.0, presence_penalty=1.0)
    result = sample_round(
        logits, torch.tensor([2]), torch.tensor([[5, 6]]), None, make_batch([params], prompt_ids=[[]], output_ids=[[]])
    )
    # Position 1 sees output [5]: 5 drops to 1.0 and 6 wins; position 2 sees [5, 6]: 7 wins.
    assert result.tokens[0].tolist() == [5, 6, 7]
    assert int(result.num_emitted[0]) == 3
