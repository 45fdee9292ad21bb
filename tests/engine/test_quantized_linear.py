"""Linear layers from ggml blocks: gguf-py's values, the float64 product up to float32 sums, the
same bits at every ISA and batch size, and bad blocks refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import REPOSITORY
from flare.engine import native, quantized
from flare.engine.quantized import QuantizedWeight, dequantize, dequantize_rows, quantized_linear, supported_types

T = gguf.GGMLQuantizationType
SIMPLE = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)  # gguf-py quantizes these
K_TYPES = (T.Q4_K, T.Q5_K, T.Q6_K)  # gguf-py only dequantizes these
MICROSCALED = (T.MXFP4,)  # an E8M0 scale byte: random blocks reach every scale and nibble
ALL = SIMPLE + K_TYPES + MICROSCALED
# Where each type keeps its float16 scales inside a block (d, then dmin / m).
SCALE_OFFSETS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def weight_of(ggml_type: T, out_features: int, in_features: int, seed: int = 0) -> QuantizedWeight:
    """A weight of `ggml_type`: gguf-py's quantization of random values where gguf-py quantizes
    the type; otherwise random blocks (a block's values are whatever its bits say) whose float16
    scales are finite, some of them subnormal."""
    rng = np.random.default_rng(seed)
    if ggml_type in SIMPLE:
        blocks = gguf.quants.quantize(rng.standard_normal((out_features, in_features), dtype=np.float32), ggml_type)
    elif ggml_type in MICROSCALED:
        block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        blocks = rng.integers(0, 256, (out_features * (in_features // block_size), type_size), dtype=np.uint8)
        blocks[:, 0] = rng.integers(110, 135, blocks.shape[0])  # 2^-18 .. 2^6
        blocks[::7, 0] = 1  # 2^-127: the values are float32 subnormals
        blocks[3::11, 0] = 0
        blocks = blocks.reshape(out_features, -1)
    else:
        block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        blocks = rng.integers(0, 256, (out_features * (in_features // block_size), type_size), dtype=np.uint8)
        for offset in SCALE_OFFSETS[ggml_type]:
            scales = (rng.standard_normal(blocks.shape[0], dtype=np.float32) * 0.01).astype(np.float16)
            scales[::7] = np.float16(3e-6)  # float16 subnormals: widened exactly
            blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
        blocks = blocks.reshape(out_features, -1)
    return QuantizedWeight.from_blocks(ggml_type, torch.from_numpy(np.ascontiguousarray(blocks)), out_features, in_features)


def gguf_values(weight: QuantizedWeight) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(weight.data.numpy(), weight.ggml_type))


def float64_product(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    return x.double() @ gguf_values(weight).double().T


def assert_float32_sums_of(got: torch.Tensor, x: torch.Tensor, weight: QuantizedWeight) -> None:
    # A float32 sum of n products is within about sqrt(n) ulps of the products' magnitude.
    exact = float64_product(x, weight)
    scale = (x.double().abs() @ gguf_values(weight).double().abs().T) * 2.0**-24 * weight.in_features**0.5 * 4
    assert ((got.double() - exact).abs() <= scale + 1e-30).all(), (got.double() - exact).abs().max()


@pytest.mark.parametrize("ggml_type", ALL)
def test_each_type_expands_to_gguf_pys_values_and_multiplies_as_the_float64_product(ggml_type: T) -> None:
    in_features = 512 if ggml_type in K_TYPES else 576  # 576: the widths llama.cpp's fallbacks are for
    weight = weight_of(ggml_type, 37, in_features)
    assert torch.equal(dequantize(weight), gguf_values(weight))
    x = torch.randn(5, in_features, generator=torch.Generator().manual_seed(1))
    assert_float32_sums_of(quantized_linear(x, weight), x, weight)


@pytest.mark.parametrize("ggml_type", ALL)
def test_rows_of_a_quantized_embedding_are_gguf_pys_values_at_every_isa(ggml_type: T) -> None:
    weight = weight_of(ggml_type, 50, 256)
    ids = torch.tensor([[7, 0], [49, 7]])
    for isa in (native.ISA_PORTABLE, native.ISA_AVX2, native.ISA_AVX512):
        assert torch.equal(dequantize_rows(weight, ids, isa=isa), gguf_values(weight)[ids])


@settings(max_examples=60, deadline=None)
@given(
    ggml_type=st.sampled_from(ALL),
    out_features=st.integers(1, 70),
    blocks=st.integers(1, 3),
    rows=st.integers(1, 40),
    row_gap=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_any_shape_and_row_count_gives_the_float64_product_and_the_same_bits_at_every_isa(
    ggml_type, out_features, blocks, rows, row_gap, seed
) -> None:
    in_features = blocks * gguf.GGML_QUANT_SIZES[ggml_type][0]
    weight = weight_of(ggml_type, out_features, in_features, seed)
    wide = torch.randn(rows, in_features + row_gap, generator=torch.Generator().manual_seed(seed + 1))
    x = wide[:, :in_features]  # rows further apart than their width
    got = quantized_linear(x, weight)
    assert_float32_sums_of(got, x, weight)
    for isa in (native.ISA_PORTABLE, native.ISA_AVX2):
        assert torch.equal(quantized_linear(x, weight, isa=isa), got), isa


@pytest.mark.parametrize("ggml_type", ALL)
def test_a_rows_result_does_not_depend_on_its_batch_mates(ggml_type: T) -> None:
    in_features = gguf.GGML_QUANT_SIZES[ggml_type][0] * 3
    weight = weight_of(ggml_type, 45, in_features)
    x = torch.randn(40, in_features, generator=torch.Generator().manual_seed(2))
    together = quantized_linear(x, weight)
    for first, count in ((3, 1), (0, 8), (9, 8), (11, 29), (17, 2)):
        assert torch.equal(quantized_linear(x[first : first + count], weight), together[first : first + count])
    alone = quantized_linear(x[5:6], weight)
    assert torch.equal(quantized_linear(x[:8], weight)[5:6], alone)


@pytest.mark.parametrize("ggml_type", ALL)
@pytest.mark.parametrize("rows", [2, 3, 4, 5, 6])
def test_a_few_rows_at_avx2_give_the_portable_loops_bits(ggml_type: T, rows: int) -> None:
    # Whole groups of outputs, where AVX2 multiplies 2-5 rows of the 32-value types straight from
    # their blocks (quantized_direct.c's tiles of 2 outputs, then of 1) and 6 rows through the buffer.
    in_features = gguf.GGML_QUANT_SIZES[ggml_type][0] * (8 if gguf.GGML_QUANT_SIZES[ggml_type][0] == 32 else 2)
    weight = weight_of(ggml_type, 4 * 12, in_features, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    got = quantized_linear(x, weight, isa=native.ISA_AVX2)
    assert_float32_sums_of(got, x, weight)
    assert torch.equal(got, quantized_linear(x, weight, isa=native.ISA_PORTABLE))
    for row in range(rows):  # and a row alone, through the one-row path, gets the same bits
        assert torch.equal(quantized_linear(x[row : row + 1], weight, isa=native.ISA_AVX2), got[row : row + 1])


@pytest.mark.parametrize("ggml_type", ALL)
@pytest.mark.parametrize("rows", [1, 5])
def test_a_last_partial_group_of_outputs_on_a_thread_team_gives_the_float64_product(ggml_type: T, rows: int) -> None:
    # 4k + 3 outputs and enough multiply-adds for a team of threads: the team's last thread ends
    # on a group of 3, which the direct path (1-6 rows) hands to the buffered one.
    in_features = gguf.GGML_QUANT_SIZES[ggml_type][0] * (16 if gguf.GGML_QUANT_SIZES[ggml_type][0] == 32 else 2)
    weight = weight_of(ggml_type, 4 * 40 + 3, in_features, seed=11)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    got = quantized_linear(x, weight)
    assert_float32_sums_of(got, x, weight)
    assert torch.equal(quantized_linear(x, weight, isa=native.ISA_PORTABLE), got)


FORCED_SCRIPT = """
import sys, torch
sys.path.insert(0, {root!r})
from tests.engine.test_quantized_linear import ALL, forced_cases
from flare.engine import quantized
torch.save({{'isa': quantized.QUANTIZED_ISA, 'outputs': forced_cases()}}, {path!r})
"""


def forced_cases() -> list[torch.Tensor]:
    """Each type's product at 1, 2, 3, 5, 8 and 33 rows with the default ISA of the process (inputs
    from numpy: torch's randn draws other values under another ATEN_CPU_CAPABILITY)."""
    outputs = []
    for ggml_type in ALL:
        in_features = gguf.GGML_QUANT_SIZES[ggml_type][0] * 2
        weight = weight_of(ggml_type, 21, in_features, seed=int(ggml_type))
        for rows in (1, 2, 3, 5, 8, 33):
            x = torch.from_numpy(np.random.default_rng(rows).standard_normal((rows, in_features), dtype=np.float32))
            outputs.append(quantized_linear(x, weight))
    return outputs


@pytest.mark.parametrize(("capability", "isa"), [("avx2", native.ISA_AVX2), ("default", native.ISA_PORTABLE)])
def test_forced_avx2_and_forced_portable_dispatch_give_the_same_bits(tmp_path: Path, capability: str, isa: int) -> None:
    # ATEN_CPU_CAPABILITY caps torch's dispatch and, with it, the quantized kernel's ISA: how an
    # AVX2-only CPU and one without AVX2 are stood in for, each in its own process.
    path = tmp_path / "outputs.pt"
    script = FORCED_SCRIPT.format(root=REPOSITORY, path=str(path))
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=300)
    forced = torch.load(path)
    assert forced["isa"] == isa
    for got, expected in zip(forced["outputs"], forced_cases(), strict=True):
        assert torch.equal(got, expected)


def test_a_nan_in_one_rows_input_reaches_that_rows_outputs_only() -> None:
    weight = weight_of(T.Q4_1, 48, 64)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(5))
    x[3, 7] = float("nan")
    y = quantized_linear(x, weight)
    assert y[3].isnan().all()
    assert not y[torch.arange(8) != 3].isnan().any()


def test_without_the_c_kernels_the_product_is_torchs_over_the_same_values(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = weight_of(T.Q6_K, 30, 256)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(6))
    with_kernel = quantized_linear(x, weight)
    monkeypatch.setattr(quantized.native, "available", lambda: False)
    without = quantized_linear(x, weight)
    torch.testing.assert_close(without, with_kernel, atol=1e-5, rtol=1e-5)
    assert torch.equal(dequantize_rows(weight, torch.tensor([3, 1])), gguf_values(weight)[[3, 1]])


def test_blocks_of_the_wrong_length_or_an_unknown_type_are_refused() -> None:
    good = weight_of(T.Q8_0, 4, 64)
    with pytest.raises(ValueError, match=r"Q8_0 blocks of a \[4, 64\] weight must be CPU uint8 \[4, 68\]"):
        QuantizedWeight.from_blocks(T.Q8_0, good.data[:, :-1], 4, 64)
    with pytest.raises(ValueError, match=r"must be CPU uint8 \[4, 68\], got cpu torch.float32"):
        QuantizedWeight.from_blocks(T.Q8_0, good.data.float(), 4, 64)
    with pytest.raises(ValueError, match="unknown ggml type id 99"):
        QuantizedWeight.from_blocks(99, good.data, 4, 64)
    with pytest.raises(ValueError, match="IQ2_XXS is not served from blocks"):
        QuantizedWeight.from_blocks(T.IQ2_XXS, good.data, 4, 64)
    with pytest.raises(ValueError, match="in_features a multiple of 32"):
        QuantizedWeight.from_blocks(T.Q8_0, good.data, 4, 48)
    with pytest.raises(ValueError, match="must be contiguous"):
        QuantizedWeight.from_blocks(T.Q8_0, torch.zeros(4, 136, dtype=torch.uint8)[:, ::2], 4, 64)
    assert T.Q4_K in supported_types() and T.F16 not in supported_types()


@pytest.mark.parametrize("with_kernels", [True, False])
@pytest.mark.parametrize(("ggml_type", "bits"), [(T.Q4_1, 0x7E00), (T.Q6_K, 0x7C00), (T.Q4_K, 0xFC00), (T.Q5_1, 0x7C00)])
def test_a_nan_or_infinite_scale_is_refused_naming_its_block(
    ggml_type: T, bits: int, with_kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not with_kernels:
        monkeypatch.setattr(quantized.native, "available", lambda: False)
    weight = weight_of(ggml_type, 3, 512)
    data = weight.data.clone()
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    offset = SCALE_OFFSETS[ggml_type][-1] + type_size  # row 0, block 1
    data[0, offset : offset + 2] = torch.tensor([bits & 0xFF, bits >> 8], dtype=torch.uint8)
    with pytest.raises(ValueError, match=f"{ggml_type.name} block 1 of row 0 has a NaN or infinite scale"):
        QuantizedWeight.from_blocks(ggml_type, data, 3, 512)


@pytest.mark.parametrize("with_kernels", [True, False])
def test_an_mxfp4_block_with_the_nan_scale_byte_is_refused_naming_its_block(with_kernels: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not with_kernels:
        monkeypatch.setattr(quantized.native, "available", lambda: False)
    weight = weight_of(T.MXFP4, 3, 128)
    data = weight.data.clone()
    data[2, 17 * 3] = 0xFF  # row 2, block 3: E8M0's NaN
    with pytest.raises(ValueError, match="MXFP4 block 3 of row 2 has a NaN or infinite scale"):
        QuantizedWeight.from_blocks(T.MXFP4, data, 3, 128)
    data[2, 17 * 3] = 0xFE  # 2^126: the largest finite scale is served
    QuantizedWeight.from_blocks(T.MXFP4, data, 3, 128)


def test_mxfp4_values_are_e2m1_times_the_power_of_two_of_the_scale_byte() -> None:
    # One block by hand: scale byte 127 + 3 (gguf-py's half form: 2^(e - 128) times the doubled
    # E2M1 values), nibbles 0-15 low then high.
    block = np.zeros((1, 17), dtype=np.uint8)
    block[0, 0] = 130
    block[0, 1:] = np.arange(16, dtype=np.uint8) | (np.arange(16, dtype=np.uint8)[::-1] << 4)
    weight = QuantizedWeight.from_blocks(T.MXFP4, torch.from_numpy(block), 1, 32)
    e2m1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6]
    expected = torch.tensor(e2m1 + e2m1[::-1]) * 2.0**3
    for isa in (native.ISA_PORTABLE, native.ISA_AVX2, native.ISA_AVX512):
        assert torch.equal(dequantize_rows(weight, torch.tensor([0]), isa=isa)[0], expected)
    assert torch.equal(gguf_values(weight)[0], expected)


def test_inputs_the_kernel_cannot_read_are_refused() -> None:
    weight = weight_of(T.Q8_0, 16, 64)
    for bad in (torch.randn(2, 64, dtype=torch.float64), torch.randn(2, 32), torch.randn(64)):
        with pytest.raises(ValueError, match=r"quantized_linear: x must be a CPU float32 \[rows, 64\]"):
            quantized_linear(bad, weight)
    with pytest.raises(ValueError, match=r"row ids must lie in \[0, 16\)"):
        dequantize_rows(weight, torch.tensor([3, 16]))
    with pytest.raises(ValueError, match="rows must be CPU int64"):
        dequantize_rows(weight, torch.tensor([3], dtype=torch.int32))


def test_gpt_oss_hugging_face_mxfp4_tensors_repack_to_ggml_blocks_of_the_same_values() -> None:
    # transformers' own dequantization of the checkpoint's packed experts is the reference.
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from flare.package.blocks import BlocksError, mxfp4_from_openai

    rng = np.random.default_rng(7)
    experts, rows, groups = 3, 10, 4
    blocks = rng.integers(0, 256, (experts, rows, groups, 16), dtype=np.uint8)
    scales = rng.integers(110, 140, (experts, rows, groups), dtype=np.uint8)
    expected = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    ggml = mxfp4_from_openai(blocks, scales)
    assert ggml.shape == (experts, rows, groups * 17)
    for e in range(experts):
        weight = QuantizedWeight.from_blocks(T.MXFP4, torch.from_numpy(np.ascontiguousarray(ggml[e])), rows, groups * 32)
        assert torch.equal(dequantize(weight), expected[e].T)  # transformers keeps [in, out]
    with pytest.raises(BlocksError, match="MXFP4 blocks must be uint8"):
        mxfp4_from_openai(blocks[..., :8], scales)
