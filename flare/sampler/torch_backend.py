"""The torch twins, under the names sample_round calls (triton/backend.py names the Triton set)."""

from flare.sampler.distribution import distribution_statistics
from flare.sampler.gumbel_max import gumbel_candidates
from flare.sampler.penalties import penalize_and_scale
from flare.sampler.top_tokens import shard_top_tokens

__all__ = ["distribution_statistics", "gumbel_candidates", "penalize_and_scale", "shard_top_tokens"]
