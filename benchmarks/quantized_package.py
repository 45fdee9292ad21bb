"""A quantized file of Llama-3.2-1B's or Llama-3.1-8B's shape, made here, exported by flare and served.

Random weights with the model's dimensions (`--shape 1b`: Llama-3.2-1B, 16 layers, hidden 2048,
FFN 8192, 32 heads, 8 KV heads of 64, tied embeddings; `--shape 8b`: Llama-3.1-8B, 32 layers, hidden
4096, FFN 14336, 32 heads, 8 KV heads of 128, its own LM head; both vocabulary 128256, plain RoPE;
`--layers N` keeps the first N layers, for a machine or a run too small for all) are written as an
F16 GGUF, with a
synthetic byte-level BPE vocabulary of that size, then quantized by `llama-quantize ... TYPE`
(the llama-cpp-python 0.3.36 sdist's build; `--type`, Q4_K_M by default, or another of the mixes
of the block types flare keeps: Q5_K_M, Q6_K, Q4_0, Q8_0; or Q3_K_M, whose Q3_K tensors have no
kernel: `--quantize q8_0|q4_k_m` stores them as blocks, as `flare export --quantize` does). flare exports the result under --dtype auto (every
tensor's blocks kept) and serves it; the script prints the file and package sizes, the types
kept, the export time, the one-stream rate of a greedy chat answer (random weights: the text means
nothing), a ~1,500-token prompt's prefill rate, and the daemon's resident memory, with its KV pools
counted as written whole (they become resident as they fill), against issue 38's bound (file + KV
cache + 15%); `benchmarks/moe_package.py` reports the same way (`export_and_serve`).

    .venv/bin/python benchmarks/quantized_package.py --workdir /tmp/q4km-1b \\
        --llama-quantize /work/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-quantize
    .venv/bin/python benchmarks/quantized_package.py --shape 8b --layers 8 --workdir /tmp/q4km-8b-8 ...
    .venv/bin/python benchmarks/quantized_package.py --type Q6_K --workdir /tmp/q6k-1b ...

The GGUF it leaves in the workdir is the file `benchmarks/compare.py --gguf` serves beside llama.cpp, and
WORKDIR/package its export (`--package`): one type a workdir, whose F16 file is written once.
"""

from __future__ import annotations

import argparse
from collections import Counter
import subprocess
import sys
import time
from pathlib import Path

import gguf
import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.integration.daemon_process import start_daemon  # noqa: E402

from flare.preparation.export import ExportOptions, export_package  # noqa: E402
from flare.package.byte_level import BYTE_LEVEL_ALPHABET  # noqa: E402
from flare.package.directory import open_package  # noqa: E402
from flare.package.manifest import QUANTIZE_TYPES  # noqa: E402

SHAPES = {
    "1b": {"layers": 16, "hidden": 2048, "ffn": 8192, "heads": 32, "kv_heads": 8, "head_dim": 64, "vocab": 128256, "tied": True},
    "8b": {"layers": 32, "hidden": 4096, "ffn": 14336, "heads": 32, "kv_heads": 8, "head_dim": 128, "vocab": 128256, "tied": False},
}
# llama-quantize's mixes whose every block type flare multiplies in place (docs/benchmarks.md):
# Q4_K_M and Q5_K_M keep Q6_K for the LM head and half of v and down, as llama.cpp decides.
TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q4_0", "Q8_0", "Q3_K_M")
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}<|im_start|>"


def vocabulary(size: int) -> tuple[list[str], list[int], list[str]]:
    """Three control tokens, the 256 byte-level characters, then merges of two characters and of
    a pair and a character, until `size` tokens: a valid byte-level BPE of that size."""
    alphabet = sorted(BYTE_LEVEL_ALPHABET.values())
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *alphabet]
    merges: list[str] = []
    pairs = [a + b for a in alphabet for b in alphabet]
    for a in alphabet:
        for b in alphabet:
            if len(tokens) < size:
                tokens.append(a + b)
                merges.append(f"{a} {b}")
    for pair in pairs:
        for c in alphabet:
            if len(tokens) >= size:
                break
            tokens.append(pair + c)
            merges.append(f"{pair} {c}")
        if len(tokens) >= size:
            break
    return tokens, [3, 3, 3] + [1] * (len(tokens) - 3), merges


def write_f16_gguf(path: Path, s: dict, seed: int) -> None:
    tokens, types, merges = vocabulary(s["vocab"])
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(s["layers"])
    writer.add_context_length(8192)
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["ffn"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(s["head_dim"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)
    h, f, q, kv = s["hidden"], s["ffn"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    # (name, shape): a norm's shape has one dimension and holds ones, a matrix's two and random
    # float16 values. The tensors are declared first and each is made only as it is written, so
    # the 16 GB of an 8B shape's 32 layers never sit in memory at once.
    tensors: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (s["vocab"], h)), ("output_norm.weight", (h,))]
    if not s["tied"]:
        tensors.append(("output.weight", (s["vocab"], h)))
    for i in range(s["layers"]):
        tensors += [(f"blk.{i}.attn_norm.weight", (h,)), (f"blk.{i}.ffn_norm.weight", (h,))]
        for name, shape in {
            "attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, q),
            "ffn_gate": (f, h), "ffn_up": (f, h), "ffn_down": (h, f),
        }.items():
            tensors.append((f"blk.{i}.{name}.weight", shape))
    for name, shape in tensors:
        dtype = np.float32 if len(shape) == 1 else np.float16
        writer.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, shape in tensors:
        if len(shape) == 1:
            writer.write_tensor_data(np.ones(shape, np.float32))
        else:
            rows, columns = shape
            writer.write_tensor_data((rng.standard_normal((rows, columns), dtype=np.float32) * columns**-0.5).astype(np.float16))
    writer.close()


def resident(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) // 1024
    return fields


def kv_pools_resident_mib(pid: int, pool_bytes: int) -> float:
    """Resident MiB of a daemon's KV pools: its anonymous mappings of whole pools (each pool is a
    mapping of its own, `kv_cache.zeroed_pool`, resident as its blocks fill; the kernel merges
    adjacent ones into one mapping, so a mapping of any whole number of pools counts)."""
    length = -(-pool_bytes // 4096) * 4096
    total, counted = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header; 5 fields: no path
            start, end = (int(v, 16) for v in fields[0].split("-"))
            counted = (end - start) % length == 0 and len(fields) == 5
        elif counted and fields[0] == "Rss:":
            total += int(fields[1])
    return total / 1024


# The daemon's KV cache, which the resident-memory bound counts: file + KV cache + 15%.
KV_CACHE = "1GiB"
KV_CACHE_MIB = 1024
# The long prompt of the prefill figure: words, about 1.5 characters a token in the synthetic vocabulary.
PREFILL_TEXT = " ".join(f"word{i % 97} the quick brown fox {i}" for i in range(2000))


def export_and_serve(gguf_file: Path, package: Path, tokens: int, prefill_chars: int, quantize: str | None = None) -> None:
    """Export `gguf_file` under --dtype auto, serve it at one stream and print: sizes and the
    types kept, a greedy chat answer's rate, a long prompt's prefill rate, and the daemon's
    resident memory against the bound of file + KV cache + 15%."""
    started = time.perf_counter()
    manifest = export_package(str(gguf_file), package, ExportOptions(overwrite=True, quantize=quantize))
    export_s = time.perf_counter() - started
    file_size = gguf_file.stat().st_size
    size = sum(p.stat().st_size for p in package.iterdir())
    print(f"GGUF {file_size:,} bytes; package {size:,} bytes ({size / file_size:.3f}x), exported in {export_s:.1f} s")
    counts = dict(sorted(Counter(manifest.dequantized.values()).items()))
    print("weight types:", open_package(package).weight_types(), "source tensors of types without a kernel:", counts or "none")
    daemon = start_daemon(package, ["--max-concurrency", "1", "--draft-tokens", "0", "--kv-cache-memory", KV_CACHE])
    try:
        body = {
            "model": daemon.model_name(), "messages": [{"role": "user", "content": "hello"}],
            "temperature": 0, "max_tokens": tokens,
        }
        started = time.perf_counter()
        answer = httpx.post(f"{daemon.base_url}/v1/chat/completions", json=body, timeout=600).json()
        seconds = time.perf_counter() - started
        done = answer["usage"]["completion_tokens"]
        print(f"one stream: {done} tokens in {seconds:.1f} s ({done / seconds:.2f} tok/s, prefill included)")
        # Prefill: one long prompt, one token out (the answer's time is the prompt's).
        body = {**body, "messages": [{"role": "user", "content": PREFILL_TEXT[:prefill_chars]}], "max_tokens": 1}
        started = time.perf_counter()
        answer = httpx.post(f"{daemon.base_url}/v1/chat/completions", json=body, timeout=1200).json()
        seconds = time.perf_counter() - started
        prompt = answer["usage"]["prompt_tokens"]
        print(f"prefill: {prompt} prompt tokens in {seconds:.1f} s ({prompt / seconds:.1f} tok/s)")
        memory = resident(daemon.process.pid)
        bound = (file_size / 2**20 + KV_CACHE_MIB) * 1.15
        # The KV pools become resident as their blocks fill: the bound is held with them written whole.
        (loaded,) = daemon.events("engine_loaded")
        model = open_package(package).manifest.model
        layout = model.kv_layout
        element = 4 if loaded["kv_cache_dtype"] == "float32" else 2
        positions = loaded["kv_cache_blocks"] * loaded["block_size"]
        pools = [positions * layout.heads * width * element for width in (layout.key_dim, layout.value_dim) if width]
        written = sum(kv_pools_resident_mib(daemon.process.pid, size) for size in set(pools))
        whole = memory["VmRSS"] - written + sum(pools) * model.num_layers / 2**20
        verdict = "within" if whole <= bound else "OVER"
        print(
            f"daemon resident memory (MiB): {memory}, of it KV pools {written:.0f}; with the KV pools written whole "
            f"{whole:.0f}; bound file + KV cache + 15% = {bound:.0f} MiB: {verdict}"
        )
    finally:
        daemon.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--llama-quantize", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens of the chat answer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--layers", type=int, help="keep the first N layers (default: all of the shape's)")
    parser.add_argument("--type", choices=TYPES, default="Q4_K_M", help="llama-quantize's type (default Q4_K_M)")
    parser.add_argument("--quantize", choices=QUANTIZE_TYPES, help="flare export --quantize: tensors without a kernel as blocks")
    parser.add_argument("--prefill-chars", type=int, default=2300, help="characters of the prefill prompt (about 1,500 tokens)")
    args = parser.parse_args()
    shape = dict(SHAPES[args.shape])
    if args.layers is not None:
        if not 1 <= args.layers <= shape["layers"]:
            parser.error(f"--layers must lie in [1, {shape['layers']}] for the {args.shape} shape")
        shape["layers"] = args.layers
    args.workdir.mkdir(parents=True, exist_ok=True)
    stem = f"llama-{args.shape}-shape-{shape['layers']}-layers"
    f16, quantized = args.workdir / f"{stem}.F16.gguf", args.workdir / f"{stem}.{args.type}.gguf"
    if not f16.exists():
        write_f16_gguf(f16, shape, args.seed)
    if not quantized.exists():
        subprocess.run([str(args.llama_quantize), str(f16), str(quantized), args.type], check=True, capture_output=True)
    export_and_serve(quantized, args.workdir / "package", args.tokens, args.prefill_chars, args.quantize)


if __name__ == "__main__":
    main()
