"""How a host's CPUs are split between its ranks.

Each rank gets a CPU list and runs one OpenMP thread per CPU, pinned to that list, so ranks do
not fight over cores (a rank that waits in an all-reduce while another rank's threads run on
its cores turns every collective into a scheduler round-trip). The operator can give the lists
the way vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` does: ``"0-15|16-31"``, one list per local rank,
``|`` between ranks; a NUMA node per rank is the usual choice (docs/operations.md). Without
it the CPUs this process may use are cut into equal contiguous runs; with fewer CPUs than
ranks, ranks share CPUs round-robin (correct, not fast).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class RankThreads:
    rank: int
    cpus: tuple[int, ...]
    """The CPUs the rank is pinned to."""

    @property
    def num_threads(self) -> int:
        return len(self.cpus)


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """``"0-3,8,10-11"`` -> (0, 1, 2, 3, 8, 10, 11); a clear error on anything else."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        low, dash, high = part.partition("-")
        try:
            first, last = int(low), int(high) if dash else int(low)
        except ValueError:
            raise ValueError(f"CPU list {text!r}: {part!r} is neither a CPU number nor a range a-b") from None
        if first < 0 or last < first:
            raise ValueError(f"CPU list {text!r}: {part!r} is not a range of CPU numbers (a <= b, both >= 0)")
        cpus.extend(range(first, last + 1))
    return tuple(dict.fromkeys(cpus))


def split_cpus(ranks: range, available: tuple[int, ...], bind: str | None = None) -> list[RankThreads]:
    """The CPU list of each of ``ranks`` (this host's ranks, in order): from ``bind`` (one list
    per rank, ``|``-separated) when given, else ``available`` cut into equal contiguous runs."""
    if bind:
        lists = [parse_cpu_list(part) for part in bind.split("|")]
        if len(lists) != len(ranks):
            raise ValueError(
                f"thread binding {bind!r} gives {len(lists)} CPU lists for {len(ranks)} ranks on this host: "
                f"give one list per rank, separated by '|'"
            )
        return [RankThreads(rank, cpus) for rank, cpus in zip(ranks, lists, strict=True)]
    if not available:
        raise ValueError("no CPU is available to this process")
    count = len(ranks)
    if len(available) < count:
        return [RankThreads(rank, (available[i % len(available)],)) for i, rank in enumerate(ranks)]
    share, extra = divmod(len(available), count)
    result, start = [], 0
    for i, rank in enumerate(ranks):
        size = share + (1 if i < extra else 0)
        result.append(RankThreads(rank, available[start : start + size]))
        start += size
    return result


def available_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on (its affinity mask, which systemd's CPUAffinity= sets)."""
    return tuple(sorted(os.sched_getaffinity(0)))


def pin(threads: RankThreads) -> None:
    """Pin this process to the rank's CPUs and size torch's OpenMP pool to them."""
    import torch

    os.sched_setaffinity(0, threads.cpus)
    torch.set_num_threads(threads.num_threads)
