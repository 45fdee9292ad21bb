"""The Triton kernels, under the names sample_round calls (torch_backend.py holds the twins).

Imported only when the Triton backend is chosen: importing it imports triton.
"""

from flare.sampler.triton.distribution import distribution_statistics
from flare.sampler.triton.gumbel_max import gumbel_candidates
from flare.sampler.triton.penalties import penalize_and_scale
from flare.sampler.triton.top_tokens import shard_top_tokens

__all__ = ["distribution_statistics", "gumbel_candidates", "penalize_and_scale", "shard_top_tokens"]
