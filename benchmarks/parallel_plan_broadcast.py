"""How rank 0 should send a round's command to its workers: gloo broadcast or a shared-memory ring.

    PYTHONPATH=. .venv/bin/python benchmarks/parallel_plan_broadcast.py [--messages 300]

Two ranks on this host (flare.parallel.launch), each pinned to its own CPU. Per message size,
rank 0 sends --messages commands and the worker acknowledges each, so a figure is the time
from "rank 0 starts sending" to "rank 0 knows the worker has the bytes", median and p90 in
microseconds:

- gloo: ``round_command.send_command`` (a broadcast of the length, then of the buffer) and a
  one-int gather as the acknowledgement;
- shm: one slot in /dev/shm (a sequence number, a length, an acknowledgement counter, then the
  bytes); the worker polls the sequence number with ``time.sleep(0)`` between polls, copies the
  bytes out and bumps the acknowledgement, which rank 0 polls the same way. The slot is
  unlinked at the end.

Sizes: a decode round of 32 rows with 4 drafts each (penalty ids, no grammar), the same plus a
512-token prompt chunk, and the same with a grammar bitmask for its 160 sampled positions at the
default model's vocabulary (49152 tokens: 6 KiB a position).
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import time
from datetime import timedelta
from multiprocessing import shared_memory

import numpy as np
import torch
import torch.distributed as dist

from flare.engine.batch import ForwardRow
from flare.sampler.batch import SamplingBatch
from flare.parallel.group import ProcessGroups
from flare.parallel.launch import RankGroup, WorkerSpec
from flare.parallel.layout import ParallelLayout
from flare.parallel.round_command import (
    RoundCommand,
    RoundSampling,
    receive_command,
    send_command,
)
from flare.policy.params import SamplingParams

SLOT_BYTES = 4 << 20
HEADER = 64
VOCAB = 49152


def _commands() -> dict[str, RoundCommand]:
    rows = 32
    params = [SamplingParams(temperature=0.7, repetition_penalty=1.1)] * rows
    batch = SamplingBatch.from_rows(
        params, list(range(rows)), [10] * rows, [list(range(200))] * rows, [list(range(50))] * rows, "cpu"
    )
    decode_rows = tuple(ForwardRow(tuple(range(5)), 300 + r, tuple(range(r * 20, r * 20 + 20)), 5) for r in range(rows))
    sampling = RoundSampling(torch.full((rows,), 4), torch.ones(rows, 4, dtype=torch.int64), batch)
    chunk = ForwardRow(tuple(range(512)), 0, tuple(range(700, 740)), 0)
    masked = RoundSampling(
        sampling.num_drafts, sampling.draft_tokens, batch, torch.full((rows * 5, VOCAB // 32), -1, dtype=torch.int32)
    )
    return {
        "decode 32 rows x 5 tokens": RoundCommand(1, decode_rows, (), sampling),
        "+ a 512-token prompt chunk": RoundCommand(2, (*decode_rows, chunk), ((1, 2),), sampling),
        "+ grammar bitmask (160 positions)": RoundCommand(3, (*decode_rows, chunk), ((1, 2),), masked),
    }


def _load(rank: int, world_size: int) -> None:
    return None


def _slot(name: str) -> tuple[mmap.mmap, np.ndarray]:
    """The worker's view of rank 0's segment: a plain mmap of its /dev/shm file (attaching
    through SharedMemory would register it with the resource tracker a second time)."""
    with open(f"/dev/shm/{name}", "r+b") as file:
        memory = mmap.mmap(file.fileno(), SLOT_BYTES)
    return memory, np.ndarray((3,), dtype=np.int64, buffer=memory)


def _serve(groups: ProcessGroups, state: None) -> None:
    """The worker: gloo rounds, then shm rounds, as rank 0 announces them."""
    while True:
        mode = torch.zeros(3, dtype=torch.int64)
        dist.broadcast(mode, src=0, group=groups.control)
        kind, count = int(mode[0]), int(mode[1])
        if kind == 0:
            return
        if kind == 1:
            for _ in range(count):
                receive_command(groups.control)
                dist.gather(torch.ones(1), None, dst=0, group=groups.control)
        else:
            name = bytes(_receive_name(groups)).decode()
            memory, header = _slot(name)
            seen = int(mode[2])
            for _ in range(count):
                while header[0] == seen:
                    time.sleep(0)
                seen = int(header[0])
                size = int(header[1])
                buffer = torch.frombuffer(bytearray(memory[HEADER : HEADER + size]), dtype=torch.uint8)
                RoundCommand.decode(buffer)
                header[2] = seen
            del header
            memory.close()


def _receive_name(groups: ProcessGroups) -> torch.Tensor:
    name = torch.zeros(64, dtype=torch.uint8)
    dist.broadcast(name, src=0, group=groups.control)
    return name[name > 0].numpy()


def _summary(samples: list[float]) -> str:
    ordered = sorted(samples)
    return f"{statistics.median(ordered) * 1e6:8.0f} / {ordered[int(0.9 * len(ordered))] * 1e6:8.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=300)
    args = parser.parse_args()
    group = RankGroup(
        ParallelLayout(tensor_parallel=2), WorkerSpec(_load, _serve), torch.device("cpu"),
        timedelta(seconds=120), timedelta(seconds=60),
    )
    groups = group.connect()
    assert groups is not None
    memory = shared_memory.SharedMemory(create=True, size=SLOT_BYTES)
    try:
        header = np.ndarray((3,), dtype=np.int64, buffer=memory.buf)
        header[:] = 0
        print(f"{'command':36} {'bytes':>9}  {'gloo median / p90 us':>21}  {'shm median / p90 us':>21}")
        for name, command in _commands().items():
            size = command.encode().numel()
            dist.broadcast(torch.tensor([1, args.messages, 0]), src=0, group=groups.control)
            gloo = []
            for _ in range(args.messages):
                started = time.perf_counter()
                send_command(command, groups.control)
                dist.gather(torch.ones(1), [torch.zeros(1), torch.zeros(1)], dst=0, group=groups.control)
                gloo.append(time.perf_counter() - started)
            dist.broadcast(torch.tensor([2, args.messages, int(header[0])]), src=0, group=groups.control)
            label = torch.zeros(64, dtype=torch.uint8)
            encoded = torch.tensor(list(memory.name.encode()), dtype=torch.uint8)
            label[: len(encoded)] = encoded
            dist.broadcast(label, src=0, group=groups.control)
            shm = []
            for _ in range(args.messages):
                started = time.perf_counter()
                buffer = command.encode()
                memory.buf[HEADER : HEADER + buffer.numel()] = buffer.numpy().tobytes()
                header[1] = buffer.numel()
                header[0] += 1
                while header[2] != header[0]:
                    time.sleep(0)
                shm.append(time.perf_counter() - started)
            print(f"{name:36} {size:9d}  {_summary(gloo):>21}  {_summary(shm):>21}")
        dist.broadcast(torch.tensor([0, 0, 0]), src=0, group=groups.control)
        del header
    finally:
        memory.close()
        memory.unlink()
        group.stop()


if __name__ == "__main__":
    main()
