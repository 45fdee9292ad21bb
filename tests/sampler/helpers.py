"""Shared test helpers: building rounds and comparing empirical frequencies to a distribution."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from scipy.stats import chisquare

from flare.sampler.batch import SamplingBatch
from flare.policy.params import SamplingParams


def make_batch(
    params: Sequence[SamplingParams],
    seeds: Sequence[int] | None = None,
    positions: Sequence[int] | None = None,
    prompt_ids: Sequence[Sequence[int]] | None = None,
    output_ids: Sequence[Sequence[int]] | None = None,
) -> SamplingBatch:
    rows = len(params)
    return SamplingBatch.from_rows(
        params,
        seeds=list(seeds) if seeds is not None else list(range(rows)),
        positions=list(positions) if positions is not None else [0] * rows,
        prompt_ids=prompt_ids if prompt_ids is not None else [[]] * rows,
        output_ids=output_ids if output_ids is not None else [[]] * rows,
        device="cpu",
    )


def no_drafts(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(rows, dtype=torch.int64), torch.full((rows, 0), -1, dtype=torch.int64)


def assert_matches_distribution(samples: np.ndarray, expected: np.ndarray, alpha: float = 1e-3) -> None:
    """Chi-square goodness of fit; bins expected below 5 draws are pooled into one bin.

    The kernels' randomness is a pure function of the seeds, so each test is deterministic:
    alpha only bounds the chance that a correct sampler fails a freshly chosen seed set.
    """
    samples = np.asarray(samples).reshape(-1)
    n = samples.shape[0]
    observed = np.bincount(samples, minlength=expected.shape[0]).astype(np.float64)
    assert observed.shape[0] == expected.shape[0], "sampled a token outside the vocabulary"
    assert observed[expected == 0].sum() == 0, f"sampled tokens of probability 0: {np.nonzero(observed * (expected == 0))[0]}"
    expected_counts = expected * n
    big = expected_counts >= 5
    obs = list(observed[big])
    exp = list(expected_counts[big])
    if (~big & (expected > 0)).any():
        obs.append(observed[~big].sum())
        exp.append(expected_counts[~big].sum())
    if len(obs) < 2:
        return
    result = chisquare(np.asarray(obs), np.asarray(exp) * (sum(obs) / sum(exp)))
    assert result.pvalue > alpha, f"chi-square p={result.pvalue:.2e}: observed {obs} expected {np.round(exp, 1)}"


def dirichlet(concentration: float, vocab: int, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random draft distributions [*shape, vocab], reproducible (torch.distributions draws from
    the global generator, so fork it and seed the fork)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.distributions.Dirichlet(torch.full((vocab,), concentration)).sample(shape)
