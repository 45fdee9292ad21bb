"""The counter-based random stream: every random number is a pure function of its key.

A stream key is derived from (seed, output position, purpose); the number at vocabulary index i
of that stream is ``mix32(key + i * GOLDEN)`` (splitmix32: a Weyl sequence finalised by the
lowbias32 mixer of Chris Wellons, "Hash Prospector"). Nothing depends on which other rows share
the batch, on the batch order or on the device, so a seeded request gets the same tokens alone
or inside any batch, and the Triton kernels reproduce the torch twin bit for bit (same 32-bit
integer arithmetic; see random_stream_triton.py).

torch has no unsigned 32-bit arithmetic on CPU, so values live in int32 tensors and the
arithmetic wraps modulo 2**32 (two's complement); logical right shifts are arithmetic shifts
masked to the kept bits.
"""

from __future__ import annotations

from enum import IntEnum

import torch

from flare.sampler import native_sampler as native

GOLDEN = 0x9E3779B9
MIX_MULTIPLIER_1 = 0x7FEB352D
MIX_MULTIPLIER_2 = 0x846CA68B
UNIFORM_BITS = 24
"""The top 24 bits of a hash make a float32 uniform exactly (float32 has a 24-bit significand)."""


class Purpose(IntEnum):
    """What a stream is used for: distinct purposes give independent streams at one position."""

    ACCEPT = 1
    SAMPLE = 2
    DRAFT = 3  # a learned draft head's proposal (drafters/mtp.py): independent of verification


def as_int32(value: int) -> int:
    """The int32 (two's complement) value with the bits of the unsigned 32-bit ``value``."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int32 tensors (wrapping arithmetic, logical shifts); ``x`` is not modified."""
    return _mix32_(x.clone())


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 in place, with one scratch tensor for the shifts.

    This runs over [rows, vocab] on the CPU, where every fresh large temporary costs page
    faults (a few ms each on a loaded machine): in-place steps keep it at two allocations.
    """
    shifted = torch.empty_like(x)
    x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=shifted).bitwise_and_(0xFFFF))
    x.mul_(as_int32(MIX_MULTIPLIER_1))
    x.bitwise_xor_(torch.bitwise_right_shift(x, 15, out=shifted).bitwise_and_(0x1FFFF))
    x.mul_(as_int32(MIX_MULTIPLIER_2))
    return x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=shifted).bitwise_and_(0xFFFF))


def _low32(x: torch.Tensor) -> torch.Tensor:
    """The low 32 bits of an int64 tensor as int32 (explicit, not relying on a narrowing cast)."""
    low = x & 0xFFFFFFFF
    return (low - ((low >> 31) << 32)).to(torch.int32)


def stream_key(seed: torch.Tensor, position: torch.Tensor, purpose: Purpose) -> torch.Tensor:
    """The int32 key of the stream at (seed, output position, purpose); int64 inputs, broadcast."""
    key = mix32(_low32(seed))
    key = mix32(key ^ _low32(seed >> 32))
    key = mix32(key ^ _low32(position))
    return mix32(key ^ as_int32(int(purpose)))


def stream_bits(key: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The 32 random bits (int32) at ``index`` (int32) of the streams ``key`` (int32), broadcast."""
    return _mix32_(key + index * as_int32(GOLDEN))


def uniform(bits: torch.Tensor) -> torch.Tensor:
    """A float32 uniform in [0, 1) from the top 24 bits: k / 2**24."""
    return ((bits >> 8) & 0xFFFFFF).to(torch.float32) * (1.0 / (1 << UNIFORM_BITS))


SMALLEST_NEG_LOG_U = 2.0**-25
"""-log(u) at the largest u, 1 - 2**-25: u itself rounds to 1.0 in float32 (k + 0.5 = 2**24 - 0.5
has no float32 form), where -log(u) would be 0 and the noise +inf, a token drawn whatever its
probability (or NaN against a mask's -inf). -log(u) is held at this value instead, its exact
value to float32 precision; no other k is affected (their -log(u) are all larger)."""


def gumbel(bits: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise -log(-log(u)) with u = (k + 0.5) / 2**24 strictly inside (0, 1)."""
    return gumbel_(bits.clone())


def gumbel_(bits: torch.Tensor) -> torch.Tensor:
    """``gumbel`` computed in the memory of ``bits`` (contiguous int32, consumed): the returned
    float32 tensor is a view of it, so the noise costs no [rows, vocab] allocation."""
    k = bits.bitwise_right_shift_(8).bitwise_and_(0xFFFFFF)
    u = k.view(torch.float32)
    # An elementwise int -> float conversion onto the same memory (full overlap is allowed).
    u.copy_(k)
    return _gumbel_of_uniform_(u.add_(0.5).mul_(1.0 / (1 << UNIFORM_BITS)))


def _gumbel_of_uniform_(u: torch.Tensor) -> torch.Tensor:
    """-log(-log(u)) in place, -log(u) held at SMALLEST_NEG_LOG_U."""
    return u.log_().neg_().clamp_min_(SMALLEST_NEG_LOG_U).log_().neg_()


def vocabulary_gumbel(key: torch.Tensor, vocab_size: int, first_index: int = 0) -> torch.Tensor:
    """``gumbel`` at vocabulary indices ``first_index .. first_index + vocab_size - 1`` of the
    streams ``key`` [R] (int32): [R, vocab_size] (a rank's vocabulary shard starts past 0).

    On the CPU the stream's uniforms of a whole vocabulary come from the C kernel where it was
    built (`native.stream_uniforms`: the same bits in one pass instead of ten); the logarithms are torch's either way, so the
    noise is the same bits on both paths."""
    if key.device.type == "cpu" and native.available() and first_index == 0:
        return _gumbel_of_uniform_(native.stream_uniforms(key.to(torch.int32).contiguous(), vocab_size))
    index = torch.arange(first_index, first_index + vocab_size, dtype=torch.int32, device=key.device)
    return gumbel_(stream_bits(key.to(torch.int32).unsqueeze(1), index))
