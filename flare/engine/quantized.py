"""Linear layers multiplied straight from ggml's quantized blocks, as a GGUF stores them.

A `QuantizedWeight` is a layer's weight [out, in] as rows of ggml blocks (each row in / block
size blocks of the type's bytes, blocks running along the input dimension). Its values are
exactly what gguf-py's `gguf.quants.dequantize` gives for its blocks: `dequantize` returns those
float32 values, and `quantized_linear` multiplies float32 activations by them, summing in
float32, so a quantized package scores text as its own float32 dequantization does up to the
order of summation.

A weight may instead take 8-bit activations with integer dot products (integer_linear.c; for
the K types integer_kquants.c): each activation row quantized in blocks of 32 (Q8_0-like; 256 for
the K types, Q8_K) (`quantize_activations`, once per layer input, shared by the products that read
it), as one 8-bit block (`int8`, llama.cpp's Q8_0: it moves the default
model's logprobs by 0.06, too far) or two (`int8x2`: the value and its residual, about 15 bits,
3e-4). On the default package neither is faster than the float32 path at a decode round's few
rows; on a Q4_K_M file int8x2 takes 0.66-0.75x the float path's time per layer at 1 and at 8-64
rows (level at 4: the K products' wide tiles, integer_kquant_tiles.c, run from 6 activation
rows). `flare run` keeps float32 by default (`--activations`; docs/benchmarks.md has the figures).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import gguf
import numpy as np
import torch

from flare.engine import native, native_quantized
from flare.engine.native_quantized import INTEGER_ISA, QUANTIZED_ISA
from flare.package.blocks import E8M0_NAN, E8M0_SCALE_OFFSETS, KEPT_TYPES, SCALE_OFFSETS
from flare.package.manifest import ACTIVATIONS, INTEGER_ACTIVATION_TYPES, K_QUANT_TYPES, auto_activations

# What a quantized weight multiplies (manifest.ACTIVATIONS): 8-bit activation blocks with integer
# dot products, or the float32 activations themselves (exact). `flare run --activations` picks,
# auto by default (`served_activations`).
DEFAULT_ACTIVATIONS = "float32"
AUTO_ACTIVATIONS = "auto"
# 8-bit blocks per 32 activations of each integer precision.
HALVES = {"int8": 1, "int8x2": 2}
# The types with integer kernels: the 32-value ones (integer_linear.c) and the K types (integer_kquants.c).
INTEGER_TYPES = frozenset(gguf.GGMLQuantizationType[name] for name in INTEGER_ACTIVATION_TYPES)
# The K types: their integer products read 256-value Q8_K activation blocks.
K_TYPES = frozenset(gguf.GGMLQuantizationType[name] for name in K_QUANT_TYPES)


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
    activations: str = "float32"  # ACTIVATIONS: what `quantized_linear` multiplies the blocks by

    @classmethod
    def from_blocks(
        cls,
        ggml_type: gguf.GGMLQuantizationType | int,
        data: torch.Tensor,
        out_features: int,
        in_features: int,
        activations: str = "float32",
    ) -> QuantizedWeight:
        """The weight over `data` (not copied), or ValueError naming what does not fit: an
        unsupported type, a width that is not whole blocks, bytes of the wrong dtype or length,
        an activation precision not in ACTIVATIONS."""
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
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
        return cls(ggml_type, data, out_features, in_features, activations)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, start: int, end: int) -> QuantizedWeight:
        """Rows ``start .. end - 1`` (a view: each row is its own blocks), e.g. a tensor-parallel
        rank's vocabulary shard of an LM head."""
        return QuantizedWeight.from_blocks(self.ggml_type, self.data[start:end], end - start, self.in_features, self.activations)

    def with_activations(self, activations: str) -> QuantizedWeight:
        """The same blocks multiplied by `activations` (ACTIVATIONS)."""
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
        return replace(self, activations=activations)

    @property
    def halves(self) -> int:
        """8-bit activation blocks per 32 inputs `quantized_linear` multiplies this weight by with
        integer dot products (HALVES): 0 where it multiplies float32 activations (asked for, a type
        without integer kernels, or the kernels not built)."""
        if self.ggml_type not in INTEGER_TYPES or not native.available():
            return 0
        return HALVES.get(self.activations, 0)


def served_activations(weight_types: Mapping[str, Mapping[str, int]], activations: str) -> str:
    """What a package of `weight_types` (`Package.weight_types`: ggml names and bytes) multiplies its blocks
    by when `activations` (manifest.ACTIVATION_CHOICES) is asked for: int8x2 or int8 where a block
    type with integer kernels is among them and the kernels are built, else float32
    (`engine_loaded`, `ctl status`); auto as `manifest.auto_activations` chooses. Every rank of a
    tensor-parallel group resolves it alike."""
    types = set(weight_types)
    if activations == AUTO_ACTIVATIONS:
        activations = auto_activations(weight_types)
    integer = set(INTEGER_ACTIVATION_TYPES) & types
    return activations if activations in HALVES and native.available() and integer else DEFAULT_ACTIVATIONS


def _first_nonfinite_scale(ggml_type: gguf.GGMLQuantizationType, data: torch.Tensor, type_size: int) -> int:
    """The first block of `data` whose float16 scale is NaN or infinite (its five exponent bits
    all ones), or whose E8M0 scale is NaN (0xFF), or -1."""
    if native.available():
        return native_quantized.quantized_first_nonfinite_scale(data, ggml_type, type_size)
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
        values = native_quantized.quantized_rows(
            weight.data, weight.ggml_type, weight.in_features, flat.contiguous(), QUANTIZED_ISA if isa is None else isa
        )
    else:
        picked = weight.data.index_select(0, flat)
        values = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(picked.numpy(), weight.ggml_type)))
    return values.view(*rows.shape, weight.in_features)


def activation_blocks(weight: QuantizedWeight) -> tuple[int, bool]:
    """What a weight's integer products read of their input: (halves, whether Q8_K blocks of 256
    rather than blocks of 32); products with the same key share one `quantize_activations`."""
    return weight.halves, weight.ggml_type in K_TYPES


def quantize_activations(x: torch.Tensor, blocks: tuple[int, bool]) -> torch.Tensor:
    """Rows of x [M, in] (float32) as the 8-bit activation blocks of `blocks` (`activation_blocks`):
    halves blocks per 32 (`native_quantized.quantize_q8`) or per 256 (`native_quantized.quantize_q8k_rows`), what
    every integer product of this input reads, so a layer quantizes its input once."""
    halves, k_blocks = blocks
    x = x if x.stride(1) == 1 else x.contiguous()
    return native_quantized.quantize_q8k_rows(x, halves, INTEGER_ISA) if k_blocks else native_quantized.quantize_q8(x, halves)


def quantized_linear(
    x: torch.Tensor, weight: QuantizedWeight, *, isa: int | None = None, activations: torch.Tensor | None = None
) -> torch.Tensor:
    """x float32 [M, in] (rows contiguous) times the weight's values transposed: float32 [M, out].

    With the C kernels built (native.available()), quantized_linear.c: each output's sum in a
    fixed order, the same bits at every `isa` (default QUANTIZED_ISA) and whatever the other
    rows. Without them, float32 matmul over `dequantize` (the same values, torch's order).

    A weight with `halves` multiplies x's 8-bit blocks instead (integer_linear.c, at INTEGER_ISA
    unless `isa` names an IDOT_* level; integer_kquants.c for the K types): `activations`,
    `quantize_activations(x, activation_blocks(weight))` when the caller shares them between
    products, else quantized here."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != weight.in_features:
        raise ValueError(
            f"quantized_linear: x must be a CPU float32 [rows, {weight.in_features}], "
            f"got {x.device} {x.dtype} {tuple(x.shape)}"
        )
    if not native.available():
        return x @ dequantize(weight).T
    if weight.halves:
        xq = quantize_activations(x, activation_blocks(weight)) if activations is None else activations
        product = native_quantized.integer_kquant_linear if weight.ggml_type in K_TYPES else native_quantized.integer_linear
        return product(xq, weight.data, weight.ggml_type, weight.out_features, weight.in_features, INTEGER_ISA if isa is None else isa)
    if x.stride(1) != 1:
        x = x.contiguous()
    return native_quantized.quantized_linear(
        x, weight.data, weight.ggml_type, weight.out_features, weight.in_features, QUANTIZED_ISA if isa is None else isa
    )
