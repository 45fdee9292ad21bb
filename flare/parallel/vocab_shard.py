"""A rank's contiguous vocabulary shard, and the round's inputs seen from it.

Rank r of W holds tokens ``shard_bounds(V, W)[r]`` (the in-process `LocalShards` split, so a
W-rank group and ``LocalShards(W)`` in one process compute the same per-shard statistics). The
round's small inputs (draft ids, penalty ids, logit_bias ids, the grammar's bitmask) reach every
rank whole, as rank 0 broadcasts them; each rank maps them onto its own columns here, so the
existing kernels run unchanged on a [N, width] slice of the logits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flare.sampler.batch import SamplingBatch
from flare.sampler.distribution import shard_bounds


@dataclass(frozen=True)
class VocabShard:
    rank: int
    world_size: int
    vocab_size: int
    start: int
    end: int
    group: dist.ProcessGroup
    """The device group the shard's statistics travel over."""

    @property
    def width(self) -> int:
        return self.end - self.start

    @property
    def padded_width(self) -> int:
        """The widest shard's width, ceil(V / W): what a gathered row slice is padded to."""
        return -(-self.vocab_size // self.world_size)

    @classmethod
    def of(cls, vocab_size: int, group: dist.ProcessGroup) -> VocabShard:
        """This rank's shard in ``group``; refused when some rank's shard would be empty."""
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        bounds = shard_bounds(vocab_size, world_size)
        if any(end <= start for start, end in bounds):
            raise ValueError(
                f"a vocabulary of {vocab_size} tokens cannot be split into {world_size} contiguous shards of "
                f"ceil(V / W) = {-(-vocab_size // world_size)} tokens without an empty one"
            )
        start, end = bounds[rank]
        return cls(rank, world_size, vocab_size, start, end, group)


def local_ids(ids: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """Vocabulary ids as this shard's column indices; -1 for ids outside it (and for -1)."""
    inside = (ids >= shard.start) & (ids < shard.end)
    return torch.where(inside, ids - shard.start, -1)


def local_batch(batch: SamplingBatch, shard: VocabShard) -> SamplingBatch:
    """The batch with its penalty and logit_bias ids on this shard's columns: ids elsewhere
    become -1, which the penalty counts and the dense bias already ignore as padding."""
    return dataclasses.replace(
        batch,
        prompt_ids=local_ids(batch.prompt_ids, shard) if batch.prompt_ids is not None else None,
        output_ids=local_ids(batch.output_ids, shard) if batch.output_ids is not None else None,
        bias_ids=local_ids(batch.bias_ids, shard) if batch.bias_ids is not None else None,
    )


def local_token_mask(token_mask: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """This shard's slice of a grammar's [N, ceil(V / 32)] int32 bitmask, realigned so that
    bit i % 32 of word i // 32 is the shard's column i: [N, ceil(width / 32)] int32. A shard
    need not start on a word boundary, so each word is the high bits of one source word and the
    low bits of the next (in int64: torch has no unsigned 32-bit shifts)."""
    first_word, shift = divmod(shard.start, 32)
    words = -(-shard.width // 32)
    source = token_mask[:, first_word : first_word + words + 1].to(torch.int64) & 0xFFFFFFFF
    if source.shape[1] < words + 1:
        source = torch.nn.functional.pad(source, (0, words + 1 - source.shape[1]))
    combined = (source[:, :words] >> shift) | ((source[:, 1:] << (32 - shift)) & 0xFFFFFFFF)
    return (combined - ((combined >> 31) << 32)).to(torch.int32)
