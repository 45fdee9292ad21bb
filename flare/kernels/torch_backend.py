"""The torch twins, under the names sample_round calls (see triton_backend.py for the Triton set)."""

from flare.kernels.distribution import distribution_statistics
from flare.kernels.gumbel_max import gumbel_candidates
from flare.kernels.penalties import penalize_and_scale
from flare.kernels.top_tokens import shard_top_tokens

__all__ = ["distribution_statistics", "gumbel_candidates", "penalize_and_scale", "shard_top_tokens"]
