"""The sampler's CPU kernels (flare/kernels/csrc/, module `flare.kernels._native`), checked and
called on tensors.

- `stream_uniforms` and `top_p_threshold`: the sampler's random stream over whole vocabulary rows
  and its top-p radix select, the bits of their torch twins (random_stream.py, distribution.py;
  one pass where those take ten, and a 2048-bin histogram in cache where they call bincount).

The extension is optional, as the engine's is: where it was not built (no C compiler at install
time) the twins run. The kernels trust the addresses they are given, so every function here
first checks the tensors behind them; they release the GIL and run on `torch.get_num_threads()`
threads.
"""

from __future__ import annotations

import torch

try:
    from flare.kernels import _native
except ImportError:  # built without a C compiler: the torch twins run
    _native = None


def available() -> bool:
    """Whether the kernels were built and import."""
    return _native is not None


def _module():
    if _native is None:
        raise RuntimeError("the sampler's CPU kernels were not built; the torch twins must be used")
    return _native


def stream_uniforms(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The random stream's uniforms u = ((mix32(key + i GOLDEN) >> 8) + 0.5) 2^-24 at every
    vocabulary index i of every stream, [rows, vocab_size] float32: the bits of the torch twin's
    `uniform`-and-`gumbel_` steps before their logarithms (random_stream.py)."""
    native = _module()
    if keys.dtype != torch.int32 or keys.device.type != "cpu" or keys.dim() != 1 or not keys.is_contiguous():
        raise ValueError(f"stream_uniforms: keys must be a contiguous CPU int32 [rows], got {keys.device} {keys.dtype} {tuple(keys.shape)}")
    out = torch.empty(keys.shape[0], vocab_size, dtype=torch.float32)
    native.stream_uniforms(keys.data_ptr(), keys.shape[0], vocab_size, out.data_ptr(), torch.get_num_threads())
    return out


def top_p_threshold(scaled: torch.Tensor, mass: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row of `scaled` [N, V], the largest logit whose tokens carry at least `target` [N] of
    `mass` [N, V] (float32, contiguous): the bits of the torch twin's radix select
    (distribution.py, `_largest_reaching_mass`)."""
    native = _module()
    rows, vocab = scaled.shape
    problems = [
        f"{name} must be a CPU torch.float32 tensor, got {tensor.device} {tensor.dtype}"
        for name, tensor in (("scaled", scaled), ("mass", mass), ("target", target))
        if tensor.device.type != "cpu" or tensor.dtype != torch.float32
    ]
    if mass.shape != scaled.shape or target.shape != (rows,) or not all(t.is_contiguous() for t in (scaled, mass, target)):
        problems.append(f"scaled and mass must be contiguous [{rows}, {vocab}] and target [{rows}]")
    if problems:
        raise ValueError("top_p_threshold: " + "; ".join(problems))
    out = torch.empty(rows, dtype=torch.float32)
    if rows:
        native.top_p_threshold(scaled.data_ptr(), mass.data_ptr(), target.data_ptr(), rows, vocab, out.data_ptr(), torch.get_num_threads())
    return out
