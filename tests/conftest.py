"""Shared test set-up.

TRITON_INTERPRET must be set before any module decorates a Triton kernel: the interpreter
mode is fixed at decoration time (../shared/notes/triton-on-cpu.md).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
