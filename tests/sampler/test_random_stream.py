import math

import pytest
import torch
import triton
import triton.language as tl

from flare.sampler.random_stream import Purpose, gumbel, stream_bits, stream_key, uniform
from flare.sampler.triton.random_stream import gumbel as gumbel_triton

MASK = 0xFFFFFFFF


def _mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK
    return x ^ (x >> 16)


def _key(seed: int, position: int, purpose: int) -> int:
    seed &= (1 << 64) - 1
    key = _mix32(seed & MASK)
    key = _mix32(key ^ (seed >> 32))
    key = _mix32(key ^ (position & MASK))
    return _mix32(key ^ purpose)


def test_stream_matches_unsigned_32_bit_reference_arithmetic() -> None:
    seeds = [0, 1, 12345, 2**31 + 7, 2**63 - 1, -1, -(2**40)]
    positions = [0, 1, 5, 1000, 2**31 + 3]
    for seed in seeds:
        for position in positions:
            key = stream_key(torch.tensor([seed]), torch.tensor([position]), Purpose.SAMPLE)
            expected_key = _key(seed, position, int(Purpose.SAMPLE))
            assert int(key.item()) & MASK == expected_key
            index = torch.tensor([0, 1, 2, 40000, 49151], dtype=torch.int32)
            bits = stream_bits(key, index)
            expected = [_mix32((expected_key + int(i) * 0x9E3779B9) & MASK) for i in index]
            assert [int(b) & MASK for b in bits] == expected


def test_uniforms_lie_in_unit_interval_and_gumbel_is_finite() -> None:
    key = stream_key(torch.tensor([3]), torch.tensor([4]), Purpose.ACCEPT)
    bits = stream_bits(key, torch.arange(100000, dtype=torch.int32))
    u = uniform(bits)
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01
    g = gumbel(bits)
    assert torch.isfinite(g).all()
    assert abs(float(g.mean()) - 0.5772) < 0.02  # Euler-Mascheroni constant


def test_purposes_and_positions_give_different_streams() -> None:
    seed, position = torch.tensor([9]), torch.tensor([2])
    keys = {
        int(stream_key(seed, position, Purpose.ACCEPT)),
        int(stream_key(seed, position, Purpose.SAMPLE)),
        int(stream_key(seed, position + 1, Purpose.SAMPLE)),
        int(stream_key(seed + 1, position, Purpose.SAMPLE)),
    }
    assert len(keys) == 4


@triton.jit
def _noise(bits_ptr, out_ptr, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(out_ptr + offsets, gumbel_triton(tl.load(bits_ptr + offsets).to(tl.uint32, bitcast=True)))


def test_gumbel_noise_is_finite_at_the_largest_uniform() -> None:
    """k = 2**24 - 1 gives u = 1 - 2**-25, which rounds to 1.0 in float32: the noise must stay
    finite there (+inf would draw that token whatever its probability, NaN against a mask's
    -inf), in the twin and in the Triton kernel alike."""
    bits = torch.tensor([-1, -512, 0, 12345 << 8], dtype=torch.int32)  # k = 2**24 - 1, 2**24 - 2, 0, 12345
    noise = gumbel(bits)
    assert torch.isfinite(noise).all()
    assert float(noise[0]) == pytest.approx(-math.log(2.0**-25), rel=1e-6)
    assert float(noise[0]) > float(noise[1])
    kernel = torch.empty(4)
    _noise[(1,)](bits, kernel, N=4)
    torch.testing.assert_close(kernel, noise)
