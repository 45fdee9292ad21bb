"""The paged attention kernel alone: one row's attention over its cached keys, as one layer of a
decode (query length 1) or verify (1 + drafts) round calls it.

The default model's attention shape (9 query heads on 3 KV heads of 64, blocks of 16 positions),
its pool in each --kv-cache-dtype, the row's blocks scattered through the pool (as a long-running
daemon's are: the allocator hands out whatever is free) or, with --contiguous, in order. Prints
the median time a call over --repeats batches of --calls, the pool's dtypes alternating.

    .venv/bin/python benchmarks/paged_attention.py --context 200 2000 8000 --query-len 1 5
    .venv/bin/python benchmarks/paged_attention.py --context 8000 --kv-cache-dtype float32 float16 bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flare.engine import _native, native
from flare.engine.precision import cpu_flags

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, nargs="+", default=[200, 2000, 8000], help="cached positions before the row")
    parser.add_argument("--query-len", type=int, nargs="+", default=[1, 5], help="the row's new tokens")
    parser.add_argument("--kv-cache-dtype", nargs="+", choices=DTYPES, default=["float32", "float16", "bfloat16"])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--contiguous", action="store_true", help="the row's blocks in order in the pool")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    print(f"cpu flags: {' '.join(cpu_flags())}; threads {args.threads}; key range {_native.ATTENTION_KEY_RANGE}; "
          f"blocks {'in order' if args.contiguous else 'scattered'}")
    print("| context | query length | " + " | ".join(f"{name} ms" for name in args.kv_cache_dtype) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in args.kv_cache_dtype) + " |")
    for context in args.context:
        for query_len in args.query_len:
            blocks = -(-(context + query_len) // args.block_size)
            shape = (args.kv_heads, blocks, args.block_size, args.head_dim)
            pools = {name: [torch.randn(shape, generator=generator).to(DTYPES[name]) for _ in range(2)] for name in args.kv_cache_dtype}
            order = torch.arange(blocks) if args.contiguous else torch.randperm(blocks, generator=generator)
            table = order.to(torch.int64)[None]
            start = torch.tensor([context], dtype=torch.int64)
            q = torch.randn(query_len, args.heads, args.head_dim, generator=generator)
            times: dict[str, list[float]] = {name: [] for name in args.kv_cache_dtype}
            for name, (keys, values) in pools.items():  # warm-up
                native.paged_attention(q, keys, values, table, start, query_len)
            for _ in range(args.repeats):
                for name, (keys, values) in pools.items():
                    started = time.perf_counter()
                    for _ in range(args.calls):
                        native.paged_attention(q, keys, values, table, start, query_len)
                    times[name].append((time.perf_counter() - started) / args.calls * 1000)
            cells = " | ".join(f"{statistics.median(times[name]):.3f}" for name in args.kv_cache_dtype)
            print(f"| {context} | {query_len} | {cells} |")


if __name__ == "__main__":
    main()
