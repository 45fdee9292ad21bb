"""An independent, plain-numpy statement of the target distribution, for the statistical tests.

Written from the definitions in docs/kernels.md (sort-based filters, float64), not from the
kernels' code, so the tests check the semantics and not just self-consistency.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from flare.policy.params import SamplingParams


def target_distribution(
    logits: Sequence[float],
    params: SamplingParams,
    prompt_ids: Sequence[int] = (),
    output_ids: Sequence[int] = (),
) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64).copy()
    vocab = x.shape[0]
    counts = np.bincount(np.asarray(list(output_ids), dtype=np.int64), minlength=vocab)[:vocab]
    seen = counts > 0
    seen[list(prompt_ids)] = True
    rp = params.repetition_penalty
    x = np.where(seen, np.where(x > 0, x / rp, x * rp), x)
    x = x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
    if params.temperature == 0.0:
        p = np.zeros(vocab)
        p[int(np.argmax(x))] = 1.0
        return p
    x = x / params.temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    keep = np.ones(vocab, dtype=bool)
    if params.top_k > 0:
        kth = np.sort(p)[::-1][min(params.top_k, vocab) - 1]
        keep &= p >= kth
    if params.top_p < 1.0:
        truncated = np.where(keep, p, 0.0)
        truncated /= truncated.sum()
        order = np.argsort(-truncated, kind="stable")
        cumulative = np.cumsum(truncated[order])
        last = int(np.searchsorted(cumulative, params.top_p - 1e-12))
        keep &= truncated >= truncated[order[min(last, vocab - 1)]]
    if params.min_p > 0.0:
        keep &= p >= params.min_p * p.max()
    p = np.where(keep, p, 0.0)
    return p / p.sum()
