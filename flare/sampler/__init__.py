"""Sampling and speculative verification kernels: Triton on CUDA, torch twins everywhere.

The scheduler calls ``sample_round`` with a ``SamplingBatch``; see docs/kernels.md.
Importing this package never imports Triton.
"""

from flare.sampler.batch import BatchFacts, SamplingBatch
from flare.sampler.round import SampledRound, sample_round, score_tokens
from flare.sampler.shards import LocalShards, ShardReduction
from flare.sampler.status import DeviceStatus

__all__ = [
    "BatchFacts",
    "DeviceStatus",
    "LocalShards",
    "SampledRound",
    "SamplingBatch",
    "ShardReduction",
    "sample_round",
    "score_tokens",
]
