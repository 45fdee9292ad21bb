"""The sampler's C kernels (native.stream_uniforms, native.top_p_threshold,
native.kept_gumbel_argmax) give their torch twins' bits, so a round samples the same tokens with
and without them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flare.sampler import native_sampler as native
from flare.sampler import distribution
from flare.sampler.gumbel_max import gumbel_candidates
from flare.sampler.random_stream import Purpose, gumbel_, stream_bits, stream_key, vocabulary_gumbel
from flare.sampler.round import sample_round
from flare.policy.params import SamplingParams

from .helpers import make_batch, no_drafts

built = pytest.mark.skipif(not native.available(), reason="the C kernels were not built")


def test_the_sampler_kernels_are_built() -> None:
    # setup.py builds them wherever a C compiler is present, as on every machine this project
    # runs on; a build failure is not fatal to the install, so it is caught here.
    assert native.available(), "flare/sampler/csrc did not build: is gcc installed?"


def twin_uniforms(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    bits = stream_bits(keys.unsqueeze(1), torch.arange(vocab_size, dtype=torch.int32))
    return bits.bitwise_right_shift(8).bitwise_and_(0xFFFFFF).float().add_(0.5).mul_(2.0**-24)


@built
def test_the_c_stream_uniforms_are_the_twins_bits() -> None:
    keys = torch.tensor([0, 1, -1, -(2**31), 2**31 - 1, 123456789], dtype=torch.int32)
    for vocab_size in (1, 7, 49152):
        assert torch.equal(native.stream_uniforms(keys, vocab_size), twin_uniforms(keys, vocab_size))
    seeded = stream_key(torch.arange(40), torch.arange(40) * 3, Purpose.SAMPLE).to(torch.int32)
    assert torch.equal(native.stream_uniforms(seeded, 1000), twin_uniforms(seeded, 1000))


@built
def test_vocabulary_gumbel_is_the_same_noise_with_and_without_the_c_kernels(monkeypatch) -> None:
    keys = stream_key(torch.arange(5), torch.arange(5), Purpose.SAMPLE).to(torch.int32)
    with_kernels = vocabulary_gumbel(keys, 3000)
    monkeypatch.setattr(native, "available", lambda: False)
    assert torch.equal(with_kernels, vocabulary_gumbel(keys, 3000))
    assert torch.equal(with_kernels, gumbel_(stream_bits(keys.unsqueeze(1), torch.arange(3000, dtype=torch.int32))))


@built
@settings(max_examples=80, deadline=None)
@given(
    rows=st.integers(1, 6),
    vocab_size=st.integers(1, 3000),
    scale=st.floats(0.01, 30.0),
    top_p=st.floats(0.0, 1.0),
    hidden=st.sampled_from(["none", "some -inf", "zero mass", "top-k"]),
    seed=st.integers(0, 2**16),
)
@built
def test_the_c_top_p_threshold_is_the_twins_radix_select(rows, vocab_size, scale, top_p, hidden, seed) -> None:
    generator = torch.Generator().manual_seed(seed)
    scaled = torch.randn(rows, vocab_size, generator=generator) * scale
    if hidden == "some -inf":
        scaled[:, : vocab_size // 2] = float("-inf")
        scaled[:, -1] = 0.0  # every row keeps a finite token
    # Ties: the radix select must land on the same key whichever of equal logits it meets.
    scaled[:, ::5] = scaled[:, :1].clone()
    weights = (scaled - scaled.amax(-1, keepdim=True)).exp()
    if hidden == "zero mass":
        weights[:, ::2] = 0.0
    elif hidden == "top-k":
        weights[scaled < scaled.topk(min(5, vocab_size), -1).values[:, -1:]] = 0.0
    target = top_p * weights.sum(-1)
    twin = distribution.largest_reaching_mass(scaled, weights, target)
    # Bits, not values: a target of 0 (top_p 0, which the sampler refuses as a parameter) runs
    # the select off the top of the keys into a NaN, on both sides.
    assert torch.equal(native.top_p_threshold(scaled, weights, target).view(torch.int32), twin.view(torch.int32))


@built
def test_a_nan_row_gets_the_twins_threshold_and_leaves_the_others_alone() -> None:
    scaled = torch.randn(3, 500, generator=torch.Generator().manual_seed(4))
    scaled[1, 17] = float("nan")
    weights = (scaled - scaled.amax(-1, keepdim=True)).exp()
    target = 0.9 * weights.sum(-1)
    got = native.top_p_threshold(scaled, weights, target)
    twin = distribution.largest_reaching_mass(scaled, weights, target)
    assert torch.equal(got.view(torch.int32), twin.view(torch.int32))
    assert torch.equal(got[[0, 2]], distribution.largest_reaching_mass(scaled[[0, 2]], weights[[0, 2]], target[[0, 2]]))


@built
def test_the_c_top_p_threshold_refuses_what_it_cannot_read() -> None:
    scaled = torch.randn(2, 10)
    with pytest.raises(ValueError, match="top_p_threshold: scaled must be a CPU torch.float32 tensor"):
        native.top_p_threshold(scaled.double(), scaled, torch.ones(2))
    with pytest.raises(ValueError, match="must be contiguous \\[2, 10\\] and target \\[2\\]"):
        native.top_p_threshold(scaled, scaled, torch.ones(3))


@built
def test_a_sampled_round_draws_the_same_tokens_with_and_without_the_c_kernels(monkeypatch) -> None:
    generator = torch.Generator().manual_seed(8)
    rows, vocab_size = 12, 5000
    logits = torch.randn(rows, vocab_size, generator=generator) * 4
    params = [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.0), SamplingParams(temperature=1.3, top_p=0.5, top_k=40)]
    batch = make_batch([params[r % 3] for r in range(rows)], seeds=list(range(100, 100 + rows)))
    num_drafts, drafts = no_drafts(rows)
    with_kernels = sample_round(logits, num_drafts, drafts, None, batch)
    monkeypatch.setattr(native, "available", lambda: False)
    without = sample_round(logits, num_drafts, drafts, None, batch)
    assert torch.equal(with_kernels.tokens, without.tokens) and torch.equal(with_kernels.status, without.status)


def twin_kept_argmax(noise, scaled, position, threshold, exclude) -> tuple[torch.Tensor, torch.Tensor]:
    """gumbel_max.py's steps for one shard without a draft distribution, on any noise."""
    logits = scaled.index_select(0, position)
    value = (noise + logits).masked_fill_(~(logits >= threshold.unsqueeze(1)), float("-inf"))
    excluded = exclude.clamp(min=0).unsqueeze(1)
    value.scatter_(1, excluded, torch.where(exclude.unsqueeze(1) >= 0, float("-inf"), value.gather(1, excluded)))
    best = value.argmax(dim=-1, keepdim=True)
    return best.squeeze(1), value.gather(1, best).squeeze(1)


@built
@settings(max_examples=80, deadline=None)
@given(
    rows=st.integers(1, 6),
    vocab_size=st.integers(1, 3000),
    levels=st.sampled_from([None, 3, 1]),  # None: continuous values; else few distinct ones (ties)
    hidden=st.sampled_from(["none", "nan", "-inf", "+inf", "all"]),
    seed=st.integers(0, 2**16),
)
def test_the_c_gumbel_candidate_is_the_twins_argmax_and_value(rows, vocab_size, levels, hidden, seed) -> None:
    generator = torch.Generator().manual_seed(seed)
    positions = rows + 2
    scaled = torch.randn(positions, vocab_size, generator=generator) * 3
    noise = torch.randn(rows, vocab_size, generator=generator)
    if levels is not None:  # equal values everywhere: the first of equal maxima must win
        scaled, noise = scaled.round().clamp(-levels, levels), noise.round().clamp(-levels, levels)
    hide = torch.rand(positions, vocab_size, generator=generator) < 0.3
    if hidden != "none":
        fill = {"nan": float("nan"), "-inf": float("-inf"), "+inf": float("inf"), "all": float("-inf")}[hidden]
        scaled = scaled.masked_fill(torch.ones_like(hide) if hidden == "all" else hide, fill)
    position = torch.randint(0, positions, (rows,), generator=generator)
    threshold = torch.where(torch.rand(rows, generator=generator) < 0.5, float("-inf"), torch.randn(rows, generator=generator))
    exclude = torch.randint(-1, vocab_size, (rows,), generator=generator)
    index, value = native.kept_gumbel_argmax(noise, scaled, position, threshold, exclude)
    twin_index, twin_value = twin_kept_argmax(noise, scaled, position, threshold, exclude)
    assert torch.equal(index, twin_index)
    assert torch.equal(value, twin_value)


@built
def test_gumbel_candidates_are_the_same_with_and_without_the_c_kernel(monkeypatch) -> None:
    generator = torch.Generator().manual_seed(3)
    rows, vocab_size = 9, 4000
    scaled = torch.randn(rows + 3, vocab_size, generator=generator) * 4
    args = (
        torch.randperm(rows + 3, generator=generator)[:rows],
        stream_key(torch.arange(rows), torch.arange(rows), Purpose.SAMPLE).to(torch.int32),
        torch.zeros(rows),
        torch.ones(rows),
        torch.tensor([float("-inf"), 0.5, 1.0, 2.0, float("-inf"), 0.0, 9.0, -1.0, float("inf")]),
        torch.tensor([-1, 3, 17, -1, 0, 3999, -1, 5, -1]),
        None,
        1,
    )
    calls = []
    kernel = native.kept_gumbel_argmax
    monkeypatch.setattr(native, "kept_gumbel_argmax", lambda *tensors: calls.append(1) or kernel(*tensors))
    with_kernel = gumbel_candidates(scaled, *args, first_index=1000)
    monkeypatch.setattr(native, "available", lambda: False)
    without = gumbel_candidates(scaled, *args, first_index=1000)
    assert calls == [1]  # the kernel drew the first candidates, the twin the second
    assert torch.equal(with_kernel.index, without.index) and torch.equal(with_kernel.value, without.value)
    assert with_kernel.index[8].item() == 1000 and with_kernel.value[8].item() == float("-inf")  # nothing kept


@built
def test_the_c_gumbel_candidate_refuses_what_it_cannot_read() -> None:
    noise, scaled = torch.randn(2, 10), torch.randn(3, 10)
    threshold, exclude = torch.zeros(2), torch.full((2,), -1)
    with pytest.raises(ValueError, match="kept_gumbel_argmax: noise must be a contiguous CPU torch.float32"):
        native.kept_gumbel_argmax(noise.double(), scaled, torch.tensor([0, 1]), threshold, exclude)
    with pytest.raises(ValueError, match="positions must be rows of scaled"):
        native.kept_gumbel_argmax(noise, scaled, torch.tensor([0, 3]), threshold, exclude)
    with pytest.raises(ValueError, match="position, threshold and exclude \\[2\\]"):
        native.kept_gumbel_argmax(noise, scaled, torch.tensor([0, 1, 2]), threshold, exclude)
