"""Typed reads of a GGUF file's metadata keys (`GGUFKeys`), each error naming the key, and the
float32 values GGUF stores read back as the decimals the converter was given
(`decimal_of_float32`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from flare.preparation.source import SourceError


class Metadata(Protocol):
    def get(self, key: str, default: Any = None) -> Any: ...

    def require(self, key: str) -> Any: ...


class GGUFKeys:
    """Typed reads of `{arch}.*` keys, each error naming the key."""

    def __init__(self, path: Path, metadata: Metadata, arch: str) -> None:
        self.path, self.metadata, self.arch = path, metadata, arch

    def _key(self, name: str) -> str:
        return name if name.startswith(("tokenizer.", "general.")) else f"{self.arch}.{name}"

    def _missing(self, key: str) -> SourceError:
        return SourceError(f"{self.path} lacks the GGUF metadata key {key}; it cannot be exported")

    def _bad(self, key: str, value: Any, wanted: str) -> SourceError:
        return SourceError(f"{self.path}: the GGUF metadata key {key} must be {wanted}, found {value!r}")

    def integer(self, name: str) -> int:
        """A required positive integer."""
        value = self.maybe_integer(name)
        if value is None:
            raise self._missing(self._key(name))
        return value

    def maybe_integer(self, name: str) -> int | None:
        """A positive integer, or None where the key is absent."""
        key = self._key(name)
        value = self.metadata.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise self._bad(key, value, "one positive integer")
        return value

    def token(self, key: str) -> int | None:
        """A token id, or None where the key is absent."""
        value = self.metadata.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise self._bad(key, value, "a token id")
        return value

    def number(self, name: str, *, default: float | None = None) -> float:
        """A positive number; `default` where the key is absent (required without one)."""
        value = self.maybe_number(name)
        if value is not None:
            return value
        if default is None:
            raise self._missing(self._key(name))
        return default

    def maybe_number(self, name: str, *, allow_zero: bool = False) -> float | None:
        """A positive (or, with allow_zero, non-negative) number, or None where the key is absent."""
        key = self._key(name)
        value = self.metadata.get(key)
        if value is None:
            return None
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value < 0
            or (value == 0 and not allow_zero)
        ):
            raise self._bad(key, value, "a positive number")
        return decimal_of_float32(value)


def decimal_of_float32(value: float) -> float:
    """The shortest decimal that names the float32 `value`: what the converter was given.

    GGUF stores these keys and RoPE factors as float32, so Hugging Face's rms_norm_eps 1e-06 is
    read back as 9.99999997e-07; the shortest decimal that rounds to the same float32 is the
    number written in config.json (1e-06), which the Hugging Face export of the same checkpoint
    holds too. Phi-3's longrope factors are such numbers; Llama 3.1's rope_freqs, computed by the
    converter, are kept as stored."""
    return float(str(np.float32(value)))
