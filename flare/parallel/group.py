"""The torch.distributed groups of a rank: gloo for control, and the device group (gloo on the
CPU, NCCL on CUDA) that the layers' all-reduces and the sampler's gathers use.

Rendezvous is on rank 0's TCPStore: rank 0 listens (``is_master``), the others connect to
``master_addr:master_port``; the same store serves ranks on other hosts. Every collective has
the group's ``timeout``: a rank that stops answering makes the others' collectives raise
instead of hanging, and the caller stops the group (fail-stop, see launch.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class ProcessGroups:
    rank: int
    world_size: int
    control: dist.ProcessGroup
    """gloo: plans, commands, start and stop."""
    device: dist.ProcessGroup
    """The tensors' backend: gloo on the CPU, NCCL on CUDA."""
    store: dist.TCPStore | None
    """Kept alive here: on rank 0 it is the listening rendezvous socket (None once closed)."""

    def close(self) -> None:
        """Leave the groups (the sockets close; rank 0's store stops listening when dropped)."""
        if dist.is_initialized():
            dist.destroy_process_group()
        self.store = None


def device_backend(device: torch.device) -> str:
    """NCCL for CUDA tensors, gloo for CPU tensors (gloo's all-reduce on the CPU is its ring)."""
    return "nccl" if device.type == "cuda" else "gloo"


def rendezvous_store(rank: int, world_size: int, host: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """Rank 0 creates the store (port 0: a free one, read back from ``store.port``); the others
    connect to it, waiting up to ``timeout``."""
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_master=rank == 0,
        timeout=timeout,
        wait_for_workers=False,
    )


def join_groups(
    rank: int,
    world_size: int,
    store: dist.TCPStore,
    device: torch.device,
    timeout: timedelta,
) -> ProcessGroups:
    """Join the default (control, gloo) group and create the device group on every rank."""
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    control = dist.group.WORLD
    assert control is not None
    backend = device_backend(device)
    device_group = control if backend == "gloo" else dist.new_group(backend=backend, timeout=timeout)
    return ProcessGroups(rank=rank, world_size=world_size, control=control, device=device_group, store=store)


def all_reduce_sum(tensor: torch.Tensor) -> None:
    """Sum ``tensor`` over the ranks in place, on the default group: what a rank's model calls
    after its row-split layers (gloo on the CPU; a CUDA model would pass its NCCL device group's
    all-reduce instead)."""
    dist.all_reduce(tensor)
