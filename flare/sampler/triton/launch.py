"""Launch choices shared by the Triton kernels."""

from __future__ import annotations

import torch
import triton

GPU_BLOCK = 2048
INTERPRETER_MAX_BLOCK = 65536
FP_FUSION = False
"""No fused multiply-add contraction: the kernels round each operation as the torch twins do
(``x - a * b`` is a multiply then a subtract), so GPU and twin differ at most by the last bits
of exp and log, never by where an FMA was formed. (The interpreter ignores launch options.)"""


def block_size(span: int, device: torch.device) -> int:
    """Elements per loop step over a span of the vocabulary.

    On the GPU a moderate block keeps registers in check. Under TRITON_INTERPRET (CPU tensors)
    the cost grows with the number of tl operations executed, not with elements, so one block
    covers the whole span.
    """
    if device.type == "cuda":
        return min(GPU_BLOCK, triton.next_power_of_2(span))
    return min(INTERPRETER_MAX_BLOCK, triton.next_power_of_2(span))
