"""How torch's OpenMP threads wait between operations on the CPU.

libgomp (the OpenMP runtime of torch's CPU build) reads its wait policy once, when torch loads
it, so `set_wait_policy` must run before the first `import torch`; this module imports nothing.

A round of the engine is hundreds of short parallel regions (GEMMs, attention, norms), and
between two of them the worker threads wait. The policy decides how:

- passive (`OMP_WAIT_POLICY=PASSIVE`): sleep at once, and pay a futex wake-up at every region;
- libgomp's default: spin 300,000 times first, which on a shared machine burns the time slices
  a neighbour needs, and the round slows by an order of magnitude;
- a short spin (`GOMP_SPINCOUNT`): spin about as long as the gaps inside a round, then sleep.

The gaps are not all short: a region whose work does not split evenly (three attention tasks on
two threads) leaves a thread waiting for most of a task, and under a hypervisor the wake-up after
it costs tens of microseconds. 3,000 spins outlast those gaps, where 1,000 did not: a 5-token
verify round and an 8-row round were 13-17% faster alone, and a 1-token round no slower. Beside
a busy neighbour every spin steals its time slices and passive is fastest, so the operator of a
shared machine chooses it. The measurements are in docs/operations.md, "CPU threads and kernels".
"""

from __future__ import annotations

from collections.abc import MutableMapping

SPIN_COUNT = 3000


def set_wait_policy(environ: MutableMapping[str, str]) -> None:
    """Make OpenMP threads spin `SPIN_COUNT` times before they sleep, unless `environ` already
    chooses a policy (`OMP_WAIT_POLICY` or `GOMP_SPINCOUNT`): the operator's setting wins."""
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return
    environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
