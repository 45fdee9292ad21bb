"""Linear layers from ggml blocks against the float16 kernel, on the default model's shapes.

One round is the default model's 30 decoder layers (SmolLM2-135M: hidden 576, 9 heads and 3 KV
heads of 64, intermediate 1536; q/k/v fused as one [960, 576] layer, o [576, 576], gate/up
fused as [3072, 576], down [576, 1536], as the engine runs them; a K type where the width is
whole 256-blocks, llama.cpp's fallback elsewhere) and then the LM head [49152,
576] (Q8_0 where the layers are quantized, the tied token embedding of the default GGUF). For
each format and row count: the median milliseconds of the layers and of the head, and the bytes
per round they read.

    .venv/bin/python benchmarks/quantized_linear.py --rows 1 8 32 --formats float16 q4_1 q8_0 q4_k
    .venv/bin/python benchmarks/quantized_linear.py --threads 1 --clock thread
    .venv/bin/python benchmarks/quantized_linear.py --formats q4_1 q4_1+int8x2 q4_1+int8 --rows 1 5 8 32 64

A format `TYPE+ACTIVATIONS` multiplies the blocks by 8-bit activation blocks with integer dot
products (int8x2: two a 32, int8: one; integer_linear.c, the activations quantized inside each
product), at INTEGER_ISA: FLARE_INTEGER_ISA=avx_vnni or avx2 stands in for those CPUs.

Weights are random blocks (random quants, finite random scales): the kernel's time does not
depend on the values. The machine may be shared: compare formats measured in the same run. On a
busy machine, `--threads 1 --clock thread` counts the CPU time of the one thread that computes,
which waiting for a core does not inflate (memory contention still does).
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

from flare.engine import native  # noqa: E402
from flare.engine.precision import cpu_flags  # noqa: E402
from flare.engine.native_quantized import INTEGER_ISA  # noqa: E402
from flare.engine.quantized import QUANTIZED_ISA, QuantizedWeight, quantized_linear, supported_types  # noqa: E402

LAYERS = 30
LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
HEAD_SHAPE = (49152, 576)


def random_blocks(ggml_type: gguf.GGMLQuantizationType, out_features: int, in_features: int, rng: np.random.Generator) -> QuantizedWeight:
    """A weight of random quants whose scales are finite (float16: random small normals)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    data = rng.integers(0, 256, (out_features * (in_features // block_size), type_size), dtype=np.uint8)
    if ggml_type == gguf.GGMLQuantizationType.MXFP4:  # one E8M0 scale byte: 2^-10 .. 2^-5
        data[:, 0] = rng.integers(118, 124, data.shape[0])
        return QuantizedWeight.from_blocks(ggml_type, torch.from_numpy(data.reshape(out_features, -1)), out_features, in_features)
    scales = {gguf.GGMLQuantizationType.Q6_K: (208,)}.get(ggml_type, (0, 2))
    for offset in scales:
        halves = (rng.standard_normal(data.shape[0], dtype=np.float32) * 0.01).astype(np.float16)
        data[:, offset : offset + 2] = halves.view(np.uint8).reshape(-1, 2)
    return QuantizedWeight.from_blocks(ggml_type, torch.from_numpy(data.reshape(out_features, -1)), out_features, in_features)


def build(fmt: str, rng: np.random.Generator):
    """(layers' products, head product, bytes per round) for a format: closures over x."""
    if fmt == "float16":
        def packed(shape):
            return native.Float16Weight.pack(torch.from_numpy(rng.standard_normal(shape, dtype=np.float32) * 0.05))

        layers = [packed(s) for _ in range(LAYERS) for s in LAYER_SHAPES]
        head = packed(HEAD_SHAPE)
        nbytes = sum(w.blocks.numel() * 2 for w in layers) + head.blocks.numel() * 2
        return (lambda x, w: native.float16_linear(x, w)), layers, head, nbytes
    fmt, _, activations = fmt.partition("+")
    ggml_type = gguf.GGMLQuantizationType[fmt.upper()]
    if ggml_type not in supported_types():
        raise SystemExit(f"{fmt} is not served from blocks")
    # llama.cpp's fallback where a width is not whole K blocks (576 is not): Q5_0 for Q4_K and
    # Q5_K, Q8_0 for Q6_K; so "q4_k" here is Q4_K for down [576, 1536] and Q5_0 elsewhere.
    fallback = {gguf.GGMLQuantizationType.Q6_K: gguf.GGMLQuantizationType.Q8_0}.get(ggml_type, gguf.GGMLQuantizationType.Q5_0)
    layers = [
        random_blocks(ggml_type if s[1] % gguf.GGML_QUANT_SIZES[ggml_type][0] == 0 else fallback, *s, rng)
        for _ in range(LAYERS)
        for s in LAYER_SHAPES
    ]
    head = random_blocks(gguf.GGMLQuantizationType.Q8_0, *HEAD_SHAPE, rng)
    if activations:
        layers, head = [w.with_activations(activations) for w in layers], head.with_activations(activations)
    nbytes = sum(w.nbytes for w in layers) + head.nbytes
    return quantized_linear, layers, head, nbytes


def run_round(product, layers, head, inputs: dict[int, torch.Tensor], clock) -> tuple[float, float]:
    started = clock()
    for w in layers:
        product(inputs[w.in_features], w)
    middle = clock()
    product(inputs[head.in_features], head)
    return (middle - started) * 1e3, (clock() - middle) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--formats", nargs="+", default=["float16", "q4_1", "q8_0", "q4_k"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--clock", choices=["wall", "thread"], default="wall", help="thread: CPU time of this thread (--threads 1)")
    args = parser.parse_args()
    if args.clock == "thread" and args.threads != 1:
        parser.error("--clock thread counts one thread's CPU time: use it with --threads 1")
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    torch.set_num_threads(args.threads)
    print(
        f"cpu flags: {' '.join(cpu_flags()) or 'none of AVX2, AVX-512, AMX'}; isa float16 {native.LINEAR_ISA}, "
        f"quantized {QUANTIZED_ISA}, integer {INTEGER_ISA}; threads {args.threads}; clock {args.clock}; load {os.getloadavg()[0]:.2f}"
    )
    rng = np.random.default_rng(0)
    built = {fmt: build(fmt, rng) for fmt in args.formats}
    print(f"{'format':12} {'rows':>4} {'MB/round':>9} {'layers ms':>10} {'head ms':>8} {'round ms':>9} {'GB/s (M=1)':>10}")
    for rows in args.rows:
        inputs = {n: torch.randn(rows, n) for n in (576, 1536)}
        for fmt, (product, layers, head, nbytes) in built.items():
            run_round(product, layers, head, inputs, clock)  # warm: pages, caches, the thread team
            times = [run_round(product, layers, head, inputs, clock) for _ in range(args.rounds)]
            layer_ms = statistics.median(t[0] for t in times)
            head_ms = statistics.median(t[1] for t in times)
            total = statistics.median(t[0] + t[1] for t in times)
            rate = f"{nbytes / total / 1e6:10.1f}" if rows == 1 else ""
            print(f"{fmt:12} {rows:4} {nbytes / 1e6:9.1f} {layer_ms:10.2f} {head_ms:8.2f} {total:9.2f} {rate}")


if __name__ == "__main__":
    main()
