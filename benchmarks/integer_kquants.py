"""Integer K-quant products (integer_kquants.c) against today's float path, on one layer of a
Llama-3.2-1B shape.

The layer (hidden 2048, intermediate 8192, 32 heads and 8 KV heads of 64), as a Q4_K_M file
stores it: q [2048, 2048], k [512, 2048], o [2048, 2048], gate and up [8192, 2048] in Q4_K; v
[512, 2048] and down [2048, 8192] in Q6_K (`--layers` copies of it, 4 by default, 240 MB: read from memory as a
model's layers are). For each row count: the median milliseconds per layer of its seven products through `native_quantized.kquant_product` at each integer level (the activations
quantized to Q8_K inside each call, once per product: a layer shares them between q/k/v and
gate/up, so this counts them 7 times where 4 suffice) and through
`flare.engine.quantized.quantized_linear` (float32 activations, the blocks expanded to float).

    .venv/bin/python benchmarks/integer_kquants.py --rows 1 4 8 32 64
    .venv/bin/python benchmarks/integer_kquants.py --levels avx512_vnni avx2 --rounds 5
    .venv/bin/python benchmarks/integer_kquants.py --threads 1 --clock thread
    .venv/bin/python benchmarks/integer_kquants.py --halves 1 2 --levels avx512_vnni
    .venv/bin/python benchmarks/integer_kquants.py --threads 1 --clock thread --halves 2 --levels amx avx512_vnni

`amx` runs AMX's tile products where this process is granted them (integer_dot.c), else falls
back to AVX-512 VNNI (the same bits). `--halves 2` quantizes each row and its residual x - d qs (int8x2, about 15 bits of x) and adds
the two products.

Weights are random blocks (random quants, finite random scales): the time does not depend on
the values. The machine may be shared: compare figures of the same run. On a busy machine,
`--threads 1 --clock thread` counts the CPU time of the one thread that computes, which waiting
for a core does not inflate (memory contention still does).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from flare.engine.openmp import set_wait_policy

# As `flare run` sets it (flare/engine/openmp.py), before torch loads OpenMP.
set_wait_policy(os.environ)

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from flare.engine import native_quantized  # noqa: E402
from flare.engine.precision import cpu_flags  # noqa: E402
from flare.engine.quantized import QuantizedWeight, quantized_linear  # noqa: E402

T = gguf.GGMLQuantizationType
LAYER = (  # (name, type, out, in)
    ("q", T.Q4_K, 2048, 2048),
    ("k", T.Q4_K, 512, 2048),
    ("v", T.Q6_K, 512, 2048),
    ("o", T.Q4_K, 2048, 2048),
    ("gate", T.Q4_K, 8192, 2048),
    ("up", T.Q4_K, 8192, 2048),
    ("down", T.Q6_K, 2048, 8192),
)
LEVELS = {
    "amx": native_quantized.IDOT_AMX,
    "avx512_vnni": native_quantized.IDOT_AVX512_VNNI,
    "avx_vnni": native_quantized.IDOT_AVX_VNNI,
    "avx2": native_quantized.IDOT_AVX2,
    "portable": native_quantized.IDOT_PORTABLE,
}


def random_blocks(ggml_type: T, out_features: int, in_features: int, rng: np.random.Generator) -> QuantizedWeight:
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    data = rng.integers(0, 256, (out_features * (in_features // block_size), type_size), dtype=np.uint8)
    for offset in (208,) if ggml_type == T.Q6_K else (0, 2):
        halves = (rng.standard_normal(data.shape[0], dtype=np.float32) * 0.01).astype(np.float16)
        data[:, offset : offset + 2] = halves.view(np.uint8).reshape(-1, 2)
    return QuantizedWeight.from_blocks(ggml_type, torch.from_numpy(data.reshape(out_features, -1)), out_features, in_features)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 32, 64])
    parser.add_argument("--levels", nargs="+", choices=sorted(LEVELS), default=["avx512_vnni", "avx_vnni", "avx2", "portable"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layers", type=int, default=4, help="copies of the layer, so the weights are read from memory")
    parser.add_argument("--halves", type=int, nargs="+", choices=[1, 2], default=[1], help="2: x and its residual (int8x2)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--clock", choices=["wall", "thread"], default="wall", help="thread: CPU time of this thread (--threads 1)")
    args = parser.parse_args()
    if args.clock == "thread" and args.threads != 1:
        parser.error("--clock thread counts one thread's CPU time: use it with --threads 1")
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    torch.set_num_threads(args.threads)
    print(f"cpu flags: {' '.join(cpu_flags())}; threads {args.threads}; clock {args.clock}; load {os.getloadavg()[0]:.2f}")
    rng = np.random.default_rng(0)
    weights = [random_blocks(t, o, i, rng) for _ in range(args.layers) for _, t, o, i in LAYER]
    paths = {"float (quantized_linear)": lambda x, w: quantized_linear(x, w)}
    for halves in args.halves:
        for level in args.levels:
            paths[f"integer {level}" + (" x2" if halves == 2 else "")] = lambda x, w, isa=LEVELS[level], h=halves: native_quantized.kquant_product(
                x, w.data, w.ggml_type, w.out_features, w.in_features, isa=isa, halves=h
            )
    print(f"{'path':26} " + " ".join(f"{f'{r} rows':>9}" for r in args.rows) + "   (ms per layer, median)")
    for name, product in paths.items():
        cells = []
        for rows in args.rows:
            inputs = {n: torch.randn(rows, n) for n in (2048, 8192)}

            def layer() -> float:
                started = clock()
                for w in weights:
                    product(inputs[w.in_features], w)
                return (clock() - started) * 1e3 / args.layers

            layer()  # warm: pages, caches, the thread team
            cells.append(statistics.median(layer() for _ in range(args.rounds)))
        print(f"{name:26} " + " ".join(f"{c:9.2f}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
