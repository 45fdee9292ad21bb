"""Latent attention's two forms on one DeepSeek-V2-Lite-shaped layer (16 heads, kv_lora_rank 512,
nope 128, rope 64, value 128, no q_lora_rank, random weights): a decode round of `--rows` rows over
`--context` cached tokens and a prompt chunk of `--chunk` tokens, each absorbed (decode: reading
the pool through the paged kernel, and gathering it in torch) and decompressed
(engine/layers/latent_attention.py), best of `--repeats`.

    .venv/bin/python benchmarks/latent_attention.py [--context 1024] [--rows 8] [--chunk 512]
"""

from __future__ import annotations

import argparse
import time

import torch

from flare.engine.batch import ForwardBatch, ForwardRow
from flare.engine.kv_cache import BlockAllocator, KVCache
from flare.engine.layers.latent_attention import latent_attention
from flare.engine.layers.rope import rope_tables, round_tables
from flare.engine.model import DecoderModel
from flare.package.directory import expected_weight_shapes
from flare.package.model_config import LatentAttention, ModelConfig

BLOCK = 16


def layer_model(heads: int) -> DecoderModel:
    latent = LatentAttention(q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    config = ModelConfig(
        vocab_size=256, hidden_size=2048, intermediate_size=64, num_layers=1, num_heads=heads, num_kv_heads=heads,
        head_dim=192, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=None, eos_token_ids=(0,), architecture="deepseek2", rotary_dim=64, latent_attention=latent,
    )
    torch.manual_seed(0)
    state = {
        name: torch.randn(shape) / (shape[-1] ** 0.5 if len(shape) == 2 else 1.0)
        for name, shape in expected_weight_shapes(config).items()
    }
    return DecoderModel(config, state)


def timed(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model = layer_model(args.heads)
    config = model.config
    layer = model.layers[0].latent
    assert layer is not None
    cache = KVCache.for_config(config, args.rows * (args.context // BLOCK + 2) + args.chunk // BLOCK + 2, BLOCK)
    allocator = BlockAllocator(cache.num_blocks)
    tables = [allocator.allocate(args.context // BLOCK + 1) for _ in range(args.rows)]
    decode = ForwardBatch.build([ForwardRow([1], args.context, table, num_logits=1) for table in tables], BLOCK)
    chunk_table = allocator.allocate(args.chunk // BLOCK + 1)
    chunk = ForwardBatch.build([ForwardRow([1] * args.chunk, 0, chunk_table, num_logits=1)], BLOCK)
    tables_ = rope_tables(config, torch.float32, "cpu")
    with torch.inference_mode():
        for name, batch in (("decode", decode), ("prefill chunk", chunk)):
            x = torch.randn(batch.num_tokens, config.hidden_size)
            rope = round_tables([tables_], batch.positions)[0]
            # The absorbed form reads the pool through the paged kernel (kernels, short rows) or
            # gathers each row's cached rows first (torch).
            forms = [("absorbed, paged kernel", True, True)] if name == "decode" else []
            forms += [("absorbed, gathered", True, False), ("decompressed", False, False)]
            for form, absorbed, kernels in forms:
                seconds = timed(
                    lambda: latent_attention(x, layer, batch, config, cache.keys[0], rope, absorbed=absorbed, kernels=kernels),
                    args.repeats,
                )
                print(f"{name:<14} {form:<23} {seconds * 1e3:8.2f} ms  ({batch.num_tokens} tokens, context {args.context if name == 'decode' else args.chunk})")


if __name__ == "__main__":
    main()
