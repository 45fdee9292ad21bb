"""A list of tensors (or None) as one uint8 tensor, and back: the wire form of a round's command.

gloo moves tensors, not Python objects, and pickling a plan each round would run arbitrary
code on the receiver and cost more than the tensors themselves. The header is int64 words: the
number of entries, then per entry its dtype code (-1: None), its rank and its sizes; the data
follow, entry after entry, as raw bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

DTYPES = (torch.int64, torch.int32, torch.float32, torch.float64, torch.bool, torch.uint8, torch.int16, torch.bfloat16, torch.float16)
"""The dtypes a command may carry, by code (the index): extend at the end, never reorder."""


def encode(tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
    header: list[int] = [len(tensors)]
    payload: list[torch.Tensor] = []
    for tensor in tensors:
        if tensor is None:
            header.append(-1)
            continue
        if tensor.dtype not in DTYPES:
            raise ValueError(f"tensor_codec: dtype {tensor.dtype} cannot be sent (one of {DTYPES})")
        header += [DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
        payload.append(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8))
    head = torch.tensor([len(header), *header], dtype=torch.int64).view(torch.uint8)
    return torch.cat([head, *payload])


def decode(buffer: torch.Tensor) -> list[torch.Tensor | None]:
    """The tensors of an ``encode`` buffer (copies: the buffer may be reused)."""
    words = int(buffer[:8].view(torch.int64)[0])
    header = buffer[8 : 8 * (words + 1)].view(torch.int64).tolist()
    count, cursor, offset = header[0], 1, 8 * (words + 1)
    out: list[torch.Tensor | None] = []
    for _ in range(count):
        code = header[cursor]
        cursor += 1
        if code < 0:
            out.append(None)
            continue
        ndim = header[cursor]
        shape = header[cursor + 1 : cursor + 1 + ndim]
        cursor += 1 + ndim
        dtype = DTYPES[code]
        size = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        out.append(buffer[offset : offset + size].clone().view(dtype).reshape(shape))
        offset += size
    if offset != buffer.numel():
        raise ValueError(f"tensor_codec: {buffer.numel() - offset} bytes left after the last tensor")
    return out
