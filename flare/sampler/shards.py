"""Where a round's vocabulary shards are held, and how their statistics merge.

The vocabulary is cut into S contiguous shards of ceil(V / S) tokens (`shard_bounds`). Every
step of a round that reads a logit row runs per shard and reports per-shard statistics; the
round's decisions come from their merge, so no step needs a full-vocabulary row:

- max: m = max_s m_s; the argmax is the shard argmax of the largest m_s (lowest shard on ties);
- normalizer (online softmax): Z = sum_s Z_s exp(m_s - m), with Z_s = sum_{i in s} exp(x_i - m_s);
- Gumbel-max: the argmax of a union is the best of the shards' argmaxes (`best_candidate`).

A `ShardReduction` says where the shards are. `LocalShards`: one process holds the whole
vocabulary (as S in-process shards, S = 1 unless a test or a vocabulary-parallel package asks for
more). Across ranks (flare/parallel/vocab_round.py): each rank holds one shard and the
statistics travel to rank 0, the round's only decider. The conductor (round.py) runs the same
code on either: each process computes its shards' contributions on the columns it holds, the
reduction gathers them to the decider, and the decider's choices are shared back.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Literal, Protocol

import torch

from flare.sampler.batch import SamplingBatch
from flare.sampler.distribution import DistributionStatistics
from flare.sampler.round_inputs import RowFilters

Backend = Literal["torch", "triton"]

Layout = list[tuple[tuple[int, ...], torch.dtype]]
"""Shapes and dtypes of shared tensors, as the processes that receive them expect them."""


class ShardReduction(Protocol):
    """The vocabulary shards of a round: which columns this process holds, how its per-shard
    statistics reach the decider, and how the decider's choices come back."""

    num_shards: int
    """S: the shards the statistics come in, over every process."""
    held_shards: int
    """The shards this process holds (its columns, cut by `shard_bounds`)."""
    applies_filters: bool
    """Top-k, top-p and min-p need a whole sorted distribution: only one shard can apply them."""
    whole_vocabulary: bool
    """This process holds every token's logit (the greedy short paths need it)."""
    first_index: int
    """The vocabulary index of this process's column 0."""

    def vocab_size(self, width: int) -> int:
        """V, from the width of this process's logits (ValueError when they do not fit)."""
        ...

    def kernels(self, device: torch.device) -> ModuleType:
        """The backend (torch_backend or triton.backend) this process runs on its columns."""
        ...

    def own_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary ids as this process's column indices; -1 for ids it does not hold (and -1)."""
        ...

    def own_batch(self, batch: SamplingBatch) -> SamplingBatch:
        """The batch with its penalty and logit_bias ids on this process's columns."""
        ...

    def own_token_mask(self, token_mask: torch.Tensor) -> torch.Tensor:
        """This process's columns of a grammar's [N, ceil(V / 32)] bitmask, realigned to word 0."""
        ...

    def shard_statistics(
        self,
        kernels: ModuleType,
        values: torch.Tensor,
        row_of_position: torch.Tensor,
        filters: RowFilters,
        need_sumexp: bool,
        need_argmax: bool,
    ) -> DistributionStatistics:
        """Per position, each held shard's max, kept sum of exp(x - max) and argmax (vocabulary
        index) of ``values`` [N, width]: [N, held shards]; the threshold this process applies."""
        ...

    def gather(self, tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """At the decider: each tensor with every process's concatenated on its last dimension,
        in shard order; None on the other processes."""
        ...

    def share(self, tensors: list[torch.Tensor] | None, layout: Layout, device: torch.device) -> list[torch.Tensor]:
        """The decider's ``tensors`` on every process (the others pass None)."""
        ...


@dataclass(frozen=True)
class LocalShards:
    """One process holds the whole vocabulary, as ``count`` in-process shards (more than one to
    match a vocabulary-parallel group bit for bit); ``backend`` defaults to Triton on CUDA and
    torch elsewhere."""

    count: int = 1
    backend: Backend | None = None

    @property
    def num_shards(self) -> int:
        return self.count

    @property
    def held_shards(self) -> int:
        return self.count

    @property
    def applies_filters(self) -> bool:
        return self.count == 1

    whole_vocabulary = True
    first_index = 0

    def vocab_size(self, width: int) -> int:
        if not 1 <= self.count <= width:
            raise ValueError(f"LocalShards.count must be between 1 and the vocabulary size, got {self.count}")
        return width

    def kernels(self, device: torch.device) -> ModuleType:
        """The kernel functions of the backend; Triton is imported only when asked for."""
        backend = self.backend or ("triton" if device.type == "cuda" else "torch")
        if backend == "torch":
            from flare.sampler import torch_backend

            return torch_backend
        if backend == "triton":
            from flare.sampler.triton import backend as triton_backend

            return triton_backend
        raise ValueError(f"sample_round: backend must be 'torch' or 'triton', got {backend!r}")

    def own_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids

    def own_batch(self, batch: SamplingBatch) -> SamplingBatch:
        return batch

    def own_token_mask(self, token_mask: torch.Tensor) -> torch.Tensor:
        return token_mask

    def shard_statistics(
        self,
        kernels: ModuleType,
        values: torch.Tensor,
        row_of_position: torch.Tensor,
        filters: RowFilters,
        need_sumexp: bool,
        need_argmax: bool,
    ) -> DistributionStatistics:
        return kernels.distribution_statistics(
            values,
            row_of_position,
            filters.top_k,
            filters.top_p,
            filters.log_min_p,
            self.count,
            filtered=filters.filtered,
            max_top_k=filters.max_top_k,
            any_top_p=filters.any_top_p,
            need_sumexp=need_sumexp,
            need_argmax=need_argmax,
        )

    def gather(self, tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
        return tensors

    def share(self, tensors: list[torch.Tensor] | None, layout: Layout, device: torch.device) -> list[torch.Tensor]:
        assert tensors is not None
        return tensors


def merged_argmax(shard_max: torch.Tensor, shard_argmax: torch.Tensor) -> torch.Tensor:
    """[N]: argmax_i x_i from per-shard [N, S] maxima and argmaxes: the argmax of the shard of
    the largest max (the lowest index on ties: shards are in vocabulary order)."""
    return shard_argmax.gather(1, shard_max.argmax(1, keepdim=True)).squeeze(1)


def merged_sumexp(shard_max: torch.Tensor, shard_sumexp: torch.Tensor) -> torch.Tensor:
    """[N]: Z = sum_i exp(x_i - m) with m = max_s m_s, from per-shard [N, S] maxima m_s and sums
    Z_s = sum_{i in s} exp(x_i - m_s): Z = sum_s Z_s exp(m_s - m) (online softmax)."""
    return (shard_sumexp * torch.exp(shard_max - shard_max.amax(1).unsqueeze(1))).sum(1)


def best_candidate(index: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """[R]: the candidate of the largest value among per-shard [R, S] Gumbel-max candidates (the
    lowest shard on ties): argmax over a union of shards is the best of their argmaxes."""
    return index.gather(1, value.argmax(1, keepdim=True)).squeeze(1)


def held_values(values: torch.Tensor, position: torch.Tensor, own_column: torch.Tensor) -> torch.Tensor:
    """``values`` at (position, column) where this process holds the token (``own_column`` >= 0),
    -inf elsewhere: the max over the processes is the holder's value."""
    return torch.where(own_column >= 0, values[position, own_column.clamp(min=0)], float("-inf"))
