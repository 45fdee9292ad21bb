"""Engine-only decode throughput: one forward round of B decode rows at a given context.

Random weights with the default model's dimensions (SmolLM2-135M: 30 layers, hidden 576, FFN 1536,
9 heads, 3 KV heads of 64, vocab 49152, tied embeddings), fp32. No sampling, no HTTP: this is the
ceiling the scheduler and the daemon work under.

    .venv/bin/python benchmarks/engine_decode.py --batch 1 8 32 --context 200 --threads 2
"""

from __future__ import annotations

import os

# As `flare run` sets it (flare/daemon/cli.py), before torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import time

import torch

from flare.engine.batch import ForwardBatch, ForwardRow
from flare.engine.kv_cache import KVCache
from flare.engine.model import LlamaModel
from flare.preparation.manifest import ModelConfig
from flare.preparation.package import expected_weight_shapes

WARMUP_ROUNDS = 3
DEFAULT_DIMS = ModelConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_ids=(2,),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=200, help="cached positions before each decode token")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    config = DEFAULT_DIMS
    generator = torch.Generator().manual_seed(0)
    state = {name: 0.02 * torch.randn(shape, generator=generator) for name, shape in expected_weight_shapes(config).items()}
    model = LlamaModel(config, state)
    blocks_per_row = -(-(args.context + args.rounds + WARMUP_ROUNDS + 1) // args.block_size)
    cache = KVCache(
        num_layers=config.num_layers,
        num_blocks=max(args.batch) * blocks_per_row,
        block_size=args.block_size,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
    )
    print(f"threads={torch.get_num_threads()} context={args.context} rounds={args.rounds}")
    for batch_size in args.batch:
        # Interleave the rows' blocks so the block tables are not contiguous, as in serving.
        tables = [[b * batch_size + r for b in range(blocks_per_row)] for r in range(batch_size)]
        timings = []
        cpu_timings = []
        for step in range(args.rounds + WARMUP_ROUNDS):
            position = args.context + step
            rows = [ForwardRow([7 + r], position, tables[r], num_logits=1) for r in range(batch_size)]
            start, cpu_start = time.perf_counter(), time.process_time()
            batch = ForwardBatch.build(rows, args.block_size)
            model.forward(batch, cache)
            timings.append(time.perf_counter() - start)
            cpu_timings.append(time.process_time() - cpu_start)
        timings = sorted(timings[WARMUP_ROUNDS:])
        median = timings[len(timings) // 2]
        # CPU time (all threads) shows the work done even when other processes share the cores.
        cpu = sorted(cpu_timings[WARMUP_ROUNDS:])[len(timings) // 2]
        print(
            f"batch {batch_size:3d}: median round {median * 1000:7.1f} ms, "
            f"{batch_size / median:7.1f} tok/s (best {batch_size / timings[0]:7.1f}); "
            f"CPU {cpu * 1000:7.1f} ms per round"
        )


if __name__ == "__main__":
    main()
