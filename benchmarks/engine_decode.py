"""Engine-only decode throughput: one forward round of B decode rows at a given context.

With --tokens-per-row T > 1 every row is a verify row of T tokens (a decode token and T - 1
drafts, logits at all of them), as a speculative round runs them; tok/s then counts forwarded
tokens, which is the ceiling that accepted drafts can reach.

Random weights with the default model's dimensions (SmolLM2-135M: 30 layers, hidden 576, FFN 1536,
9 heads, 3 KV heads of 64, vocab 49152, tied embeddings), float32 activations and the linear
layers in --weight-format (`flare/engine/precision.py`: float16 through the engine's own kernel,
each layer one call, is what the default package runs on an AVX2 CPU, bfloat16 through oneDNN
where bfloat16 is native).
No sampling, no HTTP: this is the ceiling the scheduler and the daemon work under.

    .venv/bin/python benchmarks/engine_decode.py --batch 1 8 32 --context 200 --threads 2
    .venv/bin/python benchmarks/engine_decode.py --batch 1 --tokens-per-row 1 2 3 5 9
    .venv/bin/python benchmarks/engine_decode.py --kernels torch   # without the C kernels
    .venv/bin/python benchmarks/engine_decode.py --weight-format float32 float16   # alternating
    .venv/bin/python benchmarks/engine_decode.py --steps        # where a round's time goes
    .venv/bin/python benchmarks/engine_decode.py --context 1000 --kv-cache-dtype float32 bfloat16
    .venv/bin/python benchmarks/engine_decode.py --package default --batch 1 --steps   # a package's own weights

With --package (a package directory, or `default` for the default package's path) the model is
that package's as `flare run` loads it (its quantized blocks mapped from the file, the weight
format chosen as `--weight-format auto` does) instead of random weights, timed with each layer
one kernel call (`package`) and step by step (`package-steps`), alternating.
"""

from __future__ import annotations

import os

from flare.engine.openmp import set_wait_policy

# As `flare run` sets it (flare/engine/openmp.py), before torch loads OpenMP.
set_wait_policy(os.environ)

import argparse
import copy
import random
import statistics
import time
from pathlib import Path

import torch

from flare.engine.batch import ForwardBatch, ForwardRow
from flare.engine.kv_cache import KVCache
from flare.engine import model as model_module
from flare.engine.layers import mlp as mlp_module
from flare.engine.layers import moe as moe_module
from flare.engine import native, native_quantized
from flare.engine.model import DecoderModel, load_model
from flare.engine.precision import WeightFormat, cpu_flags
from flare.engine.quantized import AUTO_ACTIVATIONS, served_activations
from flare.preparation.default_package import default_package_path
from flare.package.model_config import ModelConfig
from flare.package.directory import open_package
from flare.package.directory import expected_weight_shapes

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
    parser.add_argument("--tokens-per-row", type=int, nargs="+", default=[1])
    parser.add_argument(
        "--kernels",
        choices=["native", "torch"],
        default="native",
        help="the engine's C kernels (flare/engine/native.py) or their torch counterparts",
    )
    parser.add_argument(
        "--weight-format",
        nargs="+",
        choices=[f.value for f in WeightFormat],
        default=["float32"],
        help="one or more formats; with several, each batch size runs them alternately, round sets interleaved",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        choices=["float32", "float16", "bfloat16"],
        default=["float32"],
        help="what the KV cache stores (flare run --kv-cache-dtype); with several, each format runs with each",
    )
    parser.add_argument("--package", help="a package directory (or `default`) to load instead of random weights")
    parser.add_argument(
        "--activations", nargs="+", default=None,
        help="with --package: what its blocks multiply (flare run --activations: int8x2, int8, float32); each runs, alternating "
        "(default: what `flare run` serves, --activations auto)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="sets of rounds per format and batch size (medians of all)")
    parser.add_argument(
        "--steps",
        action="store_true",
        help="also time each step of a round (the linear layers, attention, RoPE with the KV write, SwiGLU, norms, a MoE model's router and experts)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    if args.package:
        package = open_package(default_package_path() if args.package == "default" else Path(args.package))
        if args.activations:
            # The package's layers one kernel call each, with each activation precision, alternating.
            loaded = {f"package-{a}": load_model(package, activations=a) for a in args.activations}
            model = next(iter(loaded.values()))
        else:
            # What `flare run` serves by default (`--activations auto`): int8x2 on a K-quant file.
            model = load_model(package, activations=served_activations(package.weight_types(), AUTO_ACTIVATIONS))
            if args.kernels == "torch":
                model.native_kernels, model.kernel_layers = False, None
            # The package's layers one kernel call each, and the same weights step by step, alternating.
            steps = copy.copy(model)
            steps.kernel_layers = None
            loaded = {"package": model, "package-steps": steps}
        config = model.config
        args.weight_format = list(loaded)
    else:
        config = DEFAULT_DIMS
        generator = torch.Generator().manual_seed(0)
        state = {name: 0.02 * torch.randn(shape, generator=generator) for name, shape in expected_weight_shapes(config).items()}
        loaded = {
            name: DecoderModel(config, state, weight_format=WeightFormat(name), native_kernels=args.kernels == "native")
            for name in args.weight_format
        }
    # One configuration per weight format and KV cache dtype, each with a cache of its own.
    models = {
        (name if args.kv_cache_dtype == ["float32"] else f"{name}/kv-{kv}"): (loaded[name], getattr(torch, kv))
        for name in args.weight_format
        for kv in args.kv_cache_dtype
    }
    longest = max(args.tokens_per_row)
    blocks_per_row = -(-(args.context + (args.rounds + WARMUP_ROUNDS + 1) * longest) // args.block_size)
    caches = {
        kv: KVCache(
            num_layers=config.num_layers,
            num_blocks=max(args.batch) * blocks_per_row,
            block_size=args.block_size,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            dtype=kv,
        )
        for kv in {kv for _, kv in models.values()}
    }
    print(
        f"threads={torch.get_num_threads()} context={args.context} rounds={args.rounds} x {args.repeats} "
        f"kernels={args.kernels} cpu_flags={' '.join(cpu_flags()) or 'none of AVX2, AVX-512, AMX'}"
    )
    first = next(iter(models))
    for batch_size in args.batch:
        for tokens in args.tokens_per_row:
            # Sets of rounds alternate between the formats, so a slow patch of a shared machine
            # falls on all of them.
            walls: dict[str, list[float]] = {name: [] for name in models}
            cpus: dict[str, list[float]] = {name: [] for name in models}
            for _ in range(args.repeats):
                for name, (model, kv) in models.items():
                    wall, cpu = time_rounds(model, caches[kv], batch_size, tokens, blocks_per_row, args)
                    walls[name] += wall
                    cpus[name] += cpu
            forwarded = batch_size * tokens
            if args.steps:
                for name, (model, kv) in models.items():
                    print(f"{name:8s} batch {batch_size:3d} x {tokens} tokens: " + step_times(model, caches[kv], batch_size, tokens, blocks_per_row, args))
            for name in models:
                median, cpu = statistics.median(walls[name]), statistics.median(cpus[name])
                ratio = median / statistics.median(walls[first])
                print(
                    f"{name:8s} batch {batch_size:3d} x {tokens} tokens: median round {median * 1000:7.1f} ms "
                    f"({ratio:.2f} of {first}), {forwarded / median:7.1f} tok/s; CPU {cpu * 1000:7.1f} ms per round"
                )


# What --steps times: each step of a layer, by the function that runs it (model.py and native.py;
# with --kernels torch the torch counterparts run inside `forward` itself and are not split out).
STEPS = {
    "linear layers (LM head included)": (model_module, ("linear", "linear_columns")),
    "linear layers of the MLP": (mlp_module, ("linear", "linear_columns")),
    "attention": (native, ("paged_attention",)),
    "RoPE + KV write": (native, ("rope_and_cache",)),
    "SwiGLU": (native, ("gated_rows",)),
    "residual add + RMSNorm": (native, ("add_rms_norm",)),
    # A mixture-of-experts model's MLPs: the router (float64 logits, then the route) and the
    # routed experts' one C call (moe_layer.c), which the MLP's linear layers above do not see.
    "MoE router": (moe_module, ("moe_routes",)),
    "MoE experts (one C call each)": (native_quantized, ("moe_layer",)),
}


def step_times(model: DecoderModel, cache: KVCache, batch_size: int, tokens: int, blocks_per_row: int, args: argparse.Namespace) -> str:
    """The mean forward pass and each step's part of it, from wall-clock timers around the step
    functions, over every round run (warm-up included; a linear layer called inside another, as
    `linear` calls `linear_columns`, counts once)."""
    spent: dict[str, float] = dict.fromkeys(STEPS, 0.0)
    forwards: list[float] = []
    originals = []
    # A float16 model runs each layer as one kernel call (`native_layers.decoder_layer`), which these
    # timers cannot split: the steps are timed on the step-by-step path, the same kernels with
    # Python between them (the difference is in the two paths' median rounds).
    fused_layers, model.kernel_layers = model.kernel_layers, None
    depth = [0]
    for step, (module, names) in STEPS.items():
        for name in names:
            original = getattr(module, name)
            originals.append((module, name, original))

            def timed(*call_args, _original=original, _step=step, **kwargs):
                depth[0] += 1
                start = time.perf_counter()
                try:
                    return _original(*call_args, **kwargs)
                finally:
                    depth[0] -= 1
                    if depth[0] == 0:
                        spent[_step] += time.perf_counter() - start

            setattr(module, name, timed)
    forward = model.forward

    def timed_forward(*call_args, **kwargs):
        start = time.perf_counter()
        try:
            return forward(*call_args, **kwargs)
        finally:
            forwards.append(time.perf_counter() - start)

    model.forward = timed_forward
    try:
        time_rounds(model, cache, batch_size, tokens, blocks_per_row, args)
    finally:
        del model.forward
        model.kernel_layers = fused_layers
        for module, name, original in originals:
            setattr(module, name, original)
    rounds, total = len(forwards), sum(forwards)
    parts = [f"{step} {spent[step] / rounds * 1000:.1f}" for step in STEPS]
    rest = (total - sum(spent.values())) / rounds * 1000
    path = " (step by step)" if fused_layers is not None else ""
    return f"forward{path} {total / rounds * 1000:.1f} ms (mean) = " + ", ".join(parts) + f", the rest (Python between them, embedding) {rest:.1f}"


def time_rounds(
    model: DecoderModel, cache: KVCache, batch_size: int, tokens: int, blocks_per_row: int, args: argparse.Namespace
) -> tuple[list[float], list[float]]:
    """Wall and CPU times (all threads) of `args.rounds` rounds after a warm-up."""
    # Interleave the rows' blocks so the block tables are not contiguous, as in serving.
    tables = [[b * batch_size + r for b in range(blocks_per_row)] for r in range(batch_size)]
    # Each round's tokens are new draws from the vocabulary, as a served text's are, so a MoE layer
    # routes each round to other experts, as in serving. (One repeated token instead measured the
    # same within the machine's drift: docs/benchmarks.md, "One stream is bound by reading the weights".)
    draws = random.Random(0)
    vocab = model.config.vocab_size
    timings = []
    cpu_timings = []
    for step in range(args.rounds + WARMUP_ROUNDS):
        position = args.context + step * tokens
        rows = [ForwardRow([draws.randrange(vocab) for _ in range(tokens)], position, tables[r], num_logits=tokens)
                for r in range(batch_size)]
        start, cpu_start = time.perf_counter(), time.process_time()
        batch = ForwardBatch.build(rows, args.block_size)
        model.forward(batch, cache)
        timings.append(time.perf_counter() - start)
        cpu_timings.append(time.process_time() - cpu_start)
    # CPU time (all threads) shows the work done even when other processes share the cores.
    return timings[WARMUP_ROUNDS:], cpu_timings[WARMUP_ROUNDS:]


if __name__ == "__main__":
    main()
