"""Token masks, logit bias and log-probabilities in the sampling kernels: what they do to the
sampled distribution and what they report, with and without speculation and shards, and the
Triton kernels (under the interpreter) equal to their twins."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flare.sampler.triton import launch as triton_launch
from flare.sampler.penalties import PenaltyState, penalize_and_scale
from flare.sampler.triton.penalties import penalize_and_scale as penalize_and_scale_triton
from flare.sampler.round import sample_round
from flare.sampler.shards import LocalShards
from flare.sampler.top_tokens import shard_top_tokens
from flare.sampler.triton.top_tokens import shard_top_tokens as shard_top_tokens_triton
from flare.policy.params import SamplingParams

from .helpers import assert_matches_distribution, make_batch, no_drafts
from .reference import target_distribution


def bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """[N, V] bool -> [N, ceil(V / 32)] int32, bit i % 32 of word i // 32 (as llguidance fills it)."""
    rows, vocab = allowed.shape
    words = -(-vocab // 32)
    padded = torch.zeros(rows, words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    weights = torch.tensor([1 << b for b in range(32)], dtype=torch.int64)
    packed = (padded.view(rows, words, 32) * weights).sum(2)
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


@pytest.fixture(params=["one_block", "several_blocks"])
def blocks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "several_blocks":
        monkeypatch.setattr(triton_launch, "INTERPRETER_MAX_BLOCK", 256)
    return request.param


def test_mask_and_bias_kernel_equals_twin(blocks: str) -> None:
    generator = torch.Generator().manual_seed(21)
    vocab = 1000
    row_of_position = torch.tensor([0, 0, 0, 1, 2])
    index_in_row = torch.tensor([0, 1, 2, 0, 0])
    logits = torch.randn(5, vocab, generator=generator) * 3
    allowed = torch.rand(5, vocab, generator=generator) < 0.3
    allowed[:, 999] = True  # the last, partial word
    bias = torch.zeros(3, vocab)
    bias[0, 7], bias[1, 999], bias[2, 0] = 100.0, -100.0, 3.5
    drafts = torch.randint(0, vocab, (3, 2), generator=generator)
    penalties = PenaltyState.from_ids(torch.tensor([[3, 4], [5, -1], [6, 7]]), torch.tensor([[8], [9], [-1]]), vocab)
    args = (
        logits, row_of_position, index_in_row, drafts,
        torch.tensor([0.7, 1.0, 1.3]), torch.tensor([1.3, 1.0, 0.8]),
        torch.tensor([0.5, 0.0, -0.4]), torch.tensor([0.3, 0.0, 1.2]), penalties,
    )
    mask = bitmask(allowed)
    twin = penalize_and_scale(*args, scale=True, token_mask=mask, bias=bias)
    kernel = penalize_and_scale_triton(*args, scale=True, token_mask=mask, bias=bias)
    assert torch.equal(kernel.scaled, twin.scaled)
    assert torch.equal(torch.isfinite(twin.scaled), allowed)
    assert not twin.nonfinite.any(), "a mask's -inf is not a non-finite logit of the model"


@pytest.mark.parametrize("shards", [1, 3])
def test_top_tokens_kernel_equals_twin(blocks: str, shards: int) -> None:
    generator = torch.Generator().manual_seed(22)
    scaled = torch.randn(4, 700, generator=generator)
    scaled[1, 10] = scaled[1, 600] = scaled[1].max() + 1  # a tie: the lower id first
    scaled[2, :690] = float("-inf")  # fewer finite logits than k
    twin = shard_top_tokens(scaled, 12, shards)
    kernel = shard_top_tokens_triton(scaled, 12, shards)
    finite = torch.isfinite(twin.values)
    assert torch.equal(torch.isfinite(kernel.values), finite)
    assert torch.equal(kernel.values[finite], twin.values[finite])
    assert torch.equal(kernel.ids[finite], twin.ids[finite])


def _round(params: list[SamplingParams], logits: torch.Tensor, **kwargs):
    num_drafts, drafts = no_drafts(len(params))
    return sample_round(logits, num_drafts, drafts, None, make_batch(params, seeds=range(len(params))), **kwargs)


def test_mask_confines_greedy_and_sampled_tokens_to_the_allowed_set() -> None:
    generator = torch.Generator().manual_seed(23)
    vocab, rows = 300, 64
    logits = torch.randn(rows, vocab, generator=generator) * 3
    allowed = torch.zeros(rows, vocab, dtype=torch.bool)
    allowed[:, 40:45] = True
    params = [SamplingParams(temperature=0.0)] * 32 + [SamplingParams(temperature=1.5, top_k=50)] * 32
    result = _round(params, logits, token_mask=bitmask(allowed))
    assert (result.status == 0).all()
    tokens = result.tokens[:, 0]
    assert ((tokens >= 40) & (tokens < 45)).all()
    assert torch.equal(tokens[:32], logits[:32, 40:45].argmax(1) + 40)


def test_mask_that_allows_nothing_is_an_empty_distribution() -> None:
    logits = torch.randn(2, 64)
    allowed = torch.zeros(2, 64, dtype=torch.bool)
    allowed[1, 3] = True
    result = _round([SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)], logits, token_mask=bitmask(allowed))
    assert result.status.tolist() == [4, 0]
    assert int(result.tokens[1, 0]) == 3


def test_logit_bias_minus_100_removes_the_argmax_and_plus_100_forces_a_token() -> None:
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(24))
    top = int(logits[0].argmax())
    params = [
        SamplingParams(temperature=0.0, logit_bias=((top, -100.0),)),
        SamplingParams(temperature=0.9, logit_bias=((17, 100.0),)),
        SamplingParams(temperature=0.0),
    ]
    result = _round(params, logits)
    assert int(result.tokens[0, 0]) == int(logits[0].topk(2).indices[1])
    assert int(result.tokens[1, 0]) == 17
    assert int(result.tokens[2, 0]) == int(logits[2].argmax())


def test_logprobs_are_those_of_the_distribution_sampled_from() -> None:
    generator = torch.Generator().manual_seed(25)
    vocab = 200
    logits = torch.randn(4, vocab, generator=generator) * 2
    params = [
        SamplingParams(temperature=0.0),  # greedy: the distribution at temperature 1
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_k=5),  # renormalised over the kept five
        SamplingParams(temperature=0.5, logit_bias=((3, 2.0),), repetition_penalty=1.2),
    ]
    batch = make_batch(params, seeds=range(4), prompt_ids=[[1, 2]] * 4, output_ids=[[3]] * 4)
    num_drafts, drafts = no_drafts(4)
    result = sample_round(logits, num_drafts, drafts, None, batch, num_logprobs=5)
    assert result.logprobs is not None
    for row, p in enumerate(params):
        probe = p if not p.greedy else SamplingParams(temperature=1.0)
        biased = logits[row].double().clone()
        for token, b in p.logit_bias:
            biased[token] += b
        expected = target_distribution(biased.tolist(), probe, prompt_ids=[1, 2], output_ids=[3])
        token = int(result.tokens[row, 0])
        assert float(result.logprobs.logprob[row, 0]) == pytest.approx(np.log(expected[token]), abs=1e-4)
        top_ids = result.logprobs.top_ids[row, 0].tolist()
        assert top_ids == np.argsort(-expected, kind="stable")[:5].tolist()
        np.testing.assert_allclose(
            result.logprobs.top_logprobs[row, 0].numpy(), np.log(expected[top_ids]), atol=1e-4
        )
    assert int(result.tokens[0, 0]) == int(result.logprobs.top_ids[0, 0, 0]), "greedy emits the top logprob"


def test_accepted_drafts_report_the_target_p_and_shards_agree() -> None:
    generator = torch.Generator().manual_seed(26)
    vocab = 120
    logits = torch.randn(4, vocab, generator=generator) * 2
    drafts = torch.stack([logits[0].argmax(), logits[1].argmax(), logits[2].argmax()]).view(1, 3)
    batch = make_batch([SamplingParams(temperature=0.0)])
    results = [
        sample_round(logits, torch.tensor([3]), drafts, None, batch, LocalShards(s), num_logprobs=3) for s in (1, 4)
    ]
    for result in results:
        assert int(result.num_emitted[0]) == 4
        assert result.logprobs is not None
        expected = torch.log_softmax(logits, 1)
        torch.testing.assert_close(result.logprobs.logprob[0], expected.gather(1, result.tokens[0].view(4, 1)).view(4))
    assert torch.equal(results[0].logprobs.top_ids, results[1].logprobs.top_ids)
    torch.testing.assert_close(results[0].logprobs.top_logprobs, results[1].logprobs.top_logprobs)


def test_with_a_mask_speculative_sampling_matches_plain_sampling() -> None:
    """Drafts verified against the masked p: the first token follows the masked distribution,
    whether the draft is allowed, forbidden (the grammar would have cut it) or absent."""
    draws, vocab = 20000, 8
    table = torch.randn(vocab + 1, vocab, generator=torch.Generator().manual_seed(27)) * 1.5
    allowed = torch.tensor([True, False, True, True, False, True, False, True])
    params = SamplingParams(temperature=1.0)
    expected = target_distribution(table[vocab].masked_fill(~allowed, float("-inf")).tolist(), params)
    draft = torch.randint(0, vocab, (draws, 1), generator=torch.Generator().manual_seed(28))
    logits = torch.stack([table[vocab].expand(draws, vocab), table[draft.view(-1)]], 1).reshape(2 * draws, vocab)
    mask = bitmask(allowed.expand(2 * draws, vocab))
    result = sample_round(
        logits, torch.ones(draws, dtype=torch.int64), draft, None,
        make_batch([params] * draws, seeds=range(7000, 7000 + draws)), token_mask=mask,
    )
    assert (result.status == 0).all()
    assert_matches_distribution(result.tokens[:, 0].numpy(), expected)
    rejected_forbidden = ~allowed[draft.view(-1)]
    assert (result.num_emitted[rejected_forbidden] == 1).all(), "a forbidden draft is never accepted"


@pytest.mark.parametrize("shards", [1, 2])
def test_sample_round_with_mask_bias_and_logprobs_on_triton_equals_twin(shards: int) -> None:
    generator = torch.Generator().manual_seed(29)
    vocab = 777
    params = [
        SamplingParams(temperature=0.0, logit_bias=((5, 4.0), (9, -100.0))),
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.1, logit_bias=((700, 1.5),)),
    ]
    num_drafts = torch.tensor([2, 1, 0])
    logits = torch.randn(6, vocab, generator=generator) * 3
    draft_tokens = torch.tensor([[int(logits[0].argmax()), int(logits[1].argmax())], [int(logits[3].argmax()), -1], [-1, -1]])
    allowed = torch.rand(6, vocab, generator=generator) < 0.5
    inputs = (logits, num_drafts, draft_tokens, None, make_batch(params, seeds=[4, 5, 6]))
    options = {"token_mask": bitmask(allowed), "num_logprobs": 4}
    twin = sample_round(*inputs, LocalShards(shards, "torch"), **options)
    kernel = sample_round(*inputs, LocalShards(shards, "triton"), **options)
    assert torch.equal(kernel.tokens, twin.tokens) and torch.equal(kernel.status, twin.status)
    assert twin.logprobs is not None and kernel.logprobs is not None
    assert torch.equal(kernel.logprobs.top_ids, twin.logprobs.top_ids)
    torch.testing.assert_close(kernel.logprobs.top_logprobs, twin.logprobs.top_logprobs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kernel.logprobs.logprob, twin.logprobs.logprob, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_forced_draft_is_accepted_when_the_mask_empties_whole_shards(backend: str) -> None:
    """A grammar that forces one token leaves most shards without an allowed token: their
    statistics must hold no mass (not NaN), so the forced draft has p = 1 and is accepted."""
    vocab = 400
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(30))
    allowed = torch.zeros(2, vocab, dtype=torch.bool)
    allowed[0, 7] = True  # forced at the draft's position
    allowed[1, 300:310] = True
    results = [
        sample_round(
            logits, torch.tensor([1]), torch.tensor([[7]]), None,
            make_batch([SamplingParams(temperature=1.0)], seeds=[seed]),
            LocalShards(4, backend), token_mask=bitmask(allowed), num_logprobs=2,
        )
        for seed in range(20)
    ]
    for result in results:
        assert int(result.status[0]) == 0 and int(result.num_emitted[0]) == 2
        assert int(result.tokens[0, 0]) == 7 and 300 <= int(result.tokens[0, 1]) < 310
        assert float(result.logprobs.logprob[0, 0]) == pytest.approx(0.0, abs=1e-6)


def test_raw_logprobs_are_the_models_softmax_whatever_was_applied() -> None:
    generator = torch.Generator().manual_seed(31)
    logits = torch.randn(3, 90, generator=generator) * 2
    params = [
        SamplingParams(temperature=0.5, top_k=3, logit_bias=((4, 5.0),)),
        SamplingParams(temperature=0.5, top_k=3, logit_bias=((4, 5.0),)),
        SamplingParams(temperature=0.0, repetition_penalty=1.4),
    ]
    batch = make_batch(params, seeds=[1, 1, 2], prompt_ids=[[1, 2]] * 3, output_ids=[[3]] * 3)
    num_drafts, drafts = no_drafts(3)
    result = sample_round(
        logits, num_drafts, drafts, None, batch, num_logprobs=2, raw_logprobs=torch.tensor([True, False, True])
    )
    assert result.logprobs is not None
    raw = torch.log_softmax(logits, 1)
    for row in (0, 2):
        token = int(result.tokens[row, 0])
        assert float(result.logprobs.logprob[row, 0]) == pytest.approx(float(raw[row, token]), abs=1e-5)
        assert result.logprobs.top_ids[row, 0].tolist() == raw[row].topk(2).indices.tolist()
    assert float(result.logprobs.logprob[1, 0]) != pytest.approx(float(raw[1, int(result.tokens[1, 0])]), abs=1e-3)
