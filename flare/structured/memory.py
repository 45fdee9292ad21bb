"""The process's resident memory, and giving freed heap back to the system.

llguidance allocates a grammar's lexer and parser tables with the C allocator; glibc keeps what
they free in its arenas (a heavy pattern's ~150 MB stayed resident after the grammar was gone),
so the cache trims the heap after it drops grammars. Both are no-ops where they do not apply
(no /proc, no glibc)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from functools import cache


def resident_bytes() -> int:
    """The process's resident set (the second field of /proc/self/statm, in pages), or 0."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@cache
def _malloc_trim() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None  # not glibc


def give_back_heap() -> None:
    """Return the allocator's free memory to the system (glibc's malloc_trim(0))."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
