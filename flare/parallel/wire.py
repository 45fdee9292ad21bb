"""Moving a few small tensors between ranks in one collective: packed into one float64 buffer.

float64 holds every float32 (NaN, infinities and -0.0 included) and every int64 below 2**53
(token ids, positions, counts) exactly, so one gather or broadcast carries a phase's whole set
of statistics bit for bit, instead of one collective per tensor (each costs a round-trip).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flat float64 tensor of ``tensors`` in order (CPU: gloo's tensors)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat([t.detach().reshape(-1).to(device="cpu", dtype=torch.float64) for t in tensors])


def unpack(buffer: torch.Tensor, like: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """The tensors of shapes and dtypes ``like`` back from a ``pack`` buffer."""
    out, start = [], 0
    for shape, dtype in like:
        size = math.prod(shape)
        out.append(buffer[start : start + size].reshape(shape).to(dtype))
        start += size
    if start != buffer.numel():
        raise ValueError(f"packed buffer holds {buffer.numel()} values, the layout {start}")
    return out


def layout_of(tensors: Sequence[torch.Tensor]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [(tuple(t.shape), t.dtype) for t in tensors]


def gather_to_rank_0(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> list[list[torch.Tensor]] | None:
    """Every rank's ``tensors`` (the same shapes and dtypes on every rank) at rank 0, rank by
    rank; None on the other ranks."""
    buffer = pack(tensors)
    rank = dist.get_rank(group)
    if rank != 0:
        dist.gather(buffer, None, dst=0, group=group)
        return None
    parts = [torch.empty_like(buffer) for _ in range(dist.get_world_size(group))]
    dist.gather(buffer, parts, dst=0, group=group)
    like = layout_of(tensors)
    return [unpack(part, like) for part in parts]


def broadcast_from_rank_0(
    tensors: Sequence[torch.Tensor] | None,
    like: Sequence[tuple[tuple[int, ...], torch.dtype]],
    group: dist.ProcessGroup,
) -> list[torch.Tensor]:
    """Rank 0's ``tensors`` on every rank (the others pass None and the expected ``like``)."""
    size = sum(math.prod(shape) for shape, _ in like)
    buffer = pack(tensors) if tensors is not None else torch.empty(size, dtype=torch.float64)
    if buffer.numel() != size:
        raise ValueError(f"broadcast of {buffer.numel()} values, the layout says {size}")
    dist.broadcast(buffer, src=0, group=group)
    return unpack(buffer, like)
