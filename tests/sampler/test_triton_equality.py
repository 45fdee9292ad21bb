"""Every Triton kernel, run by Triton's interpreter on CPU (TRITON_INTERPRET=1, set in
tests/conftest.py), equals its torch twin on random inputs, statuses included."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from flare.sampler.triton import launch as triton_launch
from flare.sampler.distribution import distribution_statistics
from flare.sampler.triton.distribution import distribution_statistics as distribution_statistics_triton
from flare.sampler.gumbel_max import gumbel_candidates
from flare.sampler.triton.gumbel_max import gumbel_candidates as gumbel_candidates_triton
from flare.sampler.penalties import PenaltyState, penalize_and_scale
from flare.sampler.triton.penalties import penalize_and_scale as penalize_and_scale_triton
from flare.sampler.random_stream import Purpose, stream_key
from flare.sampler.round import sample_round
from flare.sampler.shards import LocalShards
from flare.policy.params import SamplingParams

from .helpers import dirichlet, make_batch


@pytest.fixture(params=["one_block", "several_blocks"])
def blocks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run each kernel with the whole vocabulary in one block, and with a 256-wide loop whose
    last block is partial (the masks of the tail)."""
    if request.param == "several_blocks":
        monkeypatch.setattr(triton_launch, "INTERPRETER_MAX_BLOCK", 256)
    return request.param


def _layout(drafts_per_row: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.repeat_interleave(torch.arange(len(drafts_per_row)), torch.tensor(drafts_per_row) + 1)
    starts = torch.cumsum(torch.tensor(drafts_per_row) + 1, 0) - (torch.tensor(drafts_per_row) + 1)
    return rows, torch.arange(rows.shape[0]) - starts[rows]


@pytest.mark.parametrize("penalized", [False, True])
def test_penalties_kernel_equals_twin(blocks: str, penalized: bool) -> None:
    generator = torch.Generator().manual_seed(1)
    vocab, drafts_per_row = 1000, [2, 0, 3]
    row_of_position, index_in_row = _layout(drafts_per_row)
    logits = torch.randn(row_of_position.shape[0], vocab, generator=generator) * 4
    logits[1, 5] = float("nan")
    logits[4, 999] = float("inf")
    logits[6, 0] = float("-inf")
    drafts = torch.randint(0, vocab, (3, 3), generator=generator)
    drafts[1] = -1
    drafts[0, 2] = -1
    penalties = None
    if penalized:
        prompt = torch.randint(0, vocab, (3, 50), generator=generator)
        output = torch.randint(0, vocab, (3, 30), generator=generator)
        output[:, :5] = drafts[0, 0]  # repeated tokens that the drafts add to
        penalties = PenaltyState.from_ids(prompt, output, vocab)
    args = (
        logits, row_of_position, index_in_row, drafts,
        torch.tensor([0.7, 1.0, 1.3]), torch.tensor([1.3, 1.0, 0.8]),
        torch.tensor([0.5, 0.0, -0.4]), torch.tensor([0.3, 0.0, 1.2]), penalties,
    )
    twin = penalize_and_scale(*args, scale=True)
    kernel = penalize_and_scale_triton(*args, scale=True)
    assert torch.equal(kernel.nonfinite, twin.nonfinite)
    assert twin.nonfinite.tolist() == [False, True, False, False, True, False, True, False]
    finite = ~twin.nonfinite
    assert torch.equal(kernel.scaled[finite], twin.scaled[finite])


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_distribution_kernel_equals_twin(blocks: str, shards: int) -> None:
    generator = torch.Generator().manual_seed(2)
    vocab, positions = 1000, 8
    scaled = torch.randn(positions, vocab, generator=generator) * 3
    scaled[2, 10] = scaled[2, 20] = scaled[2].max() + 1  # a tie for the argmax
    scaled[3, 100:200] = scaled[3, 100]  # a tie at the top-k boundary
    row_of_position = torch.tensor([0, 0, 1, 2, 3, 4, 5, 6])
    top_k = torch.tensor([0, 5, 0, 150, 40, 1, 0])
    top_p = torch.tensor([1.0, 1.0, 0.9, 1.0, 0.5, 1.0, 0.999])
    log_min_p = torch.log(torch.tensor([0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.2]))
    args = (scaled, row_of_position, top_k, top_p, log_min_p, shards)
    facts = {"filtered": shards == 1, "max_top_k": 150, "any_top_p": True}
    twin = distribution_statistics(*args, **facts)
    kernel = distribution_statistics_triton(*args, **facts)
    assert twin.argmax is not None and twin.sumexp is not None and kernel.sumexp is not None
    assert torch.equal(kernel.max, twin.max)
    assert torch.equal(kernel.argmax, twin.argmax)
    assert torch.equal(kernel.threshold, twin.threshold)
    torch.testing.assert_close(kernel.sumexp, twin.sumexp, rtol=1e-5, atol=0)
    if shards == 1:
        kept = (scaled >= twin.threshold.unsqueeze(1)).sum(1)
        assert kept[2] == 5 and kept[6] == 1 and kept[0] == vocab


@pytest.mark.parametrize("shards", [1, 4])
@pytest.mark.parametrize("with_q", [False, True])
@pytest.mark.parametrize("first_index", [0, 24576])  # a tensor-parallel rank's shard starts past 0
def test_gumbel_kernel_equals_twin(blocks: str, shards: int, with_q: bool, first_index: int) -> None:
    generator = torch.Generator().manual_seed(3)
    vocab, rows = 1000, 6
    scaled = torch.randn(9, vocab, generator=generator) * 2
    position = torch.tensor([0, 2, 3, 5, 7, 8])
    row_max = scaled[position].amax(1)
    threshold = torch.tensor([float("-inf"), 0.0, 1.0, float("-inf"), 2.0, float("-inf")])
    sumexp = torch.where(scaled[position] >= threshold.unsqueeze(1), torch.exp(scaled[position] - row_max.unsqueeze(1)), 0.0).sum(1)
    key = stream_key(torch.arange(rows) + 100, torch.arange(rows), Purpose.SAMPLE)
    exclude = torch.tensor([-1, int(scaled[2].argmax()), -1, 5, -1, 999])
    draft_q = dirichlet(0.3, vocab, (rows,), seed=3) if with_q else None
    args = (scaled, position, key, row_max, sumexp, threshold, exclude, draft_q, shards)
    twin = gumbel_candidates(*args, first_index=first_index)
    kernel = gumbel_candidates_triton(*args, first_index=first_index)
    assert torch.equal(kernel.index, twin.index)
    assert (twin.index >= first_index).all() and (twin.index < first_index + vocab).all()
    torch.testing.assert_close(kernel.value, twin.value, rtol=1e-6, atol=1e-5)
    assert (twin.index[1] != exclude[1] + first_index).all()
    if with_q:
        assert twin.residual_index is not None and kernel.residual_index is not None
        assert torch.equal(kernel.residual_index, twin.residual_index)
        torch.testing.assert_close(kernel.residual_mass, twin.residual_mass, rtol=1e-5, atol=1e-7)


def _mixed_round(vocab: int, generator: torch.Generator, with_q: bool):
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9),
        SamplingParams(temperature=0.8, top_k=20),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.1, min_p=0.05, repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.8, presence_penalty=0.3),
        SamplingParams(temperature=-1.0),  # INVALID_SAMPLING_PARAMETERS
        SamplingParams(temperature=0.5),  # NONFINITE_LOGITS below
        SamplingParams(temperature=0.0, repetition_penalty=1.5),  # INVALID_DRAFT_TOKEN below
    ]
    rows = len(params)
    num_drafts = torch.tensor([0, 3, 1, 2, 3, 3, 1, 2, 2])
    logits = torch.randn(int((num_drafts + 1).sum()), vocab, generator=generator) * 3
    draft_tokens = torch.randint(0, vocab, (rows, 3), generator=generator)
    # Make drafts likely to be accepted: propose each position's argmax.
    starts = torch.cumsum(num_drafts + 1, 0) - (num_drafts + 1)
    for row in range(rows):
        for j in range(int(num_drafts[row])):
            draft_tokens[row, j] = logits[starts[row] + j].argmax()
    logits[starts[7] + 1, 3] = float("nan")
    draft_tokens[8, 1] = vocab + 5
    draft_probs = None
    if with_q:
        draft_probs = dirichlet(0.5, vocab, (rows, 3), seed=4)
        draft_probs.scatter_(2, draft_tokens.clamp(0, vocab - 1).unsqueeze(2), 0.3)
    batch = make_batch(params, seeds=range(rows), positions=range(rows), prompt_ids=[[1, 2, 3]] * rows, output_ids=[[4, 5, 5]] * rows)
    return logits, num_drafts, draft_tokens, draft_probs, batch


@pytest.mark.parametrize("with_q", [False, True], ids=["one_hot_q", "random_q"])
@pytest.mark.parametrize("shards", [1, 2])
def test_sample_round_on_triton_equals_twin(with_q: bool, shards: int) -> None:
    generator = torch.Generator().manual_seed(4)
    inputs = _mixed_round(3001, generator, with_q)
    twin = sample_round(*inputs, LocalShards(shards, "torch"))
    kernel = sample_round(*inputs, LocalShards(shards, "triton"))
    assert torch.equal(kernel.status, twin.status)
    assert torch.equal(kernel.num_emitted, twin.num_emitted)
    assert torch.equal(kernel.tokens, twin.tokens)
    assert twin.status[6:].tolist() == [5, 1, 2]
    if shards == 1:
        assert int(twin.num_emitted.max()) > 1, "some drafts should be accepted"
    else:
        assert twin.status[2:6].tolist() == [6, 6, 6, 6]


def test_sample_round_on_triton_equals_twin_at_full_vocabulary() -> None:
    generator = torch.Generator().manual_seed(5)
    vocab = 49152
    params = [SamplingParams(temperature=0.8), SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.9, top_k=100)]
    num_drafts = torch.tensor([1, 1, 0])
    logits = torch.randn(5, vocab, generator=generator) * 3
    draft_tokens = torch.stack([logits[0].argmax(), logits[2].argmax()]).view(2, 1)
    draft_tokens = torch.cat([draft_tokens, torch.tensor([[-1]])])
    batch = make_batch(params, seeds=[1, 2, 3])
    twin = sample_round(logits, num_drafts, draft_tokens, None, batch, LocalShards(backend="torch"))
    kernel = sample_round(logits, num_drafts, draft_tokens, None, batch, LocalShards(backend="triton"))
    assert torch.equal(kernel.tokens, twin.tokens) and torch.equal(kernel.status, twin.status)


def test_torch_backend_never_imports_triton() -> None:
    code = (
        "import sys, torch\n"
        "from flare.sampler import SamplingBatch, sample_round\n"
        "from flare.policy.params import SamplingParams\n"
        "b = SamplingBatch.from_rows([SamplingParams()], [1], [0], [[]], [[]], 'cpu')\n"
        "r = sample_round(torch.randn(1, 50), torch.zeros(1, dtype=torch.int64), torch.zeros(1, 0, dtype=torch.int64), None, b)\n"
        "assert int(r.status[0]) == 0\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_top_p_threshold_equals_kernel_bisection_on_wide_nuclei_and_ties(blocks: str) -> None:
    """The twin's radix select and the kernel's bisection end on the same element, also where
    the nucleus spans most of the vocabulary (deep digits, mass above the chosen prefix), logits
    are all negative or of mixed sign, and many tokens tie at the crossing."""
    generator = torch.Generator().manual_seed(7)
    vocab = 1000
    scaled = torch.cat(
        [
            torch.randn(2, vocab, generator=generator) * 0.05,  # nearly flat
            torch.randn(2, vocab, generator=generator) * 2 - 40,  # all negative
            torch.randint(-3, 3, (2, vocab), generator=generator).float(),  # integer logits: big ties
            torch.randn(2, vocab, generator=generator) * 8,  # peaked, mixed sign
        ]
    )
    positions = scaled.shape[0]
    row_of_position = torch.arange(positions)
    top_p = torch.tensor([0.5, 0.97, 0.3, 0.99, 0.6, 0.95, 0.9, 0.999])
    top_k = torch.tensor([0, 0, 0, 700, 0, 0, 0, 3])
    log_min_p = torch.full((positions,), float("-inf"))
    args = (scaled, row_of_position, top_k, top_p, log_min_p, 1)
    facts = {"filtered": True, "max_top_k": 700, "any_top_p": True}
    twin = distribution_statistics(*args, **facts)
    kernel = distribution_statistics_triton(*args, **facts)
    assert torch.equal(kernel.threshold, twin.threshold)
    kept = (scaled >= twin.threshold.unsqueeze(1)).sum(1)
    assert kept[0] > vocab // 3 and kept[1] > vocab // 2, "the nearly flat rows keep wide nuclei"
