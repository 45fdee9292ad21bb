"""A round's sampling with the vocabulary split across ranks: the reduction `ShardsAcrossRanks`
that the sampler's one conductor (flare/sampler/round.py, `sample_round` and `score_tokens`)
runs with, and `gather_rows` for the rows that need whole logits.

Each rank holds the logits of its vocabulary shard (vocab_shard.py) and runs the torch kernels
on that slice, with the round's penalty, logit_bias and grammar inputs mapped onto its columns.
Rank 0 is the decider: it gathers every rank's per-shard statistics and makes every decision
with the same code as one process holding ``LocalShards(W)``, so a W-rank group emits exactly
the tokens, counts, statuses and log-probabilities of ``LocalShards(W)``:

1. every rank: per position its shard's max, sum of exp(logit - max), argmax, whether its raw
   logits hold a non-finite value; per draft the draft's logit and q when the draft is in the
   shard (-inf elsewhere: the max over ranks is the owner's value); with logprobs, its top-k.
   Rank 0 gathers them and decides acceptance, the sampled position and the greedy tokens;
2. with sampled rows: rank 0 broadcasts the accepted counts and the merged max and sum; every
   rank draws its Gumbel-max candidates (the noise of token i is the stream's at vocabulary
   index i, whichever rank holds it) and the residual's when q is general; rank 0 gathers them
   and picks the token;
3. with logprobs: rank 0 broadcasts the emitted tokens; each rank reports their logits where it
   holds them, and rank 0 computes the log-probabilities.

Decisions come only from gathered values: no rank assumes another computed the same thing.
Rows with a filter (top-k, top-p < 1, min-p > 0) get INVALID_SPECULATION as with in-process
shards; their fallback samples rank 0's copy of their first position (``gather_rows``) with the
single-shard sampler, which supports filters. Every rank runs the conductor with the same small
inputs (broadcast with the round's plan) and its own slice of the logits; the others get None.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from flare.sampler import torch_backend
from flare.sampler.batch import SamplingBatch
from flare.sampler.distribution import DistributionStatistics
from flare.sampler.round_inputs import RowFilters
from flare.sampler.shards import Layout
from flare.parallel.vocab_shard import VocabShard, local_batch, local_ids, local_token_mask
from flare.parallel.wire import broadcast_from_rank_0, gather_to_rank_0


@dataclass(frozen=True)
class ShardsAcrossRanks:
    """A `ShardReduction`: this rank holds ``shard`` of the vocabulary; statistics are gathered to
    rank 0 and its choices broadcast over the shard's group."""

    shard: VocabShard

    held_shards = 1
    applies_filters = False
    whole_vocabulary = False

    @property
    def num_shards(self) -> int:
        return self.shard.world_size

    @property
    def first_index(self) -> int:
        return self.shard.start

    def vocab_size(self, width: int) -> int:
        if width != self.shard.width:
            raise ValueError(f"sample_round: rank {self.shard.rank} holds {self.shard.width} tokens, the logits {width}")
        return self.shard.vocab_size

    def kernels(self, device: torch.device) -> ModuleType:
        return torch_backend

    def own_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return local_ids(ids, self.shard)

    def own_batch(self, batch: SamplingBatch) -> SamplingBatch:
        return local_batch(batch, self.shard)

    def own_token_mask(self, token_mask: torch.Tensor) -> torch.Tensor:
        return local_token_mask(token_mask, self.shard)

    def shard_statistics(
        self,
        kernels: ModuleType,
        values: torch.Tensor,
        row_of_position: torch.Tensor,
        filters: RowFilters,
        need_sumexp: bool,
        need_argmax: bool,
    ) -> DistributionStatistics:
        """The operations of `distribution_statistics` for one of several shards (which apply no
        filter), so the values are the same bits as in-process shards'."""
        shard_max = values.amax(dim=-1)
        sumexp = None
        if need_sumexp:
            # A shard a token mask empties (max -inf) holds no mass, not exp(-inf + inf) = NaN.
            shard_sum = torch.sub(values, shard_max.unsqueeze(1)).exp_().sum(-1)
            sumexp = torch.where(shard_max > float("-inf"), shard_sum, 0.0).unsqueeze(1)
        return DistributionStatistics(
            max=shard_max.unsqueeze(1),
            sumexp=sumexp,
            argmax=(values.argmax(dim=-1) + self.shard.start).unsqueeze(1) if need_argmax else None,
            threshold=torch.full((values.shape[0],), float("-inf"), device=values.device),
        )

    def gather(self, tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
        parts = gather_to_rank_0(tensors, self.shard.group)
        if parts is None:
            return None
        return [torch.cat([part[i] for part in parts], -1) for i in range(len(tensors))]

    def share(self, tensors: list[torch.Tensor] | None, layout: Layout, device: torch.device) -> list[torch.Tensor]:
        return [t.to(device) for t in broadcast_from_rank_0(tensors, layout, self.shard.group)]


def gather_rows(shard: VocabShard, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
    """Rank 0 gets the full [len(positions), V] rows of ``positions`` (the fallback of rows that
    got INVALID_SPECULATION: a few rows, sampled with filters by the single-shard sampler)."""
    rows = logits.index_select(0, positions.to(logits.device)).float()
    padded = torch.nn.functional.pad(rows, (0, shard.padded_width - shard.width), value=float("nan"))
    parts = gather_to_rank_0([padded], shard.group)
    if parts is None:
        return None
    return torch.cat([part[0] for part in parts], 1)[:, : shard.vocab_size]
