"""Linear layers multiplied straight from ggml's quantized blocks, as a GGUF stores them.

A `QuantizedWeight` is a layer's weight [out, in] as rows of ggml blocks (each row in / block
size blocks of the type's bytes, blocks running along the input dimension). Its values are
exactly what gguf-py's `gguf.quants.dequantize` gives for its blocks: `dequantize` returns those
float32 values, and `quantized_linear` multiplies float32 activations by them, summing in
float32, so a quantized package scores text as its own float32 dequantization does up to the
order of summation.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch

from flare.engine import native
from flare.engine.native import QUANTIZED_ISA
from flare.package.blocks import E8M0_NAN, E8M0_SCALE_OFFSETS, KEPT_TYPES, SCALE_OFFSETS


def supported_types() -> frozenset[gguf.GGMLQuantizationType]:
    """The ggml types a linear layer is served from as blocks; any other type is dequantized at export."""
    return KEPT_TYPES


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear layer's weight as ggml blocks: `data` is uint8 [out_features, row_bytes] (each row
    is in_features / block_size blocks of the ggml type, exactly as the GGUF stores them)."""

    ggml_type: gguf.GGMLQuantizationType
    data: torch.Tensor  # uint8, 2-D, may be a view onto an mmapped file: never copied here
    out_features: int
    in_features: int

    @classmethod
    def from_blocks(
        cls, ggml_type: gguf.GGMLQuantizationType | int, data: torch.Tensor, out_features: int, in_features: int
    ) -> QuantizedWeight:
        """The weight over `data` (not copied), or ValueError naming what does not fit: an
        unsupported type, a width that is not whole blocks, bytes of the wrong dtype or length."""
        try:
            ggml_type = gguf.GGMLQuantizationType(int(ggml_type))
        except ValueError:
            raise ValueError(f"unknown ggml type id {int(ggml_type)}") from None
        if ggml_type not in KEPT_TYPES:
            names = ", ".join(sorted(t.name for t in KEPT_TYPES))
            raise ValueError(f"ggml type {ggml_type.name} is not served from blocks (supported: {names})")
        block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        if out_features < 1 or in_features < 1 or in_features % block_size:
            raise ValueError(
                f"a {ggml_type.name} weight needs positive sizes and in_features a multiple of {block_size}, "
                f"got [{out_features}, {in_features}]"
            )
        row_bytes = in_features // block_size * type_size
        if data.dtype != torch.uint8 or data.device.type != "cpu" or tuple(data.shape) != (out_features, row_bytes):
            raise ValueError(
                f"{ggml_type.name} blocks of a [{out_features}, {in_features}] weight must be CPU uint8 "
                f"[{out_features}, {row_bytes}], got {data.device} {data.dtype} {tuple(data.shape)}"
            )
        if data.stride(1) != 1 or (out_features > 1 and data.stride(0) != row_bytes):
            raise ValueError(f"{ggml_type.name} blocks must be contiguous, got strides {data.stride()}")
        # A NaN or infinite scale makes every value of its block NaN or infinite: refused here,
        # at load, rather than surfacing as non-finite logits mid-request.
        block = _first_nonfinite_scale(ggml_type, data, type_size)
        if block >= 0:
            per_row = row_bytes // type_size
            raise ValueError(f"{ggml_type.name} block {block % per_row} of row {block // per_row} has a NaN or infinite scale")
        return cls(ggml_type, data, out_features, in_features)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, start: int, end: int) -> QuantizedWeight:
        """Rows ``start .. end - 1`` (a view: each row is its own blocks), e.g. a tensor-parallel
        rank's vocabulary shard of an LM head."""
        return QuantizedWeight.from_blocks(self.ggml_type, self.data[start:end], end - start, self.in_features)


def _first_nonfinite_scale(ggml_type: gguf.GGMLQuantizationType, data: torch.Tensor, type_size: int) -> int:
    """The first block of `data` whose float16 scale is NaN or infinite (its five exponent bits
    all ones), or whose E8M0 scale is NaN (0xFF), or -1."""
    if native.available():
        return native.quantized_first_nonfinite_scale(data, ggml_type, type_size)
    scales = data.view(-1, type_size)
    bad = torch.zeros(scales.shape[0], dtype=torch.bool)
    for offset in SCALE_OFFSETS.get(ggml_type, ()):
        bad |= (scales[:, offset + 1] & 0x7C) == 0x7C
    for offset in E8M0_SCALE_OFFSETS.get(ggml_type, ()):
        bad |= scales[:, offset] == E8M0_NAN
    found = bad.nonzero()
    return int(found[0]) if found.numel() else -1


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """The weight's values, float32 [out, in]: exactly gguf-py's `gguf.quants.dequantize`."""
    values = gguf.quants.dequantize(weight.data.numpy(), weight.ggml_type)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def dequantize_rows(weight: QuantizedWeight, rows: torch.Tensor, *, isa: int | None = None) -> torch.Tensor:
    """Rows `rows` (int64 indices, any shape) of the weight's values, float32 [*rows.shape, in]:
    the embedding lookup of a quantized (possibly tied) token embedding."""
    if rows.dtype != torch.int64 or rows.device.type != "cpu":
        raise ValueError(f"dequantize_rows: rows must be CPU int64, got {rows.device} {rows.dtype}")
    flat = rows.reshape(-1)
    # On the host: a decode round looks up one row, and two tensor reductions cost more than it.
    ids = flat.tolist()
    if ids and (min(ids) < 0 or max(ids) >= weight.out_features):
        raise ValueError(f"dequantize_rows: row ids must lie in [0, {weight.out_features}), got {min(ids)}..{max(ids)}")
    if native.available():
        values = native.quantized_rows(
            weight.data, weight.ggml_type, weight.in_features, flat.contiguous(), QUANTIZED_ISA if isa is None else isa
        )
    else:
        picked = weight.data.index_select(0, flat)
        values = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(picked.numpy(), weight.ggml_type)))
    return values.view(*rows.shape, weight.in_features)


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, *, isa: int | None = None) -> torch.Tensor:
    """x float32 [M, in] (rows contiguous) times the weight's values transposed: float32 [M, out].

    With the C kernels built (native.available()), quantized_linear.c: each output's sum in a
    fixed order, the same bits at every `isa` (default QUANTIZED_ISA) and whatever the other
    rows. Without them, float32 matmul over `dequantize` (the same values, torch's order)."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != weight.in_features:
        raise ValueError(
            f"quantized_linear: x must be a CPU float32 [rows, {weight.in_features}], "
            f"got {x.device} {x.dtype} {tuple(x.shape)}"
        )
    if not native.available():
        return x @ dequantize(weight).T
    if x.stride(1) != 1:
        x = x.contiguous()
    return native.quantized_linear(
        x, weight.data, weight.ggml_type, weight.out_features, weight.in_features, QUANTIZED_ISA if isa is None else isa
    )
