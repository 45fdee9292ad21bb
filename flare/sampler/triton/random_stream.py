"""The counter-based random stream in Triton: the same 32-bit arithmetic as random_stream.py,
in native uint32 (wrapping multiply, logical shifts), so kernels and twins draw identical bits."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mix32(x):
    """lowbias32 on uint32 values."""
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def stream_bits(key, index):
    """32 random bits at vocabulary ``index`` (int32 block) of stream ``key`` (int32 scalar)."""
    index = index.to(tl.uint32, bitcast=True)
    weyl = key.to(tl.uint32, bitcast=True) + index * tl.full(index.shape, 0x9E3779B9, tl.uint32)
    return mix32(weyl)


@triton.jit
def gumbel(bits):
    """-log(-log(u)) with u = (top 24 bits + 0.5) / 2**24, as random_stream.gumbel."""
    u = (((bits >> 8) & 0xFFFFFF).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    # u rounds to 1.0 for the top k: hold -log(u) at 2**-25 (random_stream.SMALLEST_NEG_LOG_U).
    return -tl.log(tl.maximum(-tl.log(u), 2.9802322387695312e-08))
