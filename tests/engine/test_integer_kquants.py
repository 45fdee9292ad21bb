"""Integer products of K-quant weights (Q4_K, Q5_K, Q6_K) with Q8_K activations
(flare/engine/csrc/integer_kquants.c): the float64 product of the values actually multiplied up to
float32 rounding, bit for bit a plain numpy statement of the same arithmetic, the same bits at every
level and batch size; and the activations' quantization."""

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
from flare.engine import native, native_quantized

pytestmark = pytest.mark.skipif(not native.available(), reason="the engine's kernels were not built")

T = gguf.GGMLQuantizationType
K_TYPES = (T.Q4_K, T.Q5_K, T.Q6_K)
LEVELS = (
    native_quantized.IDOT_PORTABLE,
    native_quantized.IDOT_AVX2,
    native_quantized.IDOT_AVX_VNNI,
    native_quantized.IDOT_AVX512_VNNI,
    native_quantized.IDOT_AMX,
)
# AMX runs only where granted (integer_dot.c: the CPU advertises amx-tile and amx-int8, Linux grants
# the tile data by arch_prctl, a trial child runs a tile product cleanly); elsewhere the level falls
# back and the AMX tests have nothing of their own to prove.
AMX = native.available() and native_quantized.integer_dot_isa(native_quantized.IDOT_AMX) == native_quantized.IDOT_AMX
needs_amx = pytest.mark.skipif(
    not AMX, reason="AMX is not granted here (needs amx-tile, amx-int8, AVX-512 VNNI, the arch_prctl XTILEDATA permission and a clean trial child)"
)
# Where each type keeps its float16 scales (d, then dmin).
SCALE_OFFSETS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def k_blocks(ggml_type: T, out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """Random valid blocks (gguf-py does not quantize K types): every quant and scale byte random,
    the float16 d and dmin finite, some of them subnormal."""
    rng = np.random.default_rng(seed)
    type_size = gguf.GGML_QUANT_SIZES[ggml_type][1]
    blocks = rng.integers(0, 256, (out_features * (in_features // 256), type_size), dtype=np.uint8)
    for offset in SCALE_OFFSETS[ggml_type]:
        scales = (rng.standard_normal(blocks.shape[0], dtype=np.float32) * 0.01).astype(np.float16)
        scales[::7] = np.float16(3e-6)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(np.ascontiguousarray(blocks.reshape(out_features, -1)))


def activations(rows: int, in_features: int, seed: int = 1) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((rows, in_features), dtype=np.float32))


def unpacked(ggml_type: T, blocks: torch.Tensor) -> tuple[np.ndarray, ...]:
    """Per super-block: the unsigned quants q [out, nb, 256], the integer scales [out, nb, G] of the
    G groups (8 of 32, or Q6_K's 16 of 16), the mins [out, nb, 8] (Q6_K: 32 for every group), d and
    dmin (float32 [out, nb]); gguf-py's layout (quants.py)."""
    out_features = blocks.shape[0]
    b = blocks.numpy().reshape(out_features, -1, gguf.GGML_QUANT_SIZES[ggml_type][1]).astype(np.int64)
    f16 = lambda at: blocks.numpy().reshape(b.shape)[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float32)  # noqa: E731
    if ggml_type == T.Q6_K:
        ql, qh = b[..., :128], b[..., 128:192]
        e = np.arange(128)
        q = np.concatenate(
            [((ql[..., 64 * h + e % 64] >> (4 * (e // 64))) & 15) | (((qh[..., 32 * h + e % 32] >> (2 * (e // 32))) & 3) << 4) for h in range(2)],
            axis=-1,
        )
        scales = b[..., 192:208].astype(np.uint8).view(np.int8).astype(np.int64)
        return q, scales, None, f16(208), None
    s = b[..., 4:16]
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    qs = b[..., 48:176] if ggml_type == T.Q5_K else b[..., 16:144]
    qh = b[..., 16:48]
    j, l = np.arange(256) // 32, np.arange(256) % 32
    q = (qs[..., 32 * (j // 2) + l] >> (4 * (j % 2))) & 15
    if ggml_type == T.Q5_K:
        q = q | (((qh[..., l] >> j) & 1) << 4)
    return q, sc, mn, f16(0), f16(2)


def reference(ggml_type: T, blocks: torch.Tensor, d: torch.Tensor, qs: torch.Tensor, bsums: torch.Tensor) -> np.ndarray:
    """The kernel's arithmetic in numpy: exact integer sums per super-block, then in float32
    dd = d x.d, dm = dmin x.d, t = dd sumi - dm summins, acc = acc + t in block order."""
    q, sc, mn, wd, wdmin = unpacked(ggml_type, blocks)
    rows, nb = d.shape
    x = qs.numpy().astype(np.int64).reshape(rows, nb, 256)
    bs = bsums.numpy().astype(np.int64).reshape(rows, nb, 16)
    groups = sc.shape[-1]
    per_group = np.einsum("onge,rnge->rong", q.reshape(*q.shape[:2], groups, -1), x.reshape(rows, nb, groups, -1))
    if ggml_type == T.Q6_K:
        sumi = (per_group * sc[None]).sum(-1) - 32 * (bs[:, None] * sc[None]).sum(-1)
        summins = np.zeros_like(sumi)
        wdmin = np.zeros_like(wd)
    else:
        sumi = (per_group * sc[None]).sum(-1)
        summins = ((bs[..., 0::2] + bs[..., 1::2])[:, None] * mn[None]).sum(-1)
    xd = d.numpy()[:, None, :]
    dd, dm = wd[None] * xd, wdmin[None] * xd  # float32 [rows, out, nb]
    terms = dd * sumi.astype(np.float32) - dm * summins.astype(np.float32)
    acc = np.zeros(terms.shape[:2], dtype=np.float32)
    for i in range(nb):
        acc = acc + terms[..., i]
    return acc


def gguf_values(ggml_type: T, blocks: torch.Tensor) -> np.ndarray:
    return gguf.quants.dequantize(blocks.numpy(), ggml_type).astype(np.float64)


@pytest.mark.parametrize("ggml_type", K_TYPES)
def test_each_type_is_the_float64_product_of_the_values_it_multiplies_and_the_reference_bit_for_bit(ggml_type: T) -> None:
    in_features, out_features = 1024, 37
    blocks = k_blocks(ggml_type, out_features, in_features, seed=int(ggml_type))
    x = activations(7, in_features)
    got = native_quantized.kquant_product(x, blocks, ggml_type, out_features, in_features)
    d, qs, bsums = native_quantized.quantize_q8k(x)
    assert np.array_equal(got.numpy(), reference(ggml_type, blocks, d, qs, bsums))
    # Against gguf-py's values times the activations actually used (d qs): the float32 steps round
    # each super-block's two parts and their running sum, about (blocks + 4) ulps of the magnitudes.
    x_used = (d.double().repeat_interleave(256, dim=1) * qs.double()).numpy()
    values = gguf_values(ggml_type, blocks)
    q, sc, mn, wd, wdmin = unpacked(ggml_type, blocks)
    scaled = np.abs(wd.astype(np.float64)[..., None] * np.repeat(sc, 256 // sc.shape[-1], -1) * q).reshape(out_features, -1)
    if mn is not None:
        scaled += np.abs(wdmin.astype(np.float64)[..., None] * np.repeat(mn, 32, -1)).reshape(out_features, -1)
    magnitude = np.abs(x_used) @ (scaled + np.abs(values)).T
    exact = x_used @ values.T
    assert (np.abs(got.numpy() - exact) <= magnitude * 2.0**-24 * (in_features // 256 + 6) + 1e-30).all()
    # And the activations' own rounding is what it costs against the float product: at most half a
    # step d / 2 per activation.
    step = d.double().repeat_interleave(256, dim=1).numpy() / 2
    assert (np.abs(got.numpy() - x.double().numpy() @ values.T) <= step @ np.abs(values).T + magnitude * 2.0**-20).all()


@settings(max_examples=60, deadline=None)
@given(
    ggml_type=st.sampled_from(K_TYPES),
    blocks_per_row=st.integers(1, 16),
    out_features=st.integers(1, 40),
    rows=st.integers(1, 64),
    seed=st.integers(0, 2**16),
)
def test_any_shape_and_row_count_gives_the_reference_bits(ggml_type: T, blocks_per_row: int, out_features: int, rows: int, seed: int) -> None:
    in_features = 256 * blocks_per_row
    blocks = k_blocks(ggml_type, out_features, in_features, seed=seed)
    x = activations(rows, in_features, seed=seed + 1)
    got = native_quantized.kquant_product(x, blocks, ggml_type, out_features, in_features)
    assert np.array_equal(got.numpy(), reference(ggml_type, blocks, *native_quantized.quantize_q8k(x)))


@pytest.mark.parametrize("ggml_type", K_TYPES)
def test_every_level_gives_the_same_bits_and_a_row_alone_gives_its_batch_bits(ggml_type: T) -> None:
    in_features, out_features = 768, 19
    blocks = k_blocks(ggml_type, out_features, in_features, seed=3)
    x = activations(64, in_features, seed=4)
    batch = native_quantized.kquant_product(x, blocks, ggml_type, out_features, in_features)
    for isa in LEVELS + (99,):  # 99: above every level, capped to the widest this CPU has
        assert torch.equal(native_quantized.kquant_product(x, blocks, ggml_type, out_features, in_features, isa=isa), batch), isa
    for row in (0, 5, 62, 63):
        alone = native_quantized.kquant_product(x[row : row + 1].clone(), blocks, ggml_type, out_features, in_features, isa=native_quantized.IDOT_PORTABLE)
        assert torch.equal(alone[0], batch[row])
    for rows in (1, 2, 3, 5, 6, 7):
        assert torch.equal(native_quantized.kquant_product(x[:rows].clone(), blocks, ggml_type, out_features, in_features), batch[:rows])


@pytest.mark.parametrize("halves", [1, 2])
def test_a_prefills_rows_across_several_row_tiles_keep_each_rows_bits(halves: int) -> None:
    """More activation rows than one tile (integer_linear.c's KQ_ROW_TILE, 128 Q8K rows, which the
    portable level and the 4-row tiles run; the wide tiles run 64 at a time): every row as it is
    alone, and as the reference for one half."""
    ggml_type, in_features, out_features = T.Q6_K, 512, 37
    blocks = k_blocks(ggml_type, out_features, in_features, seed=13)
    x = activations(301, in_features, seed=14)
    batch = native_quantized.kquant_product(x, blocks, ggml_type, out_features, in_features, halves=halves)
    portable = native_quantized.kquant_product(x, blocks, ggml_type, out_features, in_features, isa=native_quantized.IDOT_PORTABLE, halves=halves)
    assert torch.equal(portable, batch)
    if halves == 1:
        assert np.array_equal(batch.numpy(), reference(ggml_type, blocks, *native_quantized.quantize_q8k(x)))
    for row in (0, 63, 64, 127, 128, 200, 300):
        alone = native_quantized.kquant_product(x[row : row + 1].clone(), blocks, ggml_type, out_features, in_features, halves=halves)
        assert torch.equal(alone[0], batch[row]), row


@pytest.mark.parametrize("halves", [1, 2])
@pytest.mark.parametrize("ggml_type", K_TYPES)
def test_wide_tiles_give_the_four_row_tiles_bits_either_side_of_their_start_and_of_a_row_tile(ggml_type: T, halves: int) -> None:
    """From 6 activation rows (int8x2: 3 tokens) AVX-512 VNNI multiplies 16 outputs at a time, 64
    activation rows a tile, and from 16 rows AVX-VNNI and AVX2 do, as two vectors of 8
    (integer_kquant_tiles.c); the portable level keeps the 4-row tiles. 37 outputs leave the last
    group of 16 partial."""
    in_features, out_features = 512, 37
    blocks = k_blocks(ggml_type, out_features, in_features, seed=21)
    x = activations(70, in_features, seed=22)
    batch = native_quantized.kquant_product(x, blocks, ggml_type, out_features, in_features, halves=halves)
    if halves == 1:
        assert np.array_equal(batch.numpy(), reference(ggml_type, blocks, *native_quantized.quantize_q8k(x)))
    for rows in (2, 3, 5, 6, 7, 8, 9, 15, 16, 17, 31, 32, 33, 64, 65, 70):
        part = x[:rows].clone()
        narrow = native_quantized.kquant_product(part, blocks, ggml_type, out_features, in_features, isa=native_quantized.IDOT_PORTABLE, halves=halves)
        assert torch.equal(narrow, batch[:rows]), rows
        for isa in (native_quantized.IDOT_AVX2, native_quantized.IDOT_AVX_VNNI, native_quantized.IDOT_AVX512_VNNI, native_quantized.IDOT_AMX):
            assert torch.equal(native_quantized.kquant_product(part, blocks, ggml_type, out_features, in_features, isa=isa, halves=halves), narrow), (rows, isa)


@needs_amx
@pytest.mark.parametrize("halves", [1, 2])
@pytest.mark.parametrize("ggml_type", K_TYPES)
def test_amx_tiles_give_the_portable_bits_either_side_of_their_start_and_of_16_and_64_row_edges(ggml_type: T, halves: int) -> None:
    """AMX multiplies a tile call of 16 or more activation rows (integer_kquant_tiles.c's
    KQ_AMX_FROM) 16 rows a tile product, the last rows of a call in a tile of their own; below, the
    AVX-512 VNNI tiles. Every row count gives the portable bits, and a row alone its batch bits."""
    in_features, out_features = 768, 37
    blocks = k_blocks(ggml_type, out_features, in_features, seed=31)
    x = activations(70, in_features, seed=32)
    batch = native_quantized.kquant_product(x, blocks, ggml_type, out_features, in_features, isa=native_quantized.IDOT_AMX, halves=halves)
    portable = native_quantized.kquant_product(x, blocks, ggml_type, out_features, in_features, isa=native_quantized.IDOT_PORTABLE, halves=halves)
    assert torch.equal(batch, portable)
    if halves == 1:
        assert np.array_equal(batch.numpy(), reference(ggml_type, blocks, *native_quantized.quantize_q8k(x)))
    for rows in (1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65, 70):
        got = native_quantized.kquant_product(x[:rows].clone(), blocks, ggml_type, out_features, in_features, isa=native_quantized.IDOT_AMX, halves=halves)
        assert torch.equal(got, portable[:rows]), rows
    for row in (0, 15, 16, 69):
        alone = native_quantized.kquant_product(x[row : row + 1].clone(), blocks, ggml_type, out_features, in_features, isa=native_quantized.IDOT_AMX, halves=halves)
        assert torch.equal(alone[0], batch[row]), row


@pytest.mark.parametrize("ggml_type", K_TYPES)
def test_the_256_bit_wide_tiles_sum_the_largest_quants_times_the_largest_activations_exactly(ggml_type: T) -> None:
    """Every quant at its largest (15, 31, 63: all quant bits set) against activations all +127 or
    all -127: the pair sums AVX2 adds in 16 bits before widening them are at their largest (Q6_K
    2 x 16,002), and the wide tiles (from 16 rows at AVX2 and AVX-VNNI) keep the portable bits."""
    in_features, out_features, rows = 512, 19, 20
    blocks = k_blocks(ggml_type, out_features, in_features, seed=61).numpy().reshape(out_features, -1, gguf.GGML_QUANT_SIZES[ggml_type][1])
    quant_bytes = {T.Q4_K: slice(16, 144), T.Q5_K: slice(16, 176), T.Q6_K: slice(0, 192)}[ggml_type]  # Q5_K: high bits too
    blocks[..., quant_bytes] = 0xFF
    blocks = torch.from_numpy(np.ascontiguousarray(blocks.reshape(out_features, -1)))
    x = torch.ones(rows, in_features) * torch.tensor([(-1.0) ** r for r in range(rows)]).unsqueeze(1)
    d, qs, bsums = native_quantized.quantize_q8k(x)
    assert int(qs.abs().min()) == 127
    portable = native_quantized.kquant_product(x, blocks, ggml_type, out_features, in_features, isa=native_quantized.IDOT_PORTABLE)
    assert np.array_equal(portable.numpy(), reference(ggml_type, blocks, d, qs, bsums))
    for isa in (native_quantized.IDOT_AVX2, native_quantized.IDOT_AVX_VNNI):
        assert torch.equal(native_quantized.kquant_product(x, blocks, ggml_type, out_features, in_features, isa=isa), portable), isa


@needs_amx
@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q5_K])
def test_amx_mins_take_each_rows_sub_block_sums_at_their_extremes_of_both_signs(ggml_type: T) -> None:
    """AMX's float step reads a row's 32-quant sub-block sums as two int16 a dword, formed once a call
    (kquant_pack_rows): sub-blocks of all +127 or all -127 quants, the signs alternating by sub-block
    and by row, give sums of +-4064, the reference's bits and the portable level's at 16 to 70 rows."""
    in_features, out_features, rows = 512, 37, 70
    blocks = k_blocks(ggml_type, out_features, in_features, seed=51)
    signs = [[(-1.0) ** (j + r) for j in range(in_features // 32)] for r in range(rows)]
    x = torch.tensor(signs, dtype=torch.float32).repeat_interleave(32, dim=1)
    d, qs, bsums = native_quantized.quantize_q8k(x)
    assert int(qs.abs().min()) == 127
    expected = reference(ggml_type, blocks, d, qs, bsums)
    portable = native_quantized.kquant_product(x, blocks, ggml_type, out_features, in_features, isa=native_quantized.IDOT_PORTABLE)
    assert np.array_equal(portable.numpy(), expected)
    for n in (16, 17, 33, 64, 70):
        amx = native_quantized.kquant_product(x[:n].clone(), blocks, ggml_type, out_features, in_features, isa=native_quantized.IDOT_AMX)
        assert torch.equal(amx, portable[:n]), n


@needs_amx
def test_amx_threads_each_configure_their_tiles_and_a_prefill_across_row_tiles_keeps_the_portable_bits() -> None:
    """Each thread of the team loads its own tile configuration (a thread's tile state is its own);
    300 tokens of two halves span AMX's row tiles (128 rows) and end in a partial one."""
    threads = torch.get_num_threads()
    blocks = k_blocks(T.Q6_K, 70, 512, seed=41)
    x = activations(300, 512, seed=42)
    portable = native_quantized.kquant_product(x, blocks, T.Q6_K, 70, 512, isa=native_quantized.IDOT_PORTABLE, halves=2)
    try:
        for team in (1, 2):
            torch.set_num_threads(team)
            assert torch.equal(native_quantized.kquant_product(x, blocks, T.Q6_K, 70, 512, isa=native_quantized.IDOT_AMX, halves=2), portable), team
    finally:
        torch.set_num_threads(threads)


@needs_amx
@settings(max_examples=40, deadline=None)
@given(
    ggml_type=st.sampled_from(K_TYPES),
    blocks_per_row=st.integers(1, 6),
    out_features=st.integers(1, 40),
    rows=st.integers(1, 70),
    halves=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_amx_gives_the_portable_bits_at_any_shape_and_row_count(
    ggml_type: T, blocks_per_row: int, out_features: int, rows: int, halves: int, seed: int
) -> None:
    in_features = 256 * blocks_per_row
    blocks = k_blocks(ggml_type, out_features, in_features, seed=seed)
    x = activations(rows, in_features, seed=seed + 1)
    amx = native_quantized.kquant_product(x, blocks, ggml_type, out_features, in_features, isa=native_quantized.IDOT_AMX, halves=halves)
    portable = native_quantized.kquant_product(x, blocks, ggml_type, out_features, in_features, isa=native_quantized.IDOT_PORTABLE, halves=halves)
    assert torch.equal(amx, portable)


FORCED_SCRIPT = """
import sys, torch
sys.path.insert(0, {root!r})
from tests.engine.test_integer_kquants import forced_cases
from flare.engine import native, native_quantized
torch.save({{'isa': native_quantized.KQUANT_ISA, 'level': native_quantized.integer_dot_isa(native_quantized.KQUANT_ISA), 'outputs': forced_cases()}}, {path!r})
"""


def forced_cases(isa: int | None = None) -> list[torch.Tensor]:
    """Each type's product at 1, 3, 8, 33 and 70 rows at `isa` (default: the process's default
    level), with one and two halves (AVX-512 VNNI: the 4-row tiles, then the wide tiles, past a
    64-row tile at 33 x 2 and 70; AMX from 16 rows), and the activations' quantization."""
    outputs = []
    for ggml_type in K_TYPES:
        blocks = k_blocks(ggml_type, 21, 512, seed=int(ggml_type))
        for rows in (1, 3, 8, 33, 70):
            x = activations(rows, 512, seed=rows)
            outputs.append(native_quantized.kquant_product(x, blocks, ggml_type, 21, 512, isa=isa))
            outputs.append(native_quantized.kquant_product(x, blocks, ggml_type, 21, 512, isa=isa, halves=2))
            outputs.extend(native_quantized.quantize_q8k(x, isa=isa))
    return outputs


@pytest.mark.parametrize(
    ("capability", "forced", "isa"),
    [
        # ATen dispatching as AVX2 leaves AVX-VNNI to a CPU that has it (the kernel lowers to AVX2
        # where it has not); FLARE_INTEGER_ISA=avx2 stands in for an AVX2-only CPU
        ("avx2", None, native_quantized.IDOT_AVX_VNNI),
        ("avx2", "avx2", native_quantized.IDOT_AVX2),
        ("default", None, native_quantized.IDOT_PORTABLE),
    ],
)
def test_forced_avx2_and_forced_portable_dispatch_give_the_same_bits(tmp_path: Path, capability: str, forced: str | None, isa: int) -> None:
    path = tmp_path / "outputs.pt"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    env.pop("FLARE_INTEGER_ISA", None)
    if forced:
        env["FLARE_INTEGER_ISA"] = forced
    subprocess.run([sys.executable, "-c", FORCED_SCRIPT.format(root=REPOSITORY, path=str(path))], env=env, check=True, timeout=300)
    forced = torch.load(path)
    assert forced["isa"] == isa and forced["level"] == native_quantized.integer_dot_isa(isa)  # what this CPU grants of it
    for got, expected in zip(forced["outputs"], forced_cases(), strict=True):
        assert torch.equal(got, expected)


@needs_amx
def test_forced_amx_dispatch_in_a_fresh_process_asks_for_the_tiles_and_gives_the_portable_bits(tmp_path: Path) -> None:
    """FLARE_INTEGER_ISA=amx in a process of its own: the process asks Linux for the tile data
    itself (the permission is per process), runs AMX, and gives the portable level's bits."""
    path = tmp_path / "outputs.pt"
    env = {**os.environ, "FLARE_INTEGER_ISA": "amx"}
    subprocess.run([sys.executable, "-c", FORCED_SCRIPT.format(root=REPOSITORY, path=str(path))], env=env, check=True, timeout=300)
    forced = torch.load(path)
    assert forced["isa"] == forced["level"] == native_quantized.IDOT_AMX
    for got, expected in zip(forced["outputs"], forced_cases(native_quantized.IDOT_PORTABLE), strict=True):
        assert torch.equal(got, expected)


def test_quantized_activations_are_the_nearest_steps_of_max_over_127_with_their_block_sums() -> None:
    x = activations(3, 1024, seed=9) * torch.tensor([1.0, 1e-30, 3e30]).unsqueeze(1)
    for isa in LEVELS:
        d, qs, bsums = native_quantized.quantize_q8k(x, isa=isa)
        amax = x.abs().reshape(3, 4, 256).amax(-1)
        assert torch.equal(d, amax / 127)
        assert qs.abs().max() <= 127
        wide = qs.reshape(3, 4, 256).abs().amax(-1)
        assert (wide == 127).all()  # the largest |x| of each block is +-127
        assert torch.equal(qs.to(torch.int64), torch.clamp(torch.round(x / d.repeat_interleave(256, dim=1)), -127, 127).to(torch.int64))
        assert torch.equal(bsums.to(torch.int64), qs.to(torch.int64).reshape(3, -1, 16).sum(-1))
        for got, portable in zip((d, qs, bsums), native_quantized.quantize_q8k(x, isa=native_quantized.IDOT_PORTABLE), strict=True):
            assert torch.equal(got, portable)


def test_an_all_zero_block_quantizes_to_zeros_and_multiplies_to_zero() -> None:
    x = activations(2, 512, seed=2)
    x[1, 256:] = 0.0
    d, qs, bsums = native_quantized.quantize_q8k(x)
    assert d[1, 1] == 0 and not qs[1, 256:].any() and not bsums[1, 16:].any()
    assert d[1, 0] > 0
    blocks = k_blocks(T.Q4_K, 3, 512)
    zero = native_quantized.kquant_product(torch.zeros(1, 512), blocks, T.Q4_K, 3, 512)
    assert torch.equal(zero, torch.zeros(1, 3))


@pytest.mark.parametrize("ggml_type", K_TYPES)
def test_two_halves_are_the_products_of_x_and_of_its_residual_added_and_far_closer_to_the_float_product(ggml_type: T) -> None:
    in_features, out_features = 1024, 23
    blocks = k_blocks(ggml_type, out_features, in_features, seed=11)
    x = activations(9, in_features, seed=12)
    got = native_quantized.kquant_product(x, blocks, ggml_type, out_features, in_features, halves=2)
    d, qs, bsums = native_quantized.quantize_q8k(x)
    residual = x - d.repeat_interleave(256, dim=1) * qs.float()
    expected = reference(ggml_type, blocks, d, qs, bsums) + reference(ggml_type, blocks, *native_quantized.quantize_q8k(residual))
    assert np.array_equal(got.numpy(), expected)
    for isa in LEVELS:
        assert torch.equal(native_quantized.kquant_product(x, blocks, ggml_type, out_features, in_features, isa=isa, halves=2), got)
    assert torch.equal(native_quantized.kquant_product(x[4:5].clone(), blocks, ggml_type, out_features, in_features, halves=2)[0], got[4])
    exact = x.double().numpy() @ gguf_values(ggml_type, blocks).T
    one = native_quantized.kquant_product(x, blocks, ggml_type, out_features, in_features).numpy()
    assert np.abs(got.numpy() - exact).max() < np.abs(one - exact).max() / 30


@pytest.mark.parametrize("ggml_type", K_TYPES)
def test_one_token_alone_gives_the_reference_bits_at_every_level_with_infinite_and_nan_scales(ggml_type: T) -> None:
    """A decode token alone runs the kernel's one- and two-row forms (int8x2: x and its residual are
    its two rows), whose sums and scales share one reduction: each output must still be the
    reference's, at every level, where a block's d or dmin is infinite or NaN too."""
    in_features, out_features = 2048, 13
    blocks = k_blocks(ggml_type, out_features, in_features, seed=21).numpy().copy()
    type_size = gguf.GGML_QUANT_SIZES[ggml_type][1]
    flat = blocks.reshape(-1, type_size)
    offsets = SCALE_OFFSETS[ggml_type]
    flat[3, offsets[0] : offsets[0] + 2] = np.array([np.inf], dtype=np.float16).view(np.uint8)
    flat[17, offsets[-1] : offsets[-1] + 2] = np.array([np.nan], dtype=np.float16).view(np.uint8)
    weights = torch.from_numpy(blocks)
    x = activations(1, in_features, seed=22)
    d, qs, bsums = native_quantized.quantize_q8k(x)
    residual = x - d.repeat_interleave(256, dim=1) * qs.float()
    with np.errstate(invalid="ignore"):  # inf + -inf in the outputs of the infinite scale's row
        one = reference(ggml_type, weights, d, qs, bsums)
        two = one + reference(ggml_type, weights, *native_quantized.quantize_q8k(residual))
    for isa in LEVELS:
        got_one = native_quantized.kquant_product(x, weights, ggml_type, out_features, in_features, isa=isa)
        got_two = native_quantized.kquant_product(x, weights, ggml_type, out_features, in_features, isa=isa, halves=2)
        assert np.array_equal(got_one.numpy(), one, equal_nan=True), isa
        assert np.array_equal(got_two.numpy(), two, equal_nan=True), isa
        assert np.isfinite(got_two.numpy()).sum() == out_features - 2


def test_a_nan_in_one_rows_input_reaches_that_rows_outputs_only() -> None:
    blocks = k_blocks(T.Q6_K, 9, 512)
    x = activations(6, 512, seed=7)
    x[3, 300] = float("nan")
    for isa in LEVELS:
        y = native_quantized.kquant_product(x, blocks, T.Q6_K, 9, 512, isa=isa)
        assert y[3].isnan().all()
        assert not y[torch.arange(6) != 3].isnan().any()
        assert native_quantized.quantize_q8k(x, isa=isa)[0][3, 1].isnan()


def test_shapes_and_types_the_kernel_does_not_take_are_refused() -> None:
    blocks = k_blocks(T.Q4_K, 2, 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        native_quantized.kquant_product(torch.zeros(1, 128), blocks, T.Q4_K, 2, 128)
    with pytest.raises(ValueError, match="must be Q4_K"):
        native_quantized.kquant_product(torch.zeros(1, 256), blocks, T.Q4_0, 2, 256)
    with pytest.raises(ValueError, match=r"contiguous uint8 \(2, 176\)"):
        native_quantized.kquant_product(torch.zeros(1, 256), blocks, T.Q5_K, 2, 256)
    with pytest.raises(ValueError, match="halves must be 1 or 2"):
        native_quantized.kquant_product(torch.zeros(1, 256), blocks, T.Q4_K, 2, 256, halves=3)
    with pytest.raises(ValueError, match="float32"):
        native_quantized.kquant_product(torch.zeros(1, 256, dtype=torch.float64), blocks, T.Q4_K, 2, 256)
    with pytest.raises(ValueError, match=r"integer_kquant_linear: xq must be contiguous CPU uint8 \[tokens, 292 or 584\]"):
        native_quantized.integer_kquant_linear(torch.zeros(1, 100, dtype=torch.uint8), blocks, T.Q4_K, 2, 256, native_quantized.KQUANT_ISA)
    with pytest.raises(ValueError, match="quantize_q8k_rows: halves must be 1 or 2"):
        native_quantized.quantize_q8k_rows(torch.zeros(1, 256), 3)
