"""The k most likely tokens of every position, per vocabulary shard (torch twin of
top_tokens_triton.py), and their merge.

Order: larger logit first, the lower token id first among equal logits (the order the Triton
kernel's repeated max produces). Per shard the k largest are found; the merge of shards takes
the k first of the S * k candidates in the same order, so a vocabulary-parallel sampler reports
the top tokens from per-shard statistics without gathering a full row. Shards shorter than k are
padded with (-inf, -1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flare.sampler.distribution import shard_bounds


@dataclass(frozen=True)
class TopTokens:
    values: torch.Tensor
    """[N, k] float32: the logits, in the order above (-inf past a position's finite ones)."""
    ids: torch.Tensor
    """[N, k] int64: their token ids (-1 for padding)."""


def shard_top_tokens(scaled: torch.Tensor, k: int, num_shards: int) -> TopTokens:
    """[N, S * k] candidates: each shard's k largest logits of ``scaled`` [N, V], in order."""
    values, ids = [], []
    for start, end in shard_bounds(scaled.shape[1], num_shards):
        width = min(k, end - start)
        top = torch.topk(scaled[:, start:end], width, dim=-1, sorted=True) if width else None
        shard_values = top.values if top is not None else scaled.new_empty(scaled.shape[0], 0)
        shard_ids = top.indices + start if top is not None else torch.empty(scaled.shape[0], 0, dtype=torch.int64)
        ordered = ordered_top(shard_values, shard_ids, width)
        pad = k - width
        values.append(torch.nn.functional.pad(ordered.values, (0, pad), value=float("-inf")))
        ids.append(torch.nn.functional.pad(ordered.ids, (0, pad), value=-1))
    return TopTokens(torch.cat(values, 1), torch.cat(ids, 1))


def ordered_top(values: torch.Tensor, ids: torch.Tensor, k: int) -> TopTokens:
    """The k first of the candidates ``values``/``ids`` [N, C] by (logit descending, id ascending);
    padding (-1) sorts last."""
    # Two stable sorts: by id, then by value; padding's id is moved past every real id first.
    big = torch.iinfo(torch.int64).max
    by_id = torch.where(ids >= 0, ids, big).sort(dim=1, stable=True).indices
    values, ids = values.gather(1, by_id), ids.gather(1, by_id)
    by_value = values.sort(dim=1, descending=True, stable=True).indices[:, :k]
    return TopTokens(values.gather(1, by_value), ids.gather(1, by_value))


def top_tokens(scaled: torch.Tensor, k: int, num_shards: int) -> TopTokens:
    """The k largest logits of every position of ``scaled`` [N, V] and their ids, merged over
    ``num_shards`` shards."""
    candidates = shard_top_tokens(scaled, k, num_shards)
    return ordered_top(candidates.values, candidates.ids, k)
