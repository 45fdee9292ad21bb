"""Sampling and speculative verification kernels: Triton on CUDA, torch twins everywhere.

The scheduler calls ``sample_round`` with a ``SamplingBatch``; see docs/kernels.md.
Importing this package never imports Triton.
"""

from flare.kernels.batch import BatchFacts, SamplingBatch
from flare.kernels.round import RoundResult, sample_round, score_tokens
from flare.kernels.status import DeviceStatus

__all__ = ["BatchFacts", "DeviceStatus", "RoundResult", "SamplingBatch", "sample_round", "score_tokens"]
