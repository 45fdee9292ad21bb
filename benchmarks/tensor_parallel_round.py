"""A decode round and its all-reduces at tensor-parallel 1 and 2, on a random Llama.

    PYTHONPATH=. .venv/bin/python benchmarks/tensor_parallel_round.py [--rows 8] [--rounds 30]

The model has the default model's layer shapes except its heads (SmolLM2-135M's 9 heads and
3 KV heads do not split two ways; TP 3 is the size that does): hidden 576, 8 heads and 4 KV
heads of 64, MLP 1536, 30 layers, vocabulary 49152, float32 weights, random. Rank 0 sends each
round's command (round_command.py) and both ranks run the forward (two all-reduces a layer)
and the vocabulary-parallel greedy sampling (vocab_round.py); TP 1 runs the same model and
sampler in one process. Printed: the median round in ms (--rows decode rows at a context of
--context), and the median time of one gloo all-reduce of a [rows, hidden] float32 tensor, the
size each layer all-reduces twice. Each rank is pinned to its own CPU (threads.py), TP 1 gets
both. On a 2-core machine TP 2 cannot be faster: the same arithmetic, plus 60 all-reduces.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta

from flare.engine.openmp import set_wait_policy

set_wait_policy(os.environ)  # as `flare run` does, before torch loads OpenMP (spawned ranks inherit it)

import torch  # noqa: E402

from flare.engine.batch import ForwardBatch, ForwardRow
from flare.engine.kv_cache import KVCache
from flare.engine.model import DecoderModel
from flare.sampler.batch import SamplingBatch
from flare.sampler.round import sample_round
from flare.parallel.group import ProcessGroups, all_reduce_sum
from flare.parallel.launch import RankGroup, WorkerSpec
from flare.parallel.layout import ParallelLayout
from flare.parallel.round_command import RoundCommand, RoundSampling, receive_command, send_command
from flare.parallel.tensor_split import rank_config, rank_model
from flare.parallel.vocab_round import ShardsAcrossRanks
from flare.parallel.vocab_shard import VocabShard
from flare.package.model_config import ModelConfig
from flare.package.directory import expected_weight_shapes
from flare.policy.params import SamplingParams

BLOCK = 16
CONFIG = ModelConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=8, num_kv_heads=4,
    head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=2048,
    tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
)


def _weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {name: 0.02 * torch.randn(shape, generator=generator) for name, shape in expected_weight_shapes(CONFIG).items()}


def _cache(config: ModelConfig, rows: int, context: int) -> KVCache:
    return KVCache(
        num_layers=config.num_layers, num_blocks=rows * (-(-(context + 64) // BLOCK)), block_size=BLOCK,
        num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
    )


def _rows(rows: int, context: int, step: int) -> tuple[ForwardRow, ...]:
    per_row = -(-(context + 64) // BLOCK)
    return tuple(ForwardRow((7,), context + step, tuple(range(r * per_row, (r + 1) * per_row)), 1) for r in range(rows))


def _prefill(rows: int, context: int) -> tuple[ForwardRow, ...]:
    per_row = -(-(context + 64) // BLOCK)
    return tuple(ForwardRow(tuple(range(3, 3 + context)), 0, tuple(range(r * per_row, (r + 1) * per_row)), 1) for r in range(rows))


def _sampling(rows: int) -> RoundSampling:
    batch = SamplingBatch.from_rows([SamplingParams(temperature=0.0)] * rows, [0] * rows, [0] * rows, [[]] * rows, [[]] * rows, "cpu")
    return RoundSampling(torch.zeros(rows, dtype=torch.int64), torch.full((rows, 0), -1), batch)


def _load(rank: int, world_size: int) -> tuple[DecoderModel, KVCache]:
    model = rank_model(CONFIG, _weights(), rank, world_size, all_reduce_sum)
    return model, _cache(rank_config(CONFIG, world_size), 8, 512)


def _round(groups: ProcessGroups, model: DecoderModel, cache: KVCache, command: RoundCommand) -> None:
    logits = model.forward(ForwardBatch.build(list(command.rows), BLOCK), cache)
    shard = VocabShard.of(CONFIG.vocab_size, groups.device)
    s = command.sampling
    assert s is not None
    sample_round(logits, s.num_drafts, s.draft_tokens, None, s.batch, ShardsAcrossRanks(shard))


def _serve(groups: ProcessGroups, state: tuple[DecoderModel, KVCache]) -> None:
    model, cache = state
    while (command := receive_command(groups.control)) is not None:
        if command.index < 0:  # an all-reduce probe of [rows, hidden]
            for _ in range(-command.index):
                all_reduce_sum(torch.zeros(len(command.rows), CONFIG.hidden_size))
            continue
        _round(groups, model, cache, command)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    rows, context = args.rows, args.context

    whole = DecoderModel(CONFIG, _weights())
    single: dict[int, list[float]] = {}
    for threads in sorted({torch.get_num_threads(), 1}, reverse=True):
        torch.set_num_threads(threads)
        cache = _cache(CONFIG, rows, context)
        whole.forward(ForwardBatch.build(list(_prefill(rows, context)), BLOCK), cache)
        single[threads] = []
        for step in range(args.rounds):
            started = time.perf_counter()
            logits = whole.forward(ForwardBatch.build(list(_rows(rows, context, step)), BLOCK), cache)
            s = _sampling(rows)
            sample_round(logits, s.num_drafts, s.draft_tokens, None, s.batch)
            single[threads].append(time.perf_counter() - started)
    del whole, cache

    group = RankGroup(ParallelLayout(2), WorkerSpec(_load, _serve), torch.device("cpu"), timedelta(seconds=300), timedelta(seconds=120))
    group.pin_own()
    model, cache = _load(0, 2)
    groups = group.connect()
    assert groups is not None
    try:
        for threads in group.ranks:
            print(f"rank {threads.rank}: pid {threads.pid}, CPUs {list(threads.cpus)}")
        _round_with(groups, model, cache, RoundCommand(0, _prefill(rows, context), (), _sampling(rows)))
        double = []
        for step in range(args.rounds):
            started = time.perf_counter()
            _round_with(groups, model, cache, RoundCommand(step + 1, _rows(rows, context, step), (), _sampling(rows)))
            double.append(time.perf_counter() - started)
        probes = 200
        send_command(RoundCommand(-probes, _rows(rows, context, 0), (), None), groups.control)
        reduce_times = []
        for _ in range(probes):
            started = time.perf_counter()
            all_reduce_sum(torch.zeros(rows, CONFIG.hidden_size))
            reduce_times.append(time.perf_counter() - started)
        send_command(None, groups.control)
    finally:
        group.stop()
    tp1 = ", ".join(f"{statistics.median(times) * 1e3:.1f} ms on {n} thread(s)" for n, times in single.items())
    print(f"decode round, {rows} rows at context {context}, median of {args.rounds}: TP 1 {tp1}; "
          f"TP 2 {statistics.median(double) * 1e3:.1f} ms (one thread a rank)")
    print(f"one all-reduce of [{rows}, {CONFIG.hidden_size}] float32 over gloo: "
          f"{statistics.median(reduce_times) * 1e6:.0f} us median; {2 * CONFIG.num_layers} a round")


def _round_with(groups: ProcessGroups, model: DecoderModel, cache: KVCache, command: RoundCommand) -> None:
    send_command(command, groups.control)
    _round(groups, model, cache, command)


if __name__ == "__main__":
    main()
