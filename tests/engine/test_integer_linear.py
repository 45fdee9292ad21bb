"""Integer dot products of 32-value ggml blocks with 8-bit activation blocks (integer_linear.c), and
a K-type weight's through Q8_K blocks (integer_kquants.c):
the float64 product of the values they stand for, the bits of a scalar reference of the same
arithmetic, the same bits at every level, on their own and in a forced-dispatch subprocess, and
a row's result whatever its batch-mates."""

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
from flare.engine import native, native_quantized, quantized
from flare.engine.linear import linear
from flare.engine.quantized import QuantizedWeight, quantized_linear, served_activations
from flare.package.manifest import INTEGER_FROM_BYTES

pytestmark = pytest.mark.skipif(not native.available(), reason="the engine's C kernels were not built")

T = gguf.GGMLQuantizationType
TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
LEVELS = (
    native_quantized.IDOT_PORTABLE,
    native_quantized.IDOT_AVX2,
    native_quantized.IDOT_AVX_VNNI,
    native_quantized.IDOT_AVX512_VNNI,
    native_quantized.IDOT_AMX,
)
OFFSET = {T.Q4_0: 8, T.Q5_0: 16}


def weight_of(ggml_type: T, out_features: int, in_features: int, seed: int = 0) -> QuantizedWeight:
    values = np.random.default_rng(seed).standard_normal((out_features, in_features), dtype=np.float32)
    blocks = torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(values, ggml_type)))
    return QuantizedWeight.from_blocks(ggml_type, blocks, out_features, in_features)


def activation_blocks(xq: torch.Tensor, halves: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """d, s, sum [rows, blocks, halves] and qs [rows, blocks, halves, 32] of quantize_q8's bytes (Q8Block)."""
    raw = xq.numpy().reshape(xq.shape[0], -1, halves, native_quantized.Q8_BLOCK_BYTES)
    d = raw[..., 0:4].copy().view(np.float32)[..., 0]
    s = raw[..., 4:8].copy().view(np.float32)[..., 0]
    total = raw[..., 8:12].copy().view(np.int32)[..., 0]
    return d, s, total, raw[..., 16:48].view(np.int8)


def activation_values(xq: torch.Tensor, halves: int) -> np.ndarray:
    """The values the activation blocks stand for, float64 [rows, in]: sum over halves of d qs."""
    d, _, _, qs = activation_blocks(xq, halves)
    return (qs * d[..., None].astype(np.float64)).sum(2).reshape(xq.shape[0], -1)


def weight_integers(weight: QuantizedWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each block's integers (q - 8 for Q4_0, q - 16 for Q5_0, q otherwise) [out, blocks, 32], its
    scale and min (0 without one) [out, blocks], from gguf-py's values: value = d q + m."""
    values = gguf.quants.dequantize(weight.data.numpy(), weight.ggml_type).reshape(weight.out_features, -1, 32)
    raw = weight.data.numpy().reshape(weight.out_features, -1, gguf.GGML_QUANT_SIZES[weight.ggml_type][1])
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    has_min = weight.ggml_type in (T.Q4_1, T.Q5_1)
    m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if has_min else np.zeros_like(d)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d[..., None] != 0, np.round((values - m[..., None]) / d[..., None]), 0)
    return q.astype(np.int64), d, m


def scalar_reference(xq: torch.Tensor, halves: int, weight: QuantizedWeight) -> np.ndarray:
    """integer_dot.h's arithmetic as it reads: per (row, output) one float32 chain over the blocks
    in order, acc = fma(isum, dw dx, acc) for each half, then fma(mw, s, acc) (fma's one rounding:
    float64 holds the product exactly; the float32 rounding of its sum with acc is then at most a
    rare double rounding away, which these sizes never meet)."""
    d, s, _, qs = activation_blocks(xq, halves)
    q, dw, mw = weight_integers(weight)
    has_min = weight.ggml_type in (T.Q4_1, T.Q5_1)
    isum = np.einsum("obk,rbhk->robh", q, qs.astype(np.int64))  # exact
    acc = np.zeros((xq.shape[0], weight.out_features), dtype=np.float32)
    for i in range(q.shape[1]):
        for h in range(halves):
            scale = (dw[None, :, i] * d[:, None, i, h]).astype(np.float32)
            acc = (isum[:, :, i, h].astype(np.float64) * scale + acc).astype(np.float32)
        if has_min:
            acc = (mw[None, :, i].astype(np.float64) * s[:, None, i, 0] + acc).astype(np.float32)
    return acc


def products(x: torch.Tensor, weight: QuantizedWeight, halves: int, level: int) -> tuple[torch.Tensor, torch.Tensor]:
    xq = native_quantized.quantize_q8(x, halves)
    return xq, native_quantized.integer_linear(xq, weight.data, weight.ggml_type, weight.out_features, weight.in_features, level)


@pytest.mark.parametrize("halves", [1, 2])
@pytest.mark.parametrize("ggml_type", TYPES)
def test_each_type_is_the_float64_product_of_the_values_it_multiplies_and_the_scalar_references_bits(
    ggml_type: T, halves: int
) -> None:
    weight = weight_of(ggml_type, 37, 576)
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(1))
    for level in LEVELS:
        xq, got = products(x, weight, halves, level)
        exact = activation_values(xq, halves) @ gguf.quants.dequantize(weight.data.numpy(), ggml_type).astype(np.float64).T
        # The blocks' float32 chain: about one rounding of the running sum a block.
        bound = np.abs(activation_values(xq, halves)) @ np.abs(gguf.quants.dequantize(weight.data.numpy(), ggml_type)).T
        assert (np.abs(got.numpy() - exact) <= bound * 2.0**-24 * (576 // 32 + 2) * 2 + 1e-30).all()
        assert np.array_equal(got.numpy(), scalar_reference(xq, halves, weight)), level


def test_the_activation_blocks_are_round_to_nearest_of_x_over_max_127_and_two_halves_keep_its_residual() -> None:
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)) * torch.tensor([1.0, 100.0]).repeat_interleave(32)
    d, s, total, qs = activation_blocks(native_quantized.quantize_q8(x, 1), 1)
    blocks = x.numpy().reshape(3, 2, 32)
    assert np.array_equal(d[..., 0], (np.abs(blocks).max(-1) / np.float32(127)).astype(np.float32))
    assert np.array_equal(qs[:, :, 0], np.rint(blocks * (np.float32(1) / d)).astype(np.int8))
    assert np.array_equal(total[..., 0], qs[:, :, 0].astype(np.int32).sum(-1))
    assert np.array_equal(s[..., 0], d[..., 0] * total[..., 0].astype(np.float32))
    one = np.abs(activation_values(native_quantized.quantize_q8(x, 1), 1) - x.numpy().astype(np.float64))
    two = np.abs(activation_values(native_quantized.quantize_q8(x, 2), 2) - x.numpy().astype(np.float64))
    step = np.repeat(d[..., 0], 32, axis=1)
    assert (one <= step / 2 * (1 + 1e-6)).all()
    assert (two <= step / 2 / 127 * (1 + 1e-3)).all()  # about 127 times finer


@given(rows=st.integers(1, 9), blocks=st.integers(1, 12), scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e4, 1e30]), seed=st.integers(0, 2**16))
@settings(max_examples=40, deadline=None)
def test_every_level_quantizes_the_activations_to_the_portable_loops_bytes(rows: int, blocks: int, scale: float, seed: int) -> None:
    x = torch.randn(rows, 32 * blocks, generator=torch.Generator().manual_seed(seed)) * scale
    x[0, : 32 * blocks : 7] = 0.0  # zeros, and (one row, one block) all zero
    if rows > 1:
        x[1, :32] = 0.0
    for halves in (1, 2):
        portable = native_quantized.quantize_q8(x, halves, isa=native_quantized.IDOT_PORTABLE)
        for level in LEVELS[1:]:
            assert torch.equal(native_quantized.quantize_q8(x, halves, isa=level), portable), (level, halves)


@pytest.mark.parametrize("ggml_type", [T.Q4_1, T.Q8_0])
def test_a_nan_in_one_rows_input_reaches_that_rows_outputs_only(ggml_type: T) -> None:
    weight = weight_of(ggml_type, 21, 256)
    x = torch.randn(20, 256, generator=torch.Generator().manual_seed(6))
    x[3, 100] = float("nan")
    for halves in (1, 2):
        for level in LEVELS:
            y = products(x, weight, halves, level)[1]
            assert y[3].isnan().all(), (level, halves)
            assert not y[torch.arange(20) != 3].isnan().any(), (level, halves)


@settings(max_examples=60, deadline=None)
@given(
    ggml_type=st.sampled_from(TYPES),
    out_features=st.integers(1, 40),
    blocks=st.integers(1, 8),
    rows=st.integers(1, 64),
    halves=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_any_shape_and_row_count_gives_the_same_bits_at_every_level_and_row_by_row(
    ggml_type: T, out_features: int, blocks: int, rows: int, halves: int, seed: int
) -> None:
    weight = weight_of(ggml_type, out_features, 32 * blocks, seed)
    x = torch.randn(rows, 32 * blocks, generator=torch.Generator().manual_seed(seed))
    xq, first = products(x, weight, halves, LEVELS[0])
    assert np.array_equal(first.numpy(), scalar_reference(xq, halves, weight))
    for level in LEVELS[1:]:
        assert torch.equal(products(x, weight, halves, level)[1], first), level
    for row in {0, rows - 1, rows // 2}:
        assert torch.equal(products(x[row : row + 1], weight, halves, native_quantized.INTEGER_ISA)[1], first[row : row + 1])


@pytest.mark.skipif(
    not native.available() or native_quantized.integer_dot_isa(native_quantized.IDOT_AMX) != native_quantized.IDOT_AMX,
    reason="AMX not granted here",
)
@pytest.mark.parametrize("halves", [1, 2])
@pytest.mark.parametrize("ggml_type", TYPES)
def test_amx_tiles_give_the_scalar_references_bits_for_whole_and_partial_tiles_groups_and_chunks(ggml_type: T, halves: int) -> None:
    # 3 blocks (an odd count: the tile pairs alternate by block), 37 outputs (a partial group of
    # 16), and activation rows (a token's halves count as two) from where every type runs at AMX
    # (48) through a partial tile of 16 to past a chunk's 128
    weight = weight_of(ggml_type, 37, 96, seed=7)
    for rows in (48 // halves, 49, 80, 130 // halves):
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
        xq, got = products(x, weight, halves, native_quantized.IDOT_AMX)
        assert np.array_equal(got.numpy(), scalar_reference(xq, halves, weight)), rows
        assert torch.equal(got, products(x, weight, halves, native_quantized.IDOT_AVX512_VNNI)[1]), rows
        assert torch.equal(got[rows - 1 :], products(x[rows - 1 :], weight, halves, native_quantized.IDOT_AMX)[1]), rows


def test_a_thread_team_over_a_tall_weight_gives_the_single_threads_bits() -> None:
    weight = weight_of(T.Q4_1, 1000, 1024)
    x = torch.randn(40, 1024, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = products(x, weight, 2, native_quantized.INTEGER_ISA)[1]
        torch.set_num_threads(max(2, threads))
        assert torch.equal(products(x, weight, 2, native_quantized.INTEGER_ISA)[1], alone)
    finally:
        torch.set_num_threads(threads)


def test_a_cpu_whose_os_refuses_an_extension_falls_back_to_the_next_level_with_the_same_bits() -> None:
    # integer_dot_grants asks the OS too (XGETBV, through __builtin_cpu_supports; AMX's grant by
    # arch_prctl and a trial child); here the grants of CPUs whose OS refuses AMX, AVX-512 or
    # AVX-VNNI are stood in for.
    every = native_quantized.IDOT_GRANTS_AVX2 | native_quantized.IDOT_GRANTS_AVX_VNNI | native_quantized.IDOT_GRANTS_AVX512_VNNI
    assert native_quantized.integer_dot_isa(native_quantized.IDOT_AMX, every | native_quantized.IDOT_GRANTS_AMX) == native_quantized.IDOT_AMX
    assert native_quantized.integer_dot_isa(native_quantized.IDOT_AMX, every) == native_quantized.IDOT_AVX512_VNNI  # advertised, refused
    assert native_quantized.integer_dot_isa(native_quantized.IDOT_AVX512_VNNI, every | native_quantized.IDOT_GRANTS_AMX) == native_quantized.IDOT_AVX512_VNNI
    no_avx512_amx = native_quantized.IDOT_GRANTS_AVX2 | native_quantized.IDOT_GRANTS_AVX_VNNI | native_quantized.IDOT_GRANTS_AMX
    assert native_quantized.integer_dot_isa(native_quantized.IDOT_AMX, no_avx512_amx) == native_quantized.IDOT_AVX_VNNI
    assert native_quantized.integer_dot_isa(native_quantized.IDOT_AVX512_VNNI, every) == native_quantized.IDOT_AVX512_VNNI
    no_avx512 = native_quantized.IDOT_GRANTS_AVX2 | native_quantized.IDOT_GRANTS_AVX_VNNI
    assert native_quantized.integer_dot_isa(native_quantized.IDOT_AVX512_VNNI, no_avx512) == native_quantized.IDOT_AVX_VNNI
    assert native_quantized.integer_dot_isa(native_quantized.IDOT_AVX512_VNNI, native_quantized.IDOT_GRANTS_AVX2) == native_quantized.IDOT_AVX2
    assert native_quantized.integer_dot_isa(native_quantized.IDOT_AVX_VNNI, native_quantized.IDOT_GRANTS_AVX512_VNNI) == native_quantized.IDOT_PORTABLE
    assert native_quantized.integer_dot_isa(native_quantized.IDOT_AVX512_VNNI, 0) == native_quantized.IDOT_PORTABLE
    weight = weight_of(T.Q5_0, 20, 256)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(4))
    widest = products(x, weight, 2, native_quantized.IDOT_AMX)[1]
    for granted in (every, no_avx512, native_quantized.IDOT_GRANTS_AVX2, 0):
        fallen = native_quantized.integer_dot_isa(native_quantized.IDOT_AMX, granted)
        assert torch.equal(products(x, weight, 2, fallen)[1], widest)


def test_amx_is_granted_only_when_its_trial_child_exits_cleanly_and_a_child_dying_of_sigill_leaves_this_process_running() -> None:
    """The trial child with an injected undefined instruction dies of SIGILL: the trial refuses,
    and this process (which forked it) goes on multiplying. Without the fault the child's verdict is
    the grant's own: AMX is granted exactly where the child ran its tile product cleanly."""
    assert native_quantized.integer_dot_amx_trial(fault=True) is False
    granted = native_quantized.integer_dot_isa(native_quantized.IDOT_AMX) == native_quantized.IDOT_AMX
    if granted:
        assert native_quantized.integer_dot_amx_trial() is True
    weight = weight_of(T.Q4_0, 8, 64)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    assert torch.equal(products(x, weight, 2, native_quantized.INTEGER_ISA)[1], products(x, weight, 2, native_quantized.IDOT_PORTABLE)[1])


def test_flare_integer_isa_lowers_the_level_and_an_unknown_name_is_refused() -> None:
    assert native_quantized._integer_isa("AVX512", None) == native_quantized.IDOT_AMX  # the kernel lowers it unless granted
    assert native_quantized._integer_isa("AVX512", "amx") == native_quantized.IDOT_AMX
    assert native_quantized._integer_isa("AVX512", "avx512_vnni") == native_quantized.IDOT_AVX512_VNNI
    assert native_quantized._integer_isa("AVX512", "avx_vnni") == native_quantized.IDOT_AVX_VNNI
    # ATen has no AVX-VNNI level: a CPU it dispatches as AVX2 may have AVX-VNNI (Alder Lake,
    # Sierra Forest), which the kernel takes where the CPU grants it
    assert native_quantized._integer_isa("AVX2", None) == native_quantized.IDOT_AVX_VNNI
    assert native_quantized._integer_isa("AVX2", "avx2") == native_quantized.IDOT_AVX2
    assert native_quantized._integer_isa("AVX2", "avx512_vnni") == native_quantized.IDOT_AVX_VNNI  # lowers, never raises
    assert native_quantized._integer_isa("AVX2", "amx") == native_quantized.IDOT_AVX_VNNI
    assert native_quantized._integer_isa("DEFAULT", None) == native_quantized.IDOT_PORTABLE
    with pytest.raises(ValueError, match="FLARE_INTEGER_ISA must be one of portable, avx2, avx_vnni, avx512_vnni, amx"):
        native_quantized._integer_isa("AVX512", "amx_int8")


@pytest.mark.parametrize("forced", ["avx2", "portable"])
def test_the_level_engine_loaded_names_is_the_forced_one(forced: str) -> None:
    # What `engine_loaded` reports as `integer_level`: FLARE_INTEGER_ISA read at import, then what
    # the CPU grants (every x86-64 CPU this project runs on has AVX2).
    script = "from flare.engine import native_quantized; print(native_quantized.integer_level_name())"
    env = {**os.environ, "FLARE_INTEGER_ISA": forced}
    done = subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=120, cwd=REPOSITORY, capture_output=True, text=True)
    assert done.stdout.strip() == forced


@pytest.mark.parametrize("forced", ["avx_vnni", "avx2", "portable"])
def test_a_forced_dispatch_subprocess_gives_the_same_bits(tmp_path: Path, forced: str) -> None:
    script = f"""
import numpy as np, torch
from tests.engine.test_integer_linear import weight_of, products, TYPES
from flare.engine import native, native_quantized
assert native_quantized.INTEGER_ISA == min(native_quantized.INTEGER_ISA_NAMES[{forced!r}], native_quantized.INTEGER_ISA_NAMES["avx512_vnni"])
x = torch.from_numpy(np.random.default_rng(5).standard_normal((25, 256), dtype=np.float32))
out = [products(x, weight_of(t, 21, 256), h, native_quantized.INTEGER_ISA)[1] for t in TYPES for h in (1, 2)]
torch.save(out, {str(tmp_path / "forced.pt")!r})
"""
    env = {**os.environ, "FLARE_INTEGER_ISA": forced}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=300, cwd=REPOSITORY)
    # 25 rows: with two halves, at AMX (where granted) the tile products, against each forced level's
    x = torch.from_numpy(np.random.default_rng(5).standard_normal((25, 256), dtype=np.float32))
    here = [products(x, weight_of(t, 21, 256), h, native_quantized.INTEGER_ISA)[1] for t in TYPES for h in (1, 2)]
    assert all(torch.equal(a, b) for a, b in zip(torch.load(tmp_path / "forced.pt"), here))


@pytest.mark.parametrize("activations", ["int8", "int8x2"])
def test_a_weight_multiplies_the_activation_blocks_it_asks_for_and_float32_keeps_the_exact_bits(activations: str) -> None:
    weight = weight_of(T.Q4_1, 24, 128)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(6))
    halves = quantized.HALVES[activations]
    integer = weight.with_activations(activations)
    assert integer.halves == halves
    assert torch.equal(quantized_linear(x, integer), products(x, weight, halves, native_quantized.INTEGER_ISA)[1])
    assert weight.activations == "float32" and weight.halves == 0
    assert torch.equal(quantized_linear(x, weight), native_quantized.quantized_linear(x, weight.data, weight.ggml_type, 24, 128, native_quantized.QUANTIZED_ISA))
    assert torch.equal(integer.rows(4, 10).data, weight.data[4:10]) and integer.rows(4, 10).activations == activations


@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q5_K, T.Q6_K])
@pytest.mark.parametrize("activations", ["int8", "int8x2"])
def test_a_k_weight_multiplies_q8k_blocks_with_the_integer_kernels_bits_alone_in_a_batch_and_beside_other_parts(
    ggml_type: T, activations: str
) -> None:
    from tests.engine.test_integer_kquants import k_blocks

    halves = quantized.HALVES[activations]
    blocks = k_blocks(ggml_type, 19, 512, seed=3)
    weight = QuantizedWeight.from_blocks(ggml_type, blocks, 19, 512, activations)
    assert weight.halves == halves
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(8))
    got = quantized_linear(x, weight)
    # test_integer_kquants proves kquant_product against a numpy statement of the arithmetic.
    assert torch.equal(got, native_quantized.kquant_product(x, blocks, ggml_type, 19, 512, halves=halves))
    for level in LEVELS:
        assert torch.equal(quantized_linear(x, weight, isa=level), got)
    for row in range(6):
        assert torch.equal(quantized_linear(x[row : row + 1].clone(), weight), got[row : row + 1])
    # Beside a 32-value part and a float32 one (q, k, v of three types): each its own product, the
    # K part's input quantized once into Q8_K blocks.
    other = weight_of(T.Q8_0, 5, 512).with_activations(activations)
    exact = weight_of(T.Q4_1, 3, 512)
    together = linear(x, (weight, other, exact))
    assert torch.equal(together, torch.cat([got, quantized_linear(x, other), quantized_linear(x, exact)], dim=1))


def test_an_unknown_activation_precision_or_bad_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match="activations must be one of float32, int8x2, int8, got 'int4'"):
        QuantizedWeight.from_blocks(T.Q8_0, torch.zeros(1, 34, dtype=torch.uint8), 1, 32, "int4")
    with pytest.raises(ValueError, match="in a multiple of 32"):
        native_quantized.quantize_q8(torch.zeros(1, 40))
    with pytest.raises(ValueError, match="halves must be 1 or 2"):
        native_quantized.quantize_q8(torch.zeros(1, 32), 3)
    with pytest.raises(ValueError, match="integer_linear: xq must be contiguous CPU uint8"):
        native_quantized.integer_linear(torch.zeros(1, 10, dtype=torch.uint8), torch.zeros(1, 34, dtype=torch.uint8), T.Q8_0, 1, 32, 0)


def test_auto_serves_large_32_value_packages_with_int8x2_and_small_ones_with_float32() -> None:
    # what engine_loaded and ctl status report, from a package's weight types and bytes
    def types(**sizes: int) -> dict[str, dict[str, int]]:
        return {kind: {"tensors": 1, "bytes": size} for kind, size in sizes.items()}

    large, small = types(Q8_0=INTEGER_FROM_BYTES, F32=1_000), types(Q4_1=66_400_000, Q8_0=30_100_000)
    assert served_activations(large, "auto") == "int8x2"
    assert served_activations(small, "auto") == "float32"
    assert served_activations(large, "float32") == "float32"
    assert served_activations(small, "int8x2") == "int8x2"
    assert served_activations(types(F16=10 * INTEGER_FROM_BYTES), "int8x2") == "float32"  # no integer kernels
