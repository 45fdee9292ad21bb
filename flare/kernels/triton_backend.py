"""The Triton kernels, under the names sample_round calls (torch_backend.py holds the twins).

Imported only when the Triton backend is chosen: importing it imports triton.
"""

from flare.kernels.distribution_triton import distribution_statistics
from flare.kernels.gumbel_max_triton import gumbel_candidates
from flare.kernels.penalties_triton import penalize_and_scale
from flare.kernels.top_tokens_triton import shard_top_tokens

__all__ = ["distribution_statistics", "gumbel_candidates", "penalize_and_scale", "shard_top_tokens"]
