"""Where the ranks of a group run: how many, on how many hosts, and where they meet.

Ranks are numbered host by host: host K runs ranks ``K * per_node .. (K + 1) * per_node - 1``.
Rank 0 is the daemon (HTTP, scheduler, its own shard) and owns the rendezvous store; on host 0
it starts ranks 1..per_node-1, and every other host starts all of its ranks headless
(``flare run --tensor-parallel N --nnodes M --node-rank K --master-addr HOST --master-port P``).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MASTER_PORT = 29511
"""The rendezvous port when none is given (torch's own default 29500 is left to other jobs)."""


@dataclass(frozen=True)
class ParallelLayout:
    tensor_parallel: int
    """The number of ranks in the group (every rank holds 1/N of each split layer)."""
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    """The host of rank 0, where the rendezvous store listens (a private network: see
    docs/operations.md)."""
    master_port: int = 0
    """The store's TCP port; 0 lets rank 0's host pick a free one (one host only)."""

    def __post_init__(self) -> None:
        if self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be at least 1, got {self.tensor_parallel}")
        if self.nnodes < 1:
            raise ValueError(f"nnodes must be at least 1, got {self.nnodes}")
        if self.tensor_parallel % self.nnodes:
            raise ValueError(
                f"tensor_parallel ({self.tensor_parallel}) must be a multiple of nnodes ({self.nnodes}): "
                f"every host runs the same number of ranks"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be between 0 and nnodes - 1 ({self.nnodes - 1}), got {self.node_rank}")
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"master_port must be a TCP port (0-65535), got {self.master_port}")
        if self.nnodes > 1 and self.master_port == 0:
            raise ValueError("master_port must be given when nnodes > 1: the other hosts must know where to meet")

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The global ranks that run on this host."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)

    @property
    def spawned_ranks(self) -> range:
        """The ranks this host's launching process starts as workers: all but rank 0 itself."""
        local = self.local_ranks
        return range(max(local.start, 1), local.stop)
