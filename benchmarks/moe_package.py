"""A Q4_K_M file of Qwen3-30B-A3B's shape (fewer layers), made here, exported by flare and served.

Random weights with the model's dimensions (GGUF arch `qwen3moe`: hidden 2048, 128 experts of 768
(`expert_feed_forward_length`) of which 8 are active, softmax routing with `norm_topk_prob`, 32
heads and 4 KV heads of 128, q/k norms, its own LM head; `--layers N` of its 48, default 4; the
synthetic byte-level BPE vocabulary of benchmarks/quantized_package.py, 151936 tokens as the
model's, or fewer with --vocab) are written as an F16 GGUF tensor by tensor (a 4-layer file is
about 6 GB, never held in memory whole), then quantized by `llama-quantize ... Q4_K_M`. flare
exports the result under --dtype auto (every tensor's blocks kept, the experts stacked) and
serves it; the script prints the file and package sizes, the daemon's resident memory after one
greedy chat answer against the bound "file + KV cache + 15%" (experts mapped, never copied), and
the one-stream rate of that answer (random weights: the text means nothing), and the prefill rate
of a prompt of about 1,500 tokens (--prefill-chars).

All 48 layers would be a 61 GB F16 file before quantizing. `--distinct-layers M` makes the first M
as above (the M-layer Q4_K_M, kept in the workdir) and writes the N-layer file from it, layer i's
blocks those of layer i mod M: the model's full size and per-token traffic (a 48-layer file is
17.3 GiB, as the real Q4_K_M's), from a 4-layer quantization:

    .venv/bin/python benchmarks/moe_package.py --workdir /tmp/qwen3moe-48 --layers 48 --distinct-layers 4 \
        --llama-quantize /work/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-quantize

    .venv/bin/python benchmarks/moe_package.py --workdir /tmp/qwen3moe-4 \\
        --llama-quantize /work/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-quantize

The Q4_K_M GGUF and the package it leaves in the workdir are what `benchmarks/compare.py --gguf
FILE --package PACKAGE` serves beside llama.cpp (docs/benchmarks.md, "Mixture-of-experts against
llama.cpp").
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.quantized_package import CHAT_TEMPLATE, export_and_serve, vocabulary  # noqa: E402


# Qwen3-30B-A3B's config.json (48 layers).
SHAPE = {
    "layers": 48, "hidden": 2048, "experts": 128, "active": 8, "expert_ffn": 768, "ffn": 6144,
    "heads": 32, "kv_heads": 4, "head_dim": 128, "vocab": 151936,
}


def write_f16_gguf(path: Path, s: dict, seed: int) -> None:
    """The file as convert_hf_to_gguf.py lays out a qwen3moe checkpoint, each tensor generated as
    it is written (`add_tensor_info` first, then the data in the same order)."""
    tokens, types, merges = vocabulary(s["vocab"])
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_block_count(s["layers"])
    writer.add_context_length(8192)
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["ffn"])
    writer.add_expert_feed_forward_length(s["expert_ffn"])
    writer.add_expert_count(s["experts"])
    writer.add_expert_used_count(s["active"])
    writer.add_expert_weights_norm(True)  # norm_topk_prob
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_key_length(s["head_dim"])
    writer.add_value_length(s["head_dim"])
    writer.add_rope_freq_base(1000000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)
    h, e, f, hd = s["hidden"], s["experts"], s["expert_ffn"], s["head_dim"]
    q, kv = s["heads"] * hd, s["kv_heads"] * hd
    shapes: dict[str, tuple[tuple[int, ...], type]] = {
        "token_embd.weight": ((s["vocab"], h), np.float16),
        "output_norm.weight": ((h,), np.float32),
        "output.weight": ((s["vocab"], h), np.float16),
    }
    for i in range(s["layers"]):
        shapes |= {
            f"blk.{i}.attn_norm.weight": ((h,), np.float32),
            f"blk.{i}.attn_q.weight": ((q, h), np.float16),
            f"blk.{i}.attn_k.weight": ((kv, h), np.float16),
            f"blk.{i}.attn_v.weight": ((kv, h), np.float16),
            f"blk.{i}.attn_output.weight": ((h, q), np.float16),
            f"blk.{i}.attn_q_norm.weight": ((hd,), np.float32),
            f"blk.{i}.attn_k_norm.weight": ((hd,), np.float32),
            f"blk.{i}.ffn_norm.weight": ((h,), np.float32),
            f"blk.{i}.ffn_gate_inp.weight": ((e, h), np.float32),
            f"blk.{i}.ffn_gate_exps.weight": ((e, f, h), np.float16),
            f"blk.{i}.ffn_up_exps.weight": ((e, f, h), np.float16),
            f"blk.{i}.ffn_down_exps.weight": ((e, h, f), np.float16),
        }
    for name, (shape, dtype) in shapes.items():
        writer.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, (shape, dtype) in shapes.items():
        if len(shape) == 1:  # norms: ones
            writer.write_tensor_data(np.ones(shape, np.float32))
            continue
        # Rows of unit variance in the output: N(0, 1 / in). Stacked experts one expert at a time.
        tensor = np.empty(shape, dtype)
        for part in tensor.reshape(-1, *shape[-2:]):
            part[...] = rng.standard_normal(part.shape, dtype=np.float32) * shape[-1] ** -0.5
        writer.write_tensor_data(tensor)
    writer.close()


def repeat_layers(source: Path, target: Path, layers: int) -> None:
    """`source`'s GGUF with `layers` layers, layer i's tensors (blocks as they are) those of layer
    i mod the source's layer count; every other key and tensor as in `source`."""
    reader = gguf.GGUFReader(str(source))
    arch = str(reader.fields["general.architecture"].contents())
    block_count = f"{arch}.block_count"
    distinct = int(reader.fields[block_count].contents())
    writer = gguf.GGUFWriter(str(target), arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        value = layers if field.name == block_count else field.contents()
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub_type)
    tensors = {t.name: t for t in reader.tensors}
    names: list[tuple[str, str]] = []  # (name written, source tensor)
    for name in tensors:
        if not name.startswith("blk."):
            names.append((name, name))
    for i in range(layers):
        prefix = f"blk.{i % distinct}."
        names += [(f"blk.{i}." + n[len(prefix):], n) for n in tensors if n.startswith(prefix)]
    for name, source_name in names:
        tensor = tensors[source_name]
        writer.add_tensor_info(name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, source_name in names:
        writer.write_tensor_data(tensors[source_name].data)
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--llama-quantize", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens of the chat answer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=4, help="the first N of the model's 48 layers")
    parser.add_argument(
        "--distinct-layers", type=int, help="quantize only the first M layers and repeat them to --layers (default: all distinct)"
    )
    parser.add_argument("--prefill-chars", type=int, default=2300, help="characters of the prefill prompt (about 1,500 tokens)")
    parser.add_argument("--vocab", type=int, default=SHAPE["vocab"], help="the synthetic vocabulary's size")
    args = parser.parse_args()
    shape = dict(SHAPE, layers=args.layers, vocab=args.vocab)
    if not 1 <= args.layers <= SHAPE["layers"]:
        parser.error(f"--layers must lie in [1, {SHAPE['layers']}]")
    distinct = args.layers if args.distinct_layers is None else args.distinct_layers
    if not 1 <= distinct <= args.layers:
        parser.error("--distinct-layers must lie in [1, --layers]")
    args.workdir.mkdir(parents=True, exist_ok=True)
    stem = f"qwen3moe-30b-a3b-shape-{distinct}-layers"
    f16, q4km, package = args.workdir / f"{stem}.F16.gguf", args.workdir / f"{stem}.Q4_K_M.gguf", args.workdir / "package"
    if not q4km.exists():
        shape = dict(shape, layers=distinct)
        if not f16.exists():
            started = time.perf_counter()
            write_f16_gguf(f16, shape, args.seed)
            print(f"F16 GGUF {f16.stat().st_size:,} bytes written in {time.perf_counter() - started:.0f} s")
        subprocess.run([str(args.llama_quantize), str(f16), str(q4km), "Q4_K_M"], check=True, capture_output=True)
        f16.unlink()  # the F16 file is only llama-quantize's input
    if distinct < args.layers:
        repeated = args.workdir / f"qwen3moe-30b-a3b-shape-{args.layers}-layers-of-{distinct}.Q4_K_M.gguf"
        if not repeated.exists():
            started = time.perf_counter()
            repeat_layers(q4km, repeated, args.layers)
            print(f"{repeated.name}: {repeated.stat().st_size:,} bytes written in {time.perf_counter() - started:.0f} s")
        q4km = repeated
    export_and_serve(q4km, package, args.tokens, args.prefill_chars)


if __name__ == "__main__":
    main()
