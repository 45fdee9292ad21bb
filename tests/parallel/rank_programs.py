"""Worker programs the parallel tests start in spawned ranks (module level: they are pickled)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from flare.parallel.group import ProcessGroups


def load_rank(rank: int, world_size: int) -> dict[str, int]:
    return {"rank": rank}


def load_failing_on_rank_1(rank: int, world_size: int) -> dict[str, int]:
    if rank == 1:
        raise FileNotFoundError("shard file model-rank1.safetensors is missing")
    return {"rank": rank}


def serve_all_reduce_then_wait(groups: ProcessGroups, state: dict[str, int]) -> None:
    """Add rank + 1 across the group (rank 0 does the same), then wait for rank 0's next
    command, as a serving worker does (the wait fails when rank 0's connection closes)."""
    value = torch.tensor([float(groups.rank + 1)])
    dist.all_reduce(value, group=groups.device)
    command = torch.zeros(1)
    while True:
        dist.broadcast(command, src=0, group=groups.control)


def serve_idle(groups: ProcessGroups, state: dict[str, int]) -> None:
    """Join the group and never take part in a collective (a stuck rank)."""
    while True:
        time.sleep(1)
