"""A GGUF file's layout, walked with every count and length bounded by the file's size.

gguf-py's reader trusts the file: a count of 2^62 tensors, or a string said to be 2^62 bytes
long, is read as if it were there, and a file cut short fails deep inside numpy with an
IndexError. llama.cpp's `gguf_init` instead checks each count and length against what is left
of the file before it allocates. `read_gguf_layout` does that walk first (GGUF v2 and v3:
header, key-value pairs, tensor infos, then every tensor's data range against the file's end);
anything that does not hold is a `GGUFLayoutError` with one line naming the file, the byte
offset, the field and what was wrong. `open_gguf` then reads the values (`read_gguf_value`) and
tensors where the walk found them, as gguf-py's reader gives them, without that reader: it builds
a numpy view of every string in the file, seconds on a vocabulary of 50k tokens or more.

Format (little-endian; ggml/docs/gguf.md): "GGUF", version u32, tensor_count u64, kv_count
u64; kv_count times (key: string, value type u32, value); tensor_count times (name: string,
n_dims u32, n_dims dims u64, ggml type u32, offset u64); padding to `general.alignment`
(default 32); the tensors' data. A string is a u64 length and that many bytes; an array is an
element type u32, a count u64 and the elements.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from flare.preparation.source import SourceError

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
# Value types (GGUFValueType) and the bytes a value of each takes; strings and arrays vary.
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
# The fewest bytes one item can take, to bound a count by the bytes left before reading any:
# a string is at least its length field; an array at least its type and count; a key-value pair
# at least a key's length, a type and a one-byte value; a tensor info at least a name's length,
# n_dims, one dimension, a type and an offset.
_MIN_STRING = 8
_MIN_ARRAY = 12
_MIN_KV = _MIN_STRING + 4 + 1
_MIN_TENSOR_INFO = _MIN_STRING + 4 + 8 + 4 + 8


class GGUFLayoutError(SourceError):
    """A GGUF file whose structure does not hold; the message is one line."""


@dataclass(frozen=True)
class GGUFField:
    """One key-value pair: where its value begins (after the key and the type)."""

    key: str
    value_type: int
    key_offset: int
    value_offset: int


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor: its dimensions as GGUF lists them (innermost first), its ggml type, and where
    its data lies in the file (checked to lie inside it)."""

    name: str
    dims: tuple[int, ...]
    kind: GGMLQuantizationType
    data_start: int
    data_bytes: int


@dataclass(frozen=True)
class GGUFLayout:
    version: int
    tensor_count: int
    kv_count: int
    fields: dict[str, GGUFField] = field(default_factory=dict)
    data_offset: int = 0
    tensors: tuple[GGUFTensorInfo, ...] = ()


class _Walker:
    def __init__(self, path: Path, data: bytes | mmap.mmap) -> None:
        self.path = path
        self.data = data
        self.size = len(data)
        self.offset = 0

    def fail(self, offset: int, what: str, why: str) -> GGUFLayoutError:
        return GGUFLayoutError(f"{self.path} is not a readable GGUF file: at byte {offset}, {what}: {why}")

    def take(self, n: int, what: str) -> int:
        """The offset of the next `n` bytes, which must lie inside the file."""
        start = self.offset
        if n > self.size - start:
            raise self.fail(
                start, what, f"needs {n} bytes but the file ends {self.size - start} bytes later (truncated?)"
            )
        self.offset += n
        return start

    def unpack(self, fmt: str, what: str) -> int:
        start = self.take(struct.calcsize(fmt), what)
        return struct.unpack_from(fmt, self.data, start)[0]

    def count(self, what: str, minimum_item: int) -> int:
        """A u64 count of items of at least `minimum_item` bytes each, bounded by the bytes left."""
        start = self.offset
        number = self.unpack("<Q", what)
        left = self.size - self.offset
        if number > left // minimum_item:
            raise self.fail(
                start,
                what,
                f"{number} is more than the {left} bytes left in the file can hold "
                f"(each takes at least {minimum_item} bytes)",
            )
        return number

    def string(self, what: str) -> str:
        start = self.offset
        length = self.unpack("<Q", f"{what} (its length)")
        if length > self.size - self.offset:
            raise self.fail(
                start,
                what,
                f"a string of {length} bytes, but the file ends {self.size - self.offset} bytes later",
            )
        raw = bytes(self.data[self.offset : self.offset + length])
        self.offset += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise self.fail(start, what, f"the string is not UTF-8 ({error.reason} at its byte {error.start})") from None

    def skip_string(self, what: str, index: int) -> None:
        """Element `index` of the string array `what`, bounds-checked but not decoded (a
        vocabulary holds some hundred thousand: this is the walk's hot loop)."""
        start = self.offset
        left = self.size - start - 8
        if left < 0:
            raise self.fail(start, f"{what}[{index}]", "its length runs past the end of the file (truncated?)")
        length = struct.unpack_from("<Q", self.data, start)[0]
        if length > left:
            raise self.fail(
                start, f"{what}[{index}]", f"a string of {length} bytes, but the file ends {left} bytes later"
            )
        self.offset = start + 8 + length

    def value(self, value_type: int, what: str) -> None:
        """Skip one value of `value_type`, checking it lies inside the file."""
        if value_type in _FIXED:
            self.take(_FIXED[value_type], what)
        elif value_type == _STRING:
            self.string(what)
        elif value_type == _ARRAY:
            start = self.offset
            element_type = self.unpack("<I", f"{what} (its element type)")
            if element_type in _FIXED:
                number = self.count(f"{what} (its element count)", _FIXED[element_type])
                self.take(number * _FIXED[element_type], what)
            elif element_type == _STRING:
                number = self.count(f"{what} (its element count)", _MIN_STRING)
                for index in range(number):
                    self.skip_string(what, index)
            elif element_type == _ARRAY:
                number = self.count(f"{what} (its element count)", _MIN_ARRAY)
                for index in range(number):
                    self.value(element_type, f"{what}[{index}]")
            else:
                raise self.fail(start, what, f"unknown array element type {element_type}")
        else:
            raise self.fail(self.offset - 4, what, f"unknown value type {value_type}")


def read_gguf_layout(path: Path) -> GGUFLayout:
    """The layout of the GGUF file at `path`; GGUFLayoutError (one line) where it does not hold."""
    path = Path(path)
    with open(path, "rb") as file:
        size = file.seek(0, 2)
        if size == 0:
            raise GGUFLayoutError(f"{path} is not a readable GGUF file: it is empty")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _walk(_Walker(path, data))


def _walk(walker: _Walker) -> GGUFLayout:
    magic = bytes(walker.data[walker.take(4, "the magic") : 4])
    if magic != MAGIC:
        raise walker.fail(0, "the magic", f"expected {MAGIC!r}, found {magic!r}")
    version = walker.unpack("<I", "the version")
    if version not in SUPPORTED_VERSIONS:
        raise walker.fail(4, "the version", f"version {version} is not one of {SUPPORTED_VERSIONS}")
    tensor_count = walker.count("tensor_count", _MIN_TENSOR_INFO)
    kv_count = walker.count("kv_count", _MIN_KV)
    fields: dict[str, GGUFField] = {}
    for index in range(kv_count):
        key_offset = walker.offset
        key = walker.string(f"the key of key-value pair {index}")
        value_type = walker.unpack("<I", f"the value type of {key}")
        value_offset = walker.offset
        walker.value(value_type, key)
        if key in fields:
            raise walker.fail(key_offset, key, "the key appears twice")
        fields[key] = GGUFField(key, value_type, key_offset, value_offset)
    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in fields:
        entry = fields["general.alignment"]
        alignment = struct.unpack_from("<I", walker.data, entry.value_offset)[0] if entry.value_type == 4 else 0
        if alignment == 0 or alignment & (alignment - 1):
            raise walker.fail(entry.key_offset, "general.alignment", "must be a u32 power of two")
    tensors = []
    for index in range(tensor_count):
        start = walker.offset
        name = walker.string(f"the name of tensor {index}")
        n_dims = walker.unpack("<I", f"the dimension count of tensor {name}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise walker.fail(start, f"tensor {name}", f"{n_dims} dimensions (1 to {MAX_DIMS} are possible)")
        dims = [walker.unpack("<Q", f"dimension {d} of tensor {name}") for d in range(n_dims)]
        kind = walker.unpack("<I", f"the type of tensor {name}")
        offset = walker.unpack("<Q", f"the data offset of tensor {name}")
        tensors.append((start, name, dims, kind, offset))
    data_offset = -(-walker.offset // alignment) * alignment
    infos: dict[str, GGUFTensorInfo] = {}
    for start, name, dims, kind, offset in tensors:
        try:
            ggml_type = GGMLQuantizationType(kind)
            block, block_bytes = GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise walker.fail(start, f"tensor {name}", f"unknown ggml type {kind}") from None
        if name in infos:
            raise walker.fail(start, f"tensor {name}", "the name appears twice")
        elements = 1
        for dim in dims:
            elements *= dim
        if dims[0] % block:
            raise walker.fail(start, f"tensor {name}", f"its rows of {dims[0]} are not whole blocks of {block}")
        end = data_offset + offset + elements // block * block_bytes
        infos[name] = GGUFTensorInfo(name, tuple(dims), ggml_type, data_offset + offset, elements // block * block_bytes)
        if offset % alignment or end > walker.size:
            raise walker.fail(
                start,
                f"tensor {name}",
                f"its data (bytes {data_offset + offset} to {end}) lies outside the file of {walker.size} bytes"
                if end > walker.size
                else f"its data offset {offset} is not a multiple of the alignment {alignment}",
            )
    return GGUFLayout(version, tensor_count, kv_count, fields, data_offset, tuple(infos.values()))


# numpy's dtype of each fixed-size value type (gguf-py GGUFValueType).
_NUMPY_TYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}


def read_gguf_value(data: bytes | mmap.mmap | np.ndarray, entry: GGUFField) -> Any:
    """The value of a key-value pair of a file whose layout holds, as gguf-py's
    `ReaderField.contents()` gives it: a str, int, float or bool, or a list of them (arrays of
    arrays, which no key flare reads holds, are refused). Decoded here rather than by gguf-py's
    reader, which builds a numpy view of every string of the file and takes seconds on a
    vocabulary of 50k to 250k tokens."""
    buffer = memoryview(data).cast("B") if isinstance(data, np.ndarray) else data

    def string(offset: int) -> tuple[str, int]:
        length = struct.unpack_from("<Q", buffer, offset)[0]
        return bytes(buffer[offset + 8 : offset + 8 + length]).decode("utf-8"), offset + 8 + length

    if entry.value_type == _STRING:
        return string(entry.value_offset)[0]
    if entry.value_type != _ARRAY:
        return np.frombuffer(buffer, _NUMPY_TYPES[entry.value_type], 1, entry.value_offset).tolist()[0]
    element_type, count = struct.unpack_from("<IQ", buffer, entry.value_offset)
    offset = entry.value_offset + 12
    if element_type in _NUMPY_TYPES:
        return np.frombuffer(buffer, _NUMPY_TYPES[element_type], count, offset).tolist()
    if element_type != _STRING:
        raise ValueError(f"{entry.key} is an array of arrays")
    items = []
    for _ in range(count):
        item, offset = string(offset)
        items.append(item)
    return items
