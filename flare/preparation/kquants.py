"""Q4_K and Q6_K quantizers: gguf-py dequantizes K-quants but cannot make them.

llama.cpp's reference quantizers, `quantize_row_q4_K_ref` and `quantize_row_q6_K_ref`
(ggml/src/ggml-quants.c), which `llama-quantize` runs when no importance matrix is given, with
their helpers `make_qkx2_quants` and `make_qx_quants`. `quantize_q4_k` and `quantize_q6_k` run
the engine's C port (flare/engine/csrc/kquant_quantizers.c: the same float32 operations in the
same order, so llama-quantize's bytes, on every thread) where the extension is built, and the
numpy port below where it is not (the extension is optional). The numpy port runs vectorised over
every sub-block of a matrix at once, in float32 as the C does; `nearest_int` is round-half-to-even
there (the 1.5 * 2^23 trick under the default rounding mode), `np.rint` here. Its sums are
numpy's (pairwise) rather than the C's left-to-right, so a tie between two candidate scales may be
decided the other way in rare sub-blocks (0.1% of the bytes), and it takes about 12x the C's
time on two threads (docs/packages.md).
tests/preparation/test_kquants.py holds both to gguf-py's dequantizer and to llama-quantize's
bytes on the same tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from flare.engine import native, native_quantized
from flare.package.blocks import GGMLType

QK_K = 256
Q4_K_BYTES = 144  # d, dmin (float16), 12 bytes of 6-bit scales and mins, 128 bytes of 4-bit quants
Q6_K_BYTES = 210  # 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales, d (float16)
_GROUP_MAX_EPS = np.float32(1e-15)
f32 = np.float32


def _nearest(values: np.ndarray) -> np.ndarray:
    return np.rint(values).astype(np.int32)


def _super_blocks(values: np.ndarray) -> np.ndarray:
    rows, width = values.shape
    if width % QK_K:
        raise ValueError(f"K-quants need widths that are multiples of {QK_K}, got {width}")
    return np.ascontiguousarray(values, dtype=np.float32).reshape(rows * width // QK_K, QK_K)


def _make_qkx2_quants(x: np.ndarray, weights: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`make_qkx2_quants(n, nmax, x, weights, L, &the_min, Laux, -1, 0.1, 20, false)` over rows of
    x [S, n]: (scale [S], the_min [S] (>= 0), L [S, n])."""
    minimum = np.minimum(x.min(axis=1), f32(0))
    maximum = x.max(axis=1)
    sum_w = weights.sum(axis=1, dtype=np.float32)
    sum_x = (weights * x).sum(axis=1, dtype=np.float32)
    flat = maximum == minimum
    span = np.where(flat, f32(1), maximum - minimum)
    iscale = f32(nmax) / span
    scale = f32(1) / iscale
    levels = np.clip(_nearest(iscale[:, None] * (x - minimum[:, None])), 0, nmax)
    diff = scale[:, None] * levels + minimum[:, None] - x
    best_error = (weights * diff * diff).sum(axis=1, dtype=np.float32)
    for step in range(21):
        # The C reads `min` as it stands: a better candidate's min moves the grid of later steps.
        span = np.where(flat, f32(1), maximum - minimum)
        trial_iscale = (f32(-1) + f32(0.1) * f32(step) + f32(nmax)) / span
        trial = np.clip(_nearest(trial_iscale[:, None] * (x - minimum[:, None])), 0, nmax).astype(np.float32)
        sum_l = (weights * trial).sum(axis=1, dtype=np.float32)
        sum_l2 = (weights * trial * trial).sum(axis=1, dtype=np.float32)
        sum_xl = (weights * trial * x).sum(axis=1, dtype=np.float32)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        safe_det = np.where(ok, det, f32(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe_det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe_det
        positive = this_min > 0
        this_scale = np.where(positive, sum_xl / np.where(sum_l2 > 0, sum_l2, f32(1)), this_scale)
        this_min = np.where(positive, f32(0), this_min)
        diff = this_scale[:, None] * trial + this_min[:, None] - x
        error = (weights * diff * diff).sum(axis=1, dtype=np.float32)
        better = ok & (error < best_error) & ~flat
        levels = np.where(better[:, None], trial.astype(np.int32), levels)
        best_error = np.where(better, error, best_error)
        scale = np.where(better, this_scale, scale)
        minimum = np.where(better, this_min, minimum)
    scale = np.where(flat, f32(0), scale).astype(np.float32)
    levels = np.where(flat[:, None], 0, levels)
    return scale, (-minimum).astype(np.float32), levels


def quantize_q4_k(values: np.ndarray) -> np.ndarray:
    """float32 [out, in] (in a multiple of 256) as Q4_K blocks, uint8 [out, in / 256 * 144]."""
    return _native_or_numpy(values, GGMLType.Q4_K, quantize_q4_k_numpy)


def quantize_q6_k(values: np.ndarray) -> np.ndarray:
    """float32 [out, in] (in a multiple of 256) as Q6_K blocks, uint8 [out, in / 256 * 210]."""
    return _native_or_numpy(values, GGMLType.Q6_K, quantize_q6_k_numpy)


def _native_or_numpy(values: np.ndarray, ggml_type: GGMLType, numpy_port: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    if not native.available():
        return numpy_port(values)
    # _super_blocks: the width's check in the numpy port's words, and contiguous float32 rows
    matrix = torch.from_numpy(_super_blocks(values).reshape(values.shape[0], -1))
    return native_quantized.quantize_kquant_rows(matrix, int(ggml_type)).numpy()


def quantize_q4_k_numpy(values: np.ndarray) -> np.ndarray:
    """quantize_q4_k in numpy."""
    rows = values.shape[0]
    x = _super_blocks(values).reshape(-1, 8, 32)
    blocks = x.shape[0]
    sub = x.reshape(-1, 32)
    average = np.sqrt((sub * sub).sum(axis=1, dtype=np.float32) / f32(32))
    weights = average[:, None] + np.abs(sub)
    scales, mins, levels = _make_qkx2_quants(sub, weights, 15)
    scales, mins, levels = scales.reshape(blocks, 8), mins.reshape(blocks, 8), levels.reshape(blocks, 8, 32)
    max_scale = np.maximum(scales.max(axis=1), f32(0))
    max_min = np.maximum(mins.max(axis=1), f32(0))
    inv_scale = np.where(max_scale > 0, f32(63) / np.where(max_scale > 0, max_scale, f32(1)), f32(0))
    inv_min = np.where(max_min > 0, f32(63) / np.where(max_min > 0, max_min, f32(1)), f32(0))
    # uint8 of the nearest integer, as the C stores it, then at most 63.
    ls = np.minimum(63, _nearest(inv_scale[:, None] * scales) & 0xFF).astype(np.uint8)
    lm = np.minimum(63, _nearest(inv_min[:, None] * mins) & 0xFF).astype(np.uint8)
    packed = np.zeros((blocks, 12), np.uint8)
    packed[:, 0:4] = ls[:, 0:4]
    packed[:, 4:8] = lm[:, 0:4]
    packed[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    packed[:, 0:4] |= (ls[:, 4:8] >> 4) << 6
    packed[:, 4:8] |= (lm[:, 4:8] >> 4) << 6
    d = (max_scale / f32(63)).astype(np.float16)
    dmin = (max_min / f32(63)).astype(np.float16)
    # The quants again, against the rounded scales and mins (get_scale_min_k4 gives back ls, lm).
    sub_d = d.astype(np.float32)[:, None] * ls.astype(np.float32)
    sub_m = dmin.astype(np.float32)[:, None] * lm.astype(np.float32)
    nonzero = sub_d != 0
    again = np.clip(_nearest((x + sub_m[:, :, None]) / np.where(nonzero, sub_d, f32(1))[:, :, None]), 0, 15)
    levels = np.where(nonzero[:, :, None], again, levels).astype(np.uint8).reshape(blocks, 4, 2, 32)
    quants = levels[:, :, 0, :] | (levels[:, :, 1, :] << 4)  # 64 values a chunk: low nibbles, then high
    out = np.empty((blocks, Q4_K_BYTES), np.uint8)
    out[:, 0:2] = d.reshape(-1, 1).view(np.uint8)
    out[:, 2:4] = dmin.reshape(-1, 1).view(np.uint8)
    out[:, 4:16] = packed
    out[:, 16:] = quants.reshape(blocks, 128)
    return out.reshape(rows, -1)


def _make_qx_quants_rmse1(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """`make_qx_quants(n, nmax, x, L, 1, NULL)` over rows of x [S, n]: (scale [S], L [S, n] in [0, 2 nmax))."""
    index = np.abs(x).argmax(axis=1)  # the first largest magnitude, as the C's strict >
    peak = np.take_along_axis(x, index[:, None], axis=1)[:, 0]
    zero = np.abs(peak) < _GROUP_MAX_EPS
    safe_peak = np.where(zero, f32(1), peak)
    weights = x * x

    def trial(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        levels = np.clip(_nearest(iscale[:, None] * x), -nmax, nmax - 1)
        as_float = levels.astype(np.float32)
        return levels, (weights * x * as_float).sum(axis=1, dtype=np.float32), (weights * as_float * as_float).sum(axis=1, dtype=np.float32)

    levels, sum_lx, sum_l2 = trial(f32(-nmax) / safe_peak)
    scale = np.where(sum_l2 != 0, sum_lx / np.where(sum_l2 != 0, sum_l2, f32(1)), f32(0)).astype(np.float32)
    best = scale * sum_lx
    for step in range(-9, 10):
        if step == 0:
            continue
        candidate, sum_lx, sum_l2 = trial(-(f32(nmax) + f32(0.1) * f32(step)) / safe_peak)
        better = (sum_l2 > 0) & (sum_lx * sum_lx > best * sum_l2)
        levels = np.where(better[:, None], candidate, levels)
        scale = np.where(better, sum_lx / np.where(sum_l2 > 0, sum_l2, f32(1)), scale).astype(np.float32)
        best = np.where(better, scale * sum_lx, best)
    scale = np.where(zero, f32(0), scale).astype(np.float32)
    levels = np.where(zero[:, None], 0, levels + nmax)
    return scale, levels


def quantize_q6_k_numpy(values: np.ndarray) -> np.ndarray:
    """quantize_q6_k in numpy."""
    rows = values.shape[0]
    x = _super_blocks(values).reshape(-1, 16, 16)
    blocks = x.shape[0]
    scales, levels = _make_qx_quants_rmse1(x.reshape(-1, 16), 32)
    scales, levels = scales.reshape(blocks, 16), levels.reshape(blocks, 16, 16)
    index = np.abs(scales).argmax(axis=1)
    max_scale = np.take_along_axis(scales, index[:, None], axis=1)[:, 0]
    empty = np.abs(max_scale) < _GROUP_MAX_EPS
    iscale = f32(-128) / np.where(empty, f32(1), max_scale)
    d = np.where(empty, f32(0), f32(1) / iscale).astype(np.float16)
    sub_scales = np.minimum(127, _nearest(iscale[:, None] * scales)).astype(np.int8)
    sub_d = d.astype(np.float32)[:, None] * sub_scales.astype(np.float32)
    nonzero = sub_d != 0
    again = np.clip(_nearest(x / np.where(nonzero, sub_d, f32(1))[:, :, None]), -32, 31) + 32
    levels = np.where(nonzero[:, :, None], again, levels).astype(np.uint8).reshape(blocks, 2, 4, 32)
    low = levels & 0xF
    high = levels >> 4
    ql = np.concatenate((low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)), axis=2)  # [B, 2, 64]
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)  # [B, 2, 32]
    out = np.zeros((blocks, Q6_K_BYTES), np.uint8)
    out[:, 0:128] = ql.reshape(blocks, 128)
    out[:, 128:192] = qh.reshape(blocks, 64)
    out[:, 192:208] = np.where(empty[:, None], 0, sub_scales).astype(np.int8).view(np.uint8)
    out[:, 208:210] = d.reshape(-1, 1).view(np.uint8)
    out[empty] = 0  # an all-zero super-block: the C zeroes the whole block
    return out.reshape(rows, -1)
