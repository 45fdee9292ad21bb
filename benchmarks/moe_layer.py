"""One mixture-of-experts MLP (flare/engine/layers/moe.py) of a real model's shape on random
experts: Qwen3-30B-A3B's (`--shape qwen3-30b-a3b`, the default: hidden 2048, 128 experts of width
768, 8 per token, Q4_K) or gpt-oss-20b's (`--shape gpt-oss-20b`: hidden 2880, 32 experts of width
2880, 4 per token, MXFP4, with the router's bias, top-k before the softmax, expert biases and the
clamped SwiGLU); the router float32.

The experts are one block tensor per projection, each expert a view of it, as a package maps
them; the rows of a round are routed (float64 logits, float32 route), grouped by expert and
multiplied through the quantized kernels, then summed in each row's fixed expert order. Reported:
the median wall time of the layer per round, each round new random rows (routed to other
experts, as a served round's are), and the bytes of the experts a round touched (each distinct
expert's gate/up and down once; the median over the rounds).

    .venv/bin/python benchmarks/moe_layer.py --rows 1 8 32 --rounds 9
    .venv/bin/python benchmarks/moe_layer.py --rows 1 8 32 --rounds 9 --per-expert  # the loop over experts
    .venv/bin/python benchmarks/moe_layer.py --rows 1 8 32 --rounds 9 --activations int8x2  # integer products
    .venv/bin/python benchmarks/moe_layer.py --shape gpt-oss-20b --rows 1 4 32   # MXFP4, gpt-oss's options
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
from flare.engine.layers.moe import MoEWeights, expert_weights, moe_mlp, moe_routes  # noqa: E402
from flare.engine.precision import WeightFormat, cpu_flags  # noqa: E402
from flare.engine.quantized import QuantizedWeight  # noqa: E402
from flare.package.manifest import ACTIVATIONS  # noqa: E402
from flare.package.model_config import ModelConfig  # noqa: E402

Q4_K, MXFP4 = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.MXFP4
# hidden, experts, width, active, the experts' type, gpt-oss's options
SHAPES = {
    "qwen3-30b-a3b": (2048, 128, 768, 8, Q4_K, False),
    "gpt-oss-20b": (2880, 32, 2880, 4, MXFP4, True),
}


def random_blocks(ggml_type: gguf.GGMLQuantizationType, rows: int, in_features: int, rng: np.random.Generator) -> QuantizedWeight:
    """Random quants with finite small scales: Q4_K's float16 d and dmin about 0.01, MXFP4's E8M0
    scale 2^-10 .. 2^-6."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    data = rng.integers(0, 256, (rows * (in_features // block_size), type_size), dtype=np.uint8)
    if ggml_type == MXFP4:
        data[:, 0] = rng.integers(117, 122, data.shape[0])
    else:
        for offset in (0, 2):
            halves = (rng.standard_normal(data.shape[0], dtype=np.float32) * 0.01).astype(np.float16)
            data[:, offset : offset + 2] = halves.view(np.uint8).reshape(-1, 2)
    return QuantizedWeight.from_blocks(ggml_type, torch.from_numpy(data.reshape(rows, -1)), rows, in_features)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default="qwen3-30b-a3b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--per-expert", action="store_true", help="the torch loop over experts instead of the one C call")
    parser.add_argument(
        "--activations", choices=ACTIVATIONS, default="float32", help="what the experts' blocks multiply (flare run --activations)"
    )
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    hidden, experts, width, active, ggml_type, gpt_oss = SHAPES[args.shape]
    family = {
        "architecture": "gpt_oss", "routing": "topk_softmax", "router_bias": True, "expert_bias": True,
        "hidden_activation": "clamped_swiglu", "swiglu_limit": 7.0,
    } if gpt_oss else {"architecture": "qwen3_moe", "norm_topk_prob": True}
    config = ModelConfig(
        vocab_size=32, hidden_size=hidden, intermediate_size=6144, num_layers=1, num_heads=32, num_kv_heads=4,
        head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=False,
        bos_token_id=None, eos_token_ids=(1,), num_experts=experts, num_experts_per_tok=active, moe_intermediate_size=width,
        moe_layers=(0,), **family,  # type: ignore[arg-type]
    )
    gate_up = random_blocks(ggml_type, experts * 2 * width, hidden, rng).with_activations(args.activations)
    down = random_blocks(ggml_type, experts * hidden, width, rng).with_activations(args.activations)

    def vector(*shape: int) -> torch.Tensor:
        return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32) * 0.1)

    weights = MoEWeights(
        router=torch.from_numpy(rng.standard_normal((experts, hidden), dtype=np.float32) * hidden**-0.5),
        gate_up=expert_weights(gate_up, experts, WeightFormat.FLOAT32),
        down=expert_weights(down, experts, WeightFormat.FLOAT32),
        router_bias=vector(experts) if gpt_oss else None,
        gate_up_bias=vector(experts, 2 * width) if gpt_oss else None,
        down_bias=vector(experts, hidden) if gpt_oss else None,
        # As a package's layer holds them: with the kernels, the one C call (moe_layer.c).
        gate_up_blocks=None if args.per_expert else gate_up,
        down_blocks=None if args.per_expert else down,
    )
    per_expert = (gate_up.nbytes + down.nbytes) / experts
    print(
        f"cpu flags: {' '.join(cpu_flags()) or 'none of AVX2, AVX-512, AMX'}; C kernels: {native.available()}; "
        f"threads {torch.get_num_threads()}; {args.shape}: experts {(gate_up.nbytes + down.nbytes) / 1e6:.1f} MB of "
        f"{ggml_type.name}; activations {args.activations}; {'the loop over experts' if args.per_expert else 'one call'}"
    )
    for rows in args.rows:
        # Each round's rows are new draws, routed to their own experts as a served round's are.
        rounds = [torch.from_numpy(rng.standard_normal((rows, hidden), dtype=np.float32)) for _ in range(args.rounds + 1)]
        touched_per_round = [
            len(set(moe_routes(x, weights, config, kernels=native.available()).experts.flatten().tolist())) for x in rounds
        ]
        times = []
        with torch.inference_mode():
            moe_mlp(rounds[0], weights, config, kernels=native.available())  # warm-up
            for x in rounds[1:]:
                start = time.perf_counter()
                moe_mlp(x, weights, config, kernels=native.available())
                times.append(time.perf_counter() - start)
        median = statistics.median(times)
        touched = round(statistics.median(touched_per_round[1:]))
        megabytes = touched * per_expert / 1e6
        print(
            f"rows {rows:3d}: {median * 1e3:7.2f} ms per layer (median of {args.rounds}); {touched:3d} experts touched, "
            f"{megabytes:6.1f} MB, {megabytes / 1e3 / median:5.1f} GB/s"
        )


if __name__ == "__main__":
    main()
