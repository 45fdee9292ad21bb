"""How torch's OpenMP threads wait between operations on the CPU.

libgomp (the OpenMP runtime of torch's CPU build) reads its wait policy once, when torch loads
it, so `set_wait_policy` must run before the first `import torch`; this module imports nothing.

A round of the engine is hundreds of short parallel regions (GEMMs, attention, norms), and
between two of them the worker threads wait. The policy decides how:

- passive (`OMP_WAIT_POLICY=PASSIVE`): sleep at once, and pay a futex wake-up at every region;
- libgomp's default: spin 300,000 times first, which on a shared machine burns the time slices
  a neighbour needs, and the round slows by an order of magnitude;
- a short spin (`GOMP_SPINCOUNT`): spin about as long as the gap between two regions of one
  round, then sleep.

A short spin is the fastest alone and costs little beside a busy neighbour, where longer spins
lose; the operator of a shared machine can still choose passive. The measurements are in
docs/operations.md, "CPU threads and kernels".
"""

from __future__ import annotations

from collections.abc import MutableMapping

SPIN_COUNT = 1000


def set_wait_policy(environ: MutableMapping[str, str]) -> None:
    """Make OpenMP threads spin `SPIN_COUNT` times before they sleep, unless `environ` already
    chooses a policy (`OMP_WAIT_POLICY` or `GOMP_SPINCOUNT`): the operator's setting wins."""
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return
    environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
