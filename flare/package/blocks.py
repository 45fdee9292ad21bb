"""Quantized tensors kept as ggml blocks in a package: the types kept, their checks, and the
blocks file (`model.blocks`).

A kept tensor is a linear weight (or the token embedding) [out, in], or a mixture-of-experts
layer's stacked experts [experts, out, in] (E * out rows, expert after expert), whose rows are
in / block size blocks of a ggml type, byte for byte as llama.cpp lays them out (ggml-common.h). The
blocks file holds the kept tensors back to back, each at the offset the manifest gives
(`manifest.BlockEntry`), in the order of `package.expected_weight_shapes`: the q, k and v
projections of a layer (and gate and up) lie next to each other, so a layer whose three share
a type is multiplied as one matrix straight from the file. Nothing is padded: ggml blocks are
18 to 210 bytes, so the kernels load them unaligned anyway.

`flare run` maps the file read-only (copy-on-write, never written) and gives each tensor as a
uint8 view into the mapping: the weights stay page cache, shared with every process that maps
the same package, and never become anonymous memory.
"""

from __future__ import annotations

import mmap
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from flare.package.manifest import BlockEntry
from flare.package.problems import capped

BLOCKS_NAME = "model.blocks"

GGMLType = gguf.GGMLQuantizationType

# Byte offsets of the float16 scales (d, and dmin where the type has one) inside one block of each
# type the engine multiplies from blocks (ggml-common.h: block_q4_0 ... block_q6_K). These are the
# types kept at export; any other type is dequantized to float32 there. The engine's
# `quantized.supported_types()` is held equal to these keys by tests/package/test_blocks.py.
SCALE_OFFSETS: dict[GGMLType, tuple[int, ...]] = {
    GGMLType.Q4_0: (0,),
    GGMLType.Q4_1: (0, 2),
    GGMLType.Q5_0: (0,),
    GGMLType.Q5_1: (0, 2),
    GGMLType.Q8_0: (0,),
    GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (208,),
}
# Byte offsets of the E8M0 scale (one exponent byte, 2^(e - 127); 0xFF is NaN in OCP MX v1.0)
# inside a block of the microscaling types: MXFP4 (gpt-oss's experts: the scale, then 16 bytes
# of E2M1 nibbles).
E8M0_SCALE_OFFSETS: dict[GGMLType, tuple[int, ...]] = {GGMLType.MXFP4: (0,)}
E8M0_NAN = 0xFF
KEPT_TYPES = frozenset(SCALE_OFFSETS) | frozenset(E8M0_SCALE_OFFSETS)


class BlocksError(ValueError):
    """Block data that cannot be kept or served; the message names the tensor."""


@dataclass(frozen=True)
class BlockTensor:
    """A weight [out, in] (or stacked experts [E, out, in]) as ggml blocks: `data` uint8
    [rows, row_bytes], rows = out (E * out), possibly a view into the mapped blocks file."""

    ggml_type: GGMLType
    data: torch.Tensor
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def kernelless_tensors(dequantized: Mapping[str, str], blocks: Mapping[str, object]) -> dict[str, str]:
    """The tensors a package of blocks stores as float32 for want of a kernel, name to source type
    (a Q3_K_M file's Q3_K ones, exported under --dtype auto), from its manifest's `dequantized` and
    `blocks`. Not those `--quantize` stored as blocks, nor a kept type joined with another tensor
    into one float (DeepSeek's latent k_b and v_b, experts' gate and up of two types), nor any in a
    package a named --dtype dequantized whole (no blocks): `flare export`'s note and `flare run`'s
    `weights_dequantized` warning name these. `flare inspect` says why each dequantized tensor is
    float, and calls a type without a kernel one in a package without blocks too (an FP8
    checkpoint's tensors), where nothing here tells a --dtype's choice from the type's lack."""
    if not blocks:
        return {}
    kept = {t.name for t in KEPT_TYPES}
    return {name: kind for name, kind in dequantized.items() if name not in blocks and kind not in kept}


def row_bytes(ggml_type: GGMLType, in_features: int) -> int | None:
    """Bytes of one row of `in_features` values in `ggml_type`, or None when the width is not whole blocks."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    return None if in_features % block_size else in_features // block_size * type_size


def type_named(name: str) -> GGMLType | None:
    """The ggml type a manifest names, or None for a name this flare does not know."""
    return GGMLType.__members__.get(name)


def block_problems(name: str, ggml_type: GGMLType, data: np.ndarray, shape: tuple[int, int]) -> list[str]:
    """Why `data` cannot be served as the blocks of tensor `name` [out, in] in `ggml_type`: a type
    without a kernel, a length that is not the shape's, a NaN or infinite float16 scale (d or dmin)
    or a NaN E8M0 scale (MXFP4) in any block. Empty when the blocks are servable. The scale check reads the scales of every
    block as one strided float16 view: no Python loop over blocks."""
    if ggml_type not in KEPT_TYPES:
        kept = ", ".join(sorted(t.name for t in KEPT_TYPES))
        return [f"tensor {name}: ggml type {ggml_type.name} is not served from blocks (served: {kept})"]
    out_features, in_features = shape
    width = row_bytes(ggml_type, in_features)
    if width is None:
        block_size = gguf.GGML_QUANT_SIZES[ggml_type][0]
        return [f"tensor {name}: width {in_features} is not a whole number of {ggml_type.name} blocks of {block_size}"]
    expected = out_features * width
    if data.nbytes != expected:
        return [
            f"tensor {name}: {ggml_type.name} blocks of a {list(shape)} weight take {expected} bytes, "
            f"the data has {data.nbytes}"
        ]
    type_size = gguf.GGML_QUANT_SIZES[ggml_type][1]
    blocks = np.ascontiguousarray(data).reshape(-1).view(np.uint8).reshape(-1, type_size)
    for offset in E8M0_SCALE_OFFSETS.get(ggml_type, ()):
        bad = blocks[:, offset] == E8M0_NAN
        if bad.any():
            block = int(np.argmax(bad))
            return [
                f"tensor {name}: {int(bad.sum())} block(s) have a NaN scale "
                f"(first: block {block}, row {block * type_size // width}, E8M0 byte 0xff)"
            ]
    for offset in SCALE_OFFSETS.get(ggml_type, ()):
        scales = blocks[:, offset : offset + 2].copy().view(np.float16).reshape(-1)
        bad = ~np.isfinite(scales)
        if bad.any():
            block = int(np.argmax(bad))
            return [
                f"tensor {name}: {int(bad.sum())} block(s) have a NaN or infinite scale "
                f"(first: block {block}, row {block * type_size // width}, value {scales[block]})"
            ]
    return []


def write_blocks(path: Path, tensors: Mapping[str, BlockTensor], order: list[str]) -> dict[str, BlockEntry]:
    """Write `tensors` back to back to `path`, in `order` (names not in `tensors` are skipped),
    and return where each lies."""
    entries: dict[str, BlockEntry] = {}
    offset = 0
    with open(path, "wb") as file:
        for name in order:
            if name not in tensors:
                continue
            tensor = tensors[name]
            data = tensor.data.contiguous().numpy().tobytes()
            file.write(data)
            entries[name] = BlockEntry(type=tensor.ggml_type.name, offset=offset, nbytes=len(data))
            offset += len(data)
    return entries


def entry_problems(name: str, entry: BlockEntry, shape: tuple[int, ...], file_size: int) -> list[str]:
    """What a manifest entry gets wrong against the model's shape for `name` and the file's size."""
    ggml_type = type_named(entry.type)
    if ggml_type is None:
        return [f"tensor {name}: unknown ggml type {entry.type!r}"]
    if ggml_type not in KEPT_TYPES:
        kept = ", ".join(sorted(t.name for t in KEPT_TYPES))
        return [f"tensor {name}: ggml type {entry.type} is not served from blocks (served: {kept})"]
    if len(shape) not in (2, 3):
        return [f"tensor {name}: only a matrix or stacked experts can be kept as blocks, its shape is {list(shape)}"]
    rows = _rows(shape)
    width = row_bytes(ggml_type, shape[-1])
    if width is None or entry.nbytes != rows * width:
        expected = "no whole number of blocks" if width is None else f"{rows * width} bytes"
        return [f"tensor {name}: {entry.type} blocks of a {list(shape)} weight take {expected}, the manifest says {entry.nbytes}"]
    if entry.offset + entry.nbytes > file_size:
        return [f"tensor {name}: its blocks end at byte {entry.offset + entry.nbytes}, past the end of {BLOCKS_NAME} ({file_size} bytes)"]
    return []


# Python 3.11's mmap has no MAP_NORESERVE: Linux's value.
_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_HUGE_PAGE = 2 << 20


def map_blocks(
    path: Path, entries: Mapping[str, BlockEntry], shapes: Mapping[str, tuple[int, ...]], *, huge_pages: bool = False
) -> dict[str, BlockTensor]:
    """The tensors of the blocks file at `path` as uint8 views into one mapping of it.

    The mapping is private and never written (writable only so that torch takes it as a
    writable buffer without a warning): its pages are the file's page cache, not anonymous
    memory. The views keep the mapping alive. With `huge_pages`, the matrices (not stacked
    experts, which stay mapped) move into `in_huge_pages`' memory instead. Raises BlocksError
    naming the tensor for an entry that does not fit the file, or blocks with a NaN or infinite
    scale."""
    if not entries:
        return {}
    size = path.stat().st_size
    problems = [p for name, entry in entries.items() for p in entry_problems(name, entry, shapes[name], size)]
    if problems:
        raise BlocksError("; ".join(capped(problems)))
    with open(path, "rb") as file:
        # Private and writable without reserving memory for copies never made: a writable
        # private mapping counts against the commit limit, which refused a file larger than the
        # machine's memory (ENOMEM).
        mapping = mmap.mmap(
            file.fileno(), 0, flags=mmap.MAP_PRIVATE | _NORESERVE, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    tensors = {}
    for name, entry in entries.items():
        ggml_type = GGMLType[entry.type]
        shape = tuple(shapes[name])
        data = whole[entry.offset : entry.offset + entry.nbytes].view(_rows(shape), -1)
        problems = block_problems(name, ggml_type, data.numpy(), (_rows(shape), shape[-1]))
        if problems:
            raise BlocksError("; ".join(problems))
        tensors[name] = BlockTensor(ggml_type, data, shape)
    if huge_pages:
        tensors.update(in_huge_pages(mapping, {name: t for name, t in tensors.items() if len(t.shape) == 2}))
    return tensors


def in_huge_pages(mapping: mmap.mmap, tensors: Mapping[str, BlockTensor]) -> dict[str, BlockTensor]:
    """`tensors` (views into `mapping`) copied into one private anonymous mapping that asks for
    transparent huge pages, their pages of `mapping` then dropped from this process.

    Why: a decode token streams every weight once, and with 4 KiB pages each 4 KiB is a TLB miss
    and a stop for the hardware prefetcher. Whether the page cache maps a file's pages 2 MiB at
    a time depends on its history (how the file was last read, what was evicted), so a mapped
    package's one-stream speed did too; in anonymous huge pages it does not (docs/benchmarks.md,
    "The default, `--activations auto`"). The resident memory stays the file's:
    each copied byte's file page is released (MADV_DONTNEED on a private mapping that was never
    written drops the page from this process; the page cache keeps it for whoever reads it next).
    Stacked experts are not passed here: most of an expert's pages are idle in any round, and a
    17 GiB file must serve from its mapping."""
    if not tensors:
        return {}
    # As long as the file, each tensor at its own offset: blocks the file keeps next to each
    # other (a layer's q, k and v) stay so, to be multiplied as one matrix (`linear._join_blocks`).
    # Only the matrices' pages are ever touched, and no commit is reserved for the rest (a MoE
    # file may be larger than the machine's memory). Where even that is refused, they stay mapped.
    try:
        length = (len(mapping) + _HUGE_PAGE - 1) // _HUGE_PAGE * _HUGE_PAGE
        memory = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _NORESERVE)
    except OSError:
        return {}
    whole = torch.frombuffer(memory, dtype=torch.uint8)
    base = torch.frombuffer(mapping, dtype=torch.uint8).data_ptr()
    # Huge pages only inside each run of adjacent matrices: a 2 MiB page across a run's edge would
    # be resident whole, part of it the experts' bytes, which stay in the mapping.
    spans = sorted((t.data.data_ptr() - base, t.data.data_ptr() - base + t.data.numel()) for t in tensors.values())
    runs: list[list[int]] = []
    for start, end in spans:
        if runs and start <= runs[-1][1] + 64:
            runs[-1][1] = max(runs[-1][1], end)
        else:
            runs.append([start, end])
    for start, end in runs:
        first, last = (start + _HUGE_PAGE - 1) // _HUGE_PAGE * _HUGE_PAGE, end // _HUGE_PAGE * _HUGE_PAGE
        if last > first:
            memory.madvise(mmap.MADV_HUGEPAGE, first, last - first)
    moved = {}
    for name, tensor in tensors.items():
        offset, n = tensor.data.data_ptr() - base, tensor.data.numel()
        copy = whole[offset : offset + n].view(tensor.data.shape)
        copy.copy_(tensor.data)
        # The whole pages of the source: the copy is this tensor's only reader from now on.
        first, last = (offset + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE, (offset + n) // mmap.PAGESIZE * mmap.PAGESIZE
        if last > first:
            mapping.madvise(mmap.MADV_DONTNEED, first, last - first)
        moved[name] = BlockTensor(tensor.ggml_type, copy, tensor.shape)
    return moved


def _rows(shape: tuple[int, ...]) -> int:
    """Rows of blocks of a weight [out, in] or of stacked experts [E, out, in]."""
    return shape[0] * shape[1] if len(shape) == 3 else shape[0]


def dequantized(tensor: BlockTensor) -> torch.Tensor:
    """The tensor's values as float32 of its shape, exactly gguf-py's `dequantize` of its blocks."""
    values = gguf.quants.dequantize(tensor.data.numpy(), tensor.ggml_type)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(tensor.shape)


def mxfp4_from_openai(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """gpt-oss's Hugging Face MXFP4 tensors (`*_blocks` uint8 [..., rows, groups, 16] and
    `*_scales` uint8 [..., rows, groups]) as ggml MXFP4 rows, uint8 [..., rows, groups * 17]:
    the same values, repacked. Both hold a group of 32 values as an E8M0 scale and 16 bytes of
    E2M1 nibbles, and mean the same number by them (OpenAI's table E2M1's values times
    2^(s - 127), ggml's the doubled values times 2^(s - 128)), so the scale byte is copied. The
    nibbles move: OpenAI's byte k holds values 2k (low nibble) and 2k + 1 (high), ggml's byte j
    values j (low) and j + 16 (high)."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise BlocksError(
            f"MXFP4 blocks must be uint8 [..., groups, 16] with uint8 scales [..., groups], got {blocks.dtype} "
            f"{list(blocks.shape)} and {scales.dtype} {list(scales.shape)}"
        )
    values = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)  # value i at i
    nibbles = values[..., :16] | (values[..., 16:] << 4)
    packed = np.concatenate([scales[..., None], nibbles.astype(np.uint8)], axis=-1)
    return packed.reshape(*blocks.shape[:-2], blocks.shape[-2] * 17)


def unpermute_block_rows(tensor: BlockTensor, num_heads: int) -> BlockTensor:
    """`gguf_source.unpermute_rope_rows` on block rows: blocks run along the input dimension, so
    putting the output rows of q or k back in Hugging Face order moves whole rows of blocks,
    which is exact on the uint8 rows."""
    rows, width = tensor.data.shape
    head_dim = rows // num_heads
    data = tensor.data.reshape(num_heads, head_dim // 2, 2, width).transpose(1, 2).reshape(rows, width).contiguous()
    return BlockTensor(tensor.ggml_type, data, tensor.shape)
