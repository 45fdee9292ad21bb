"""Gumbel-max sampling candidates per vocabulary shard (torch twin of gumbel_max_triton.py).

Gumbel-max: with G_i i.i.d. standard Gumbel, argmax_i (log p_i + G_i) is distributed as p, and
log p_i may be shifted by any per-row constant, so the scaled logit stands in for log p_i. The
argmax of a union of shards is the best of the shard argmaxes, so shards sample exactly without
a full-vocabulary row: each shard reports its candidate and its value, and the merge keeps the
largest (lowest index on ties). The noise of token i comes from the counter-based stream at
vocabulary index i, so sharded and unsharded sampling draw the same token.

Two targets per row:
- the target distribution p (kept tokens, optionally without one ``exclude`` token: with a
  one-hot draft q = e_x, the residual normalize(max(p - q, 0)) is p restricted to tokens != x);
- with a general draft distribution q, the residual r = max(p - q, 0) with p_i = exp(logit_i - m) / Z
  (Leviathan et al. 2023, Chen et al. 2023), whose candidate value is log r_i + G_i, and the
  residual mass sum_i r_i (when it is 0 in floating point, the caller samples from p).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flare.sampler import native_sampler as native
from flare.sampler.distribution import shard_bounds
from flare.sampler.random_stream import vocabulary_gumbel


@dataclass(frozen=True)
class GumbelCandidates:
    index: torch.Tensor
    """[R, S] int64: per shard, the token of largest logit + Gumbel among kept tokens."""
    value: torch.Tensor
    """[R, S] float32: its value (-inf when the shard keeps no token)."""
    residual_index: torch.Tensor | None
    """[R, S] int64: the same for the residual max(p - q, 0); None without q."""
    residual_value: torch.Tensor | None
    residual_mass: torch.Tensor | None
    """[R, S] float32: sum over the shard of max(p - q, 0)."""


def gumbel_candidates(
    scaled: torch.Tensor,
    position: torch.Tensor,
    key: torch.Tensor,
    row_max: torch.Tensor,
    sumexp: torch.Tensor,
    threshold: torch.Tensor,
    exclude: torch.Tensor,
    draft_q: torch.Tensor | None,
    num_shards: int,
    first_index: int = 0,
) -> GumbelCandidates:
    """Candidates of R rows: row r samples position ``position[r]`` of ``scaled`` [N, V] with the
    random stream ``key[r]`` (int32), kept set ``logit >= threshold[r]``, target
    p_i = exp(logit_i - row_max[r]) / sumexp[r] on kept tokens, ``exclude[r]`` a token left out
    of p (-1: none) and ``draft_q`` [R, V] the draft distribution (None: no residual).
    ``first_index`` is the vocabulary index of column 0 of ``scaled`` (a rank holding one
    vocabulary shard: flare/parallel/vocab_round.py): the noise is the stream's at the
    vocabulary index and the candidates' indices are vocabulary indices; ``exclude`` counts
    columns."""
    vocab_size = scaled.shape[1]
    noise = vocabulary_gumbel(key, vocab_size, first_index)
    if draft_q is None and num_shards == 1 and scaled.device.type == "cpu" and native.available():
        # The C kernel where it was built (`native.kept_gumbel_argmax`): the same index and value
        # in one pass over each row's logits where they lie.
        index, value = native.kept_gumbel_argmax(
            noise, scaled.float().contiguous(), position.long().contiguous(), threshold.float().contiguous(), exclude.long().contiguous()
        )
        return GumbelCandidates((index + first_index).unsqueeze(1), value.unsqueeze(1), None, None, None)
    logits = scaled.index_select(0, position)
    kept = logits >= threshold.unsqueeze(1)
    # In place where the noise is not needed again (no residual); NaN logits are not kept.
    value = noise.add_(logits) if draft_q is None else noise + logits
    value.masked_fill_(~kept, float("-inf"))
    # The excluded token, one per row: a scatter of [R, 1] instead of an [R, V] comparison.
    excluded = exclude.clamp(min=0).unsqueeze(1)
    value.scatter_(1, excluded, torch.where(exclude.unsqueeze(1) >= 0, float("-inf"), value.gather(1, excluded)))
    candidate_index, candidate_value = _shard_argmax(value, num_shards)
    candidate_index += first_index
    if draft_q is None:
        return GumbelCandidates(candidate_index, candidate_value, None, None, None)
    p = torch.where(kept, torch.exp(logits - row_max.unsqueeze(1)), 0.0) / sumexp.unsqueeze(1)
    residual = torch.clamp_min(p - draft_q, 0.0)
    # log only where r > 0: ATen's log of 0 takes a slow path, and most of a residual is 0.
    positive = residual > 0
    residual_value = torch.where(positive, torch.where(positive, residual, 1.0).log_() + noise, float("-inf"))
    residual_index, residual_best = _shard_argmax(residual_value, num_shards)
    residual_index += first_index
    mass = torch.stack([residual[:, a:b].sum(-1) for a, b in shard_bounds(vocab_size, num_shards)], 1)
    return GumbelCandidates(candidate_index, candidate_value, residual_index, residual_best, mass)


def _shard_argmax(value: torch.Tensor, num_shards: int) -> tuple[torch.Tensor, torch.Tensor]:
    indices, values = [], []
    for start, end in shard_bounds(value.shape[1], num_shards):
        best = value[:, start:end].argmax(dim=-1, keepdim=True)
        indices.append(best + start)
        values.append(value[:, start:end].gather(1, best))
    return torch.cat(indices, 1), torch.cat(values, 1)
