"""The KV cache's bytes a token of a DeepSeek-V3-shaped model: flare's against llama.cpp's server's,
on one GGUF written by llama.cpp's own converter.

The checkpoint has DeepSeek-V3's attention and depth (61 layers, q_lora_rank 1536, kv_lora_rank
512, nope 128, rope 64, value 128) and is tiny everywhere the cache does not look (hidden 64, 2
heads, dense MLPs of 64, the default model's vocabulary), random weights, saved by transformers
with `scoring_func` named as DeepSeek's own config.json does. llama.cpp's `convert_hf_to_gguf.py`
writes it as an f16 GGUF (its MLA layout: `attn_k_b` / `attn_v_b`, `key_length_mla`), which
`flare export` makes a package. Reported:

- flare: the bytes a token `flare inspect` states for each KV dtype, and the bytes the pools
  `flare run` allocates for a budget, divided by the tokens they hold (`KVCache.for_budget`);
- llama.cpp: its server's own log of the cache it allocated at `-c CONTEXT` (the line
  `llama_kv_cache: ... K (f16): X MiB, V (f16): Y MiB`), divided by CONTEXT.

    .venv/bin/python benchmarks/latent_kv_bytes.py --workdir /tmp/latent-kv \\
        --converter /work/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py \\
        --llama-server /work/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server
"""

from __future__ import annotations

import argparse
import io
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.gguf_writer import convert_with_llama_cpp  # noqa: E402

from flare.engine.kv_cache import KVCache  # noqa: E402
from flare.package.directory import open_package  # noqa: E402
from flare.preparation.default_model import default_gguf_path  # noqa: E402
from flare.preparation.export import ExportOptions, export_package  # noqa: E402
from flare.preparation.gguf_source import open_gguf  # noqa: E402
from flare.preparation.inspect import inspect_package  # noqa: E402

LAYERS = 61
ATTENTION = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
# llama.cpp's line for the cache it allocated: its size in MiB, K's and V's (V may be 0: a view of K).
KV_LINE = re.compile(r"llama_kv_cache: size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers.*K \((\w+)\): +([\d.]+) MiB, V \((\w+)\): +([\d.]+) MiB")


def write_checkpoint(directory: Path, seed: int) -> None:
    import transformers

    source = open_gguf(default_gguf_path())
    config = transformers.DeepseekV3Config(
        vocab_size=49152, hidden_size=64, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=2,
        num_key_value_heads=2, first_k_dense_replace=LAYERS, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
        **ATTENTION,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    settings = json.loads((directory / "config.json").read_text())
    settings.update(scoring_func="sigmoid", topk_method="noaux_tc")  # as DeepSeek-V3's config.json names them
    (directory / "config.json").write_text(json.dumps(settings))
    (directory / "tokenizer.json").write_text(source.tokenizer_json)
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": source.chat_template}))


def llama_cpp_cache(server: Path, gguf: Path, context: int, port: int) -> dict[str, float]:
    """The cache llama-server allocated for `gguf` at `-c context`, from its log (`-v`: the line is
    logged at its verbose level)."""
    command = [str(server), "-m", str(gguf), "-c", str(context), "-np", "1", "-t", "2", "--port", str(port), "-v"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 300
        assert process.stdout is not None
        for line in process.stdout:
            seen.append(line)
            if (match := KV_LINE.search(line)) is not None:
                size, cells, layers, k_type, k_mib, v_type, v_mib = match.groups()
                return {"cells": int(cells), "layers": int(layers), "mib": float(size), "k_type": k_type, "k_mib": float(k_mib),
                        "v_type": v_type, "v_mib": float(v_mib)}
            if time.monotonic() > deadline:
                break
    finally:
        process.kill()
        process.wait()
    raise SystemExit("llama-server logged no KV cache line:\n" + "".join(seen[-30:]))


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--converter", type=Path, required=True, help="llama.cpp's convert_hf_to_gguf.py")
    parser.add_argument("--llama-server", type=Path, required=True)
    parser.add_argument("--context", type=int, default=4096, help="llama.cpp's -c: the tokens its cache holds")
    parser.add_argument("--port", type=int, default=18931)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    args.workdir.mkdir(parents=True, exist_ok=True)
    checkpoint, gguf, package = args.workdir / "hf", args.workdir / "deepseek-v3-attention-61-layers.f16.gguf", args.workdir / "package"
    if not gguf.is_file():
        write_checkpoint(checkpoint, args.seed)
        convert_with_llama_cpp([(checkpoint, gguf)], outtype="f16", converter=args.converter)
    if not package.is_dir():
        export_package(str(gguf), package, ExportOptions(), stderr=io.StringIO())
    config = open_package(package).manifest.model
    stated = inspect_package(package)["kv_cache"]["bytes_per_token"]
    print(f"{gguf.name}: {LAYERS} layers, kv_lora_rank {ATTENTION['kv_lora_rank']}, rope {ATTENTION['qk_rope_head_dim']}")
    print(f"flare inspect: bytes a token {', '.join(f'{n} {dtype}' for dtype, n in stated.items())}")
    for dtype in (torch.float32, torch.bfloat16):
        cache = KVCache.for_budget(config, 256 * 1024**2, block_size=16, dtype=dtype, device=torch.device("cpu"))
        pools = sum(pool.nbytes for pool in (*cache.keys, *cache.values))
        tokens = cache.num_tokens
        print(f"flare pools ({str(dtype).removeprefix('torch.')}): {pools:,} bytes for {tokens:,} tokens, {pools / tokens:,.0f} a token")
    theirs = llama_cpp_cache(args.llama_server, gguf, args.context, args.port)
    per_token = (theirs["k_mib"] + theirs["v_mib"]) * 1024**2 / theirs["cells"]
    print(
        f"llama.cpp: {theirs['cells']:,} cells, {theirs['layers']} layers, K ({theirs['k_type']}) {theirs['k_mib']} MiB, "
        f"V ({theirs['v_type']}) {theirs['v_mib']} MiB: {per_token:,.0f} bytes a token"
    )


if __name__ == "__main__":
    main()
