"""flare against llama.cpp's server and Hugging Face transformers, on the same GGUF, in one run.

    .venv/bin/python benchmarks/compare.py                                   # the published matrix
    .venv/bin/python benchmarks/compare.py --concurrency 1,8 --datasets chat # a subset
    .venv/bin/python benchmarks/compare.py --skip-llama-cpp --skip-transformers
    .venv/bin/python benchmarks/compare.py --gguf FILE.gguf --package PACKAGE --skip-transformers  # another GGUF
    .venv/bin/python benchmarks/compare.py --skip-throughput --skip-speculation --skip-transformers \
        --concurrency 1 --long-prompt-tokens 1500 --long-prompt-runs 5              # cold long-prompt TTFT alone
    .venv/bin/python benchmarks/compare.py --package PACKAGE --versus-draft-tokens 4 --skip-llama-cpp \
        --skip-transformers --datasets copy                                      # two draft lengths side by side

The servers are driven by `flare bench` (flare/bench/), one level at a time:
- flare, the default model's package as `flare run` serves it on this machine (speculation at
  the package's draft length), and the same with `--draft-tokens 0` (and, if asked, with another
  --drafter, --draft-tokens or the default model's package in another dtype: the --versus-* options);
- llama.cpp's server on the default model's GGUF (`-t THREADS -np MAX_CONCURRENCY
  -c SLOT_CONTEXT*MAX_CONCURRENCY --cont-batching`), built once from the llama.cpp source that the `llama-cpp-python` sdist
  vendors, into --llama-cpp-dir (default $FLARE_CACHE_DIR/llama.cpp or ~/.cache/flare/llama.cpp),
  unless --llama-server names a binary;
- transformers, the offline reference: `generate` on the same GGUF weights in float32, in this
  process, a static batch of N prompts per concurrency N (left padding), aggregate tokens/s only.

Both flare daemons get a KV cache of --kv-cache-memory (1 GiB: 32 streams of a chat prompt and
128 tokens need about 0.5), so that two daemons, llama.cpp and transformers fit in memory at once.
All servers are up for the whole run, each idle while another is measured (with
--one-server-at-a-time, for files too large to share the page cache, each side is started, warmed,
measured at every level and stopped in turn, --turns times, each level's median turn counting:
the slower of the middle two for an even count). For every dataset,
temperature and concurrency the systems take turns (flare, flare K=0, llama.cpp, transformers),
so a slow patch of the shared machine falls on all of them; with --turns N they take N turns at
each level, the first rotating, and a ratio of two sides is the median of their turns' ratios,
for a machine whose speed changes within seconds (docs/benchmarks.md). Every level and turn sends
the set's prompts (in one seeded order) each opened by a nonce of its own ("Request 1a2b3c4d."),
the same to every side, so that no server's prompt cache holds them from a level before (flare's
prefix cache and llama.cpp's slots and `--cache-ram` alike) and every level computes its prompts;
the servers are warmed before the first level on the set's prompts as they are. Greedy is temperature 0; sampled runs
send temperature T with top_p 0.9, top_k off and min_p 0 to every system alike (transformers:
do_sample with the same), so no server applies a default filter the others do not. Every request
also turns the penalties off (frequency and presence 0, repetition 1: llama.cpp's and transformers'
defaults), since the default package's policy adds a repetition penalty of 1.1 and a frequency
penalty of 0.3 that would change flare's answers alone, and on `copy` would penalize the very
repetition the text asks for.

With --long-prompt-tokens N, after the throughput matrix (--skip-throughput leaves that out),
every flare side and llama.cpp get --long-prompt-runs cold prompts of N tokens (one chat turn,
counted with the model's own tokenizer and chat template), the same prompt to each in turn, the
side that goes first rotating, after one uncounted warm-up prompt each. Every prompt's first words
(its system message) are its own nonce, so no two share more than the chat template's opening
tokens and no prefix cache shortens one. Each asks for one token, streamed; its time to first
token is the whole request's (prefill, the token, the stream's close: a first token that is an
incomplete UTF-8 piece streams no text). The figures are each side's median and its ratio to
llama.cpp's. llama.cpp's server keeps its defaults as operators run it (`-ub 512 -b 2048`,
`--cache-reuse` 0, prompt caching on, which the nonces make moot); only its slot context grows to
hold the prompt (-c is max(--slot-context, N + 64) x -np).

Writes into --out-dir: one `flare bench` result per system, dataset and temperature (levels
merged), `comparison.json` (every figure and setting) and plots per dataset and temperature
(`flare bench plot` of the three servers); prints a markdown table.
"""

from __future__ import annotations

import os

from flare.engine.openmp import set_wait_policy

# Every side waits between OpenMP regions as `flare run` makes it (flare/engine/openmp.py), set
# before torch loads OpenMP; an OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment wins.
set_wait_policy(os.environ)

import argparse
import asyncio
import contextlib
import json
import random
import secrets
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flare.bench.client import Endpoint, RequestRecord, stream_chat
from flare.bench.datasets import load_dataset, report
from flare.bench.plot import write_plots
from flare.bench.report import machine, versions
from flare.engine.tokenizer import Tokenizer
from flare.package.manifest import AUTO_DTYPE, DTYPES

LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendored llama.cpp is built (docs/benchmarks.md)
SAMPLED_FILTERS = {"top_p": 0.9, "top_k": -1, "min_p": 0.0}
# Sent at every temperature, so that no system applies a penalty. llama.cpp's server ignores
# `repetition_penalty` (its own `repeat_penalty` defaults to 1.0, off); flare refuses unknown fields.
NO_PENALTIES = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}
# The long-prompt level asks for one token and times the whole streamed request: prefill, the one
# token and the stream's close. Timing the first content chunk instead fails where that token is
# an incomplete UTF-8 piece, which a server streams as no text (random-weights files do this).
LONG_PROMPT_ANSWER_TOKENS = 1


def slug(name: str) -> str:
    """A system's label as a file name part: "flare K=0" -> "flare_K0"."""
    return name.replace(" ", "_").replace("=", "")


def dataset_label(dataset: str) -> str:
    """A dataset as a file name part: a shipped set's name, a JSONL file's stem."""
    return Path(dataset).stem if dataset.endswith(".jsonl") else dataset


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen[str], name: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        time.sleep(0.5)
    raise RuntimeError(f"{name} did not become healthy in {timeout_s:g} s")


@contextlib.contextmanager
def server_process(command: list[str], env: dict[str, str], name: str, url: str, log: Path) -> Iterator[int]:
    """A server subprocess, its output in `log`, healthy on entry and stopped on exit; yields its pid."""
    with log.open("w") as output:
        process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT, text=True)
        try:
            wait_healthy(url, process, name)
            yield process.pid
        finally:
            process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=60)
            if process.poll() is None:
                process.kill()


def llama_server_binary(cache_dir: Path) -> Path:
    """llama.cpp's server, built once into `cache_dir` from the llama-cpp-python sdist's vendored source."""
    source = cache_dir / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    binary = source / "build" / "bin" / "llama-server"
    if binary.is_file():
        return binary
    for tool in ("cmake", "ninja"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"building llama.cpp needs {tool}: pip install {tool} (or apt-get install {tool})")
    cache_dir.mkdir(parents=True, exist_ok=True)
    print(f"building llama.cpp's server into {source} (about 8 minutes on 2 cores, once)", flush=True)
    sdist = cache_dir / "sdist"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
         f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(sdist)],
        check=True,
    )
    with tarfile.open(next(sdist.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"))) as archive:
        archive.extractall(cache_dir, filter="data")
    subprocess.run(
        ["cmake", "-B", "build", "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
         "-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF",
         "-DLLAMA_BUILD_EXAMPLES=OFF"],
        cwd=source, check=True,
    )
    subprocess.run(["cmake", "--build", "build", f"-j{os.cpu_count() or 2}", "--target", "llama-server"], cwd=source, check=True)
    return binary


class TransformersReference:
    """Hugging Face transformers `generate` on the default GGUF's weights, float32, in this process."""

    def __init__(self, gguf: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
        self.generate(["Hello"], 8, 0.0)  # warm, as the servers are warmed

    def generate(self, prompts: list[str], max_tokens: int, temperature: float) -> tuple[float, int]:
        """Seconds for one static batch, and the tokens generated up to each row's EOS."""
        import torch

        tokenizer = self.tokenizer
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True) for p in prompts]
        inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        sampling: dict[str, Any] = {"do_sample": False}
        if temperature > 0:
            sampling = {"do_sample": True, "temperature": temperature, "top_p": SAMPLED_FILTERS["top_p"], "top_k": 0}
        started = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(**inputs, max_new_tokens=max_tokens, pad_token_id=tokenizer.pad_token_id, **sampling)
        seconds = time.perf_counter() - started
        count = 0
        for row in out[:, inputs["input_ids"].shape[1]:].tolist():
            count += next((i + 1 for i, t in enumerate(row) if t == tokenizer.eos_token_id), len(row))
        return seconds, count


@dataclass(frozen=True)
class Server:
    name: str  # the label in tables and plots
    url: str



def bench_level(server: Server, dataset: str, temperature: float, concurrency: int, args: argparse.Namespace,
                out: Path, warmup: int, requests: int | None = None) -> dict[str, Any]:
    """One `flare bench` level against one server (a subprocess: the CLI exactly as users run it)."""
    extra = {**NO_PENALTIES, **(SAMPLED_FILTERS if temperature > 0 else {})}
    command = [
        sys.executable, "-m", "flare.cli.main", "bench", "--url", server.url, "--dataset", dataset,
        "--concurrency", str(concurrency), "--requests", str(requests or requests_at(concurrency, args)),
        "--max-tokens", str(args.max_tokens), "--temperature", str(temperature), "--warmup", str(warmup),
        "--seed", str(args.seed), "--label", server.name, "--out", str(out),
    ]
    command += ["--extra-body", json.dumps(extra)]
    if args.level_duration:
        command += ["--duration", str(args.level_duration)]
    subprocess.run(command, check=False, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def report_level(name: str, dataset: str, temperature: float, concurrency: int, result: dict[str, Any], turn: int | None) -> None:
    level = result["levels"][0]
    where = "" if turn is None else f" (turn {turn + 1})"
    print(f"{dataset} T={temperature:g} c={concurrency} {name}{where}: {level['output_tok_s']:.1f} tok/s "
          f"({level['completed']} ok, {level['failed']} failed)", flush=True)


def requests_at(concurrency: int, args: argparse.Namespace) -> int:
    return max(args.min_requests, args.waves * concurrency)


def merge_levels(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The one-level results of one system, dataset and temperature as one result of several levels."""
    merged = dict(results[0])
    merged["levels"] = [level for result in results for level in result["levels"]]
    merged["finished"] = results[-1]["finished"]
    return merged


def nonced_dataset(dataset: str, nonce: str, path: Path) -> Path:
    """The set's conversations as a `flare bench` JSONL file at `path`, each first user turn
    opened by "Request NONCE.": its prompts are then new to every server's prompt cache (all
    but the chat template's opening and any system message), as distinct users' would be."""
    lines = []
    for conversation in load_dataset(dataset):
        if any(m["role"] != "system" for m in conversation.history) or len(conversation.history) > 1:
            raise SystemExit(f"--datasets {dataset}: a conversation with history other than one system message")
        first, *rest = conversation.turns
        entry: dict[str, Any] = {"turns": [f"Request {nonce}.\n\n{first}", *rest]}
        if conversation.history:
            entry["system"] = conversation.history[0]["content"]
        if conversation.max_tokens is not None:
            entry["max_tokens"] = conversation.max_tokens
        lines.append(json.dumps(entry))
    path.write_text("\n".join(lines) + "\n")
    return path


def prompts_of(dataset: str) -> list[str]:
    return [conversation.turns[0] for conversation in load_dataset(dataset)]


def long_prompt(tokenizer: Tokenizer, tokens: int, nonce: str) -> tuple[list[dict[str, str]], int]:
    """A chat of `tokens` prompt tokens as the model's tokenizer and chat template count them (or
    the longest cut of its text within that), and its count. `nonce` is the whole system message,
    the first words after the template's opening tokens: a template's default system prompt
    (SmolLM2's is 26 tokens) would otherwise be a prefix every prompt shares, and prompts with
    different nonces share nothing a prefix cache could reuse."""
    text = tokenizer.encode(report(tokens, random.Random(nonce)), add_special_tokens=False)

    def cut(n: int) -> tuple[list[dict[str, str]], int]:
        messages = [{"role": "system", "content": nonce}, {"role": "user", "content": tokenizer.decode(text[:n])}]
        return messages, len(tokenizer.encode_chat(messages))

    low, high = 0, len(text)  # binary search for the longest cut within `tokens`
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if cut(middle)[1] <= tokens else (low, middle - 1)
    return cut(low)


def served_model(url: str) -> str:
    """The first model id the server's /v1/models lists."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as response:
        return json.loads(response.read())["data"][0]["id"]


async def long_prompt_level(servers: list[Server], tokenizer: Tokenizer, tokens: int, runs: int) -> dict[str, Any]:
    """Cold time to first token of `runs` distinct prompts of `tokens` tokens on every server,
    one request at a time, the servers taking turns and the one that goes first rotating; each
    server first answers one uncounted prompt of the same length (warm-up)."""
    import aiohttp

    endpoints = {s.name: Endpoint(s.url, served_model(s.url)) for s in servers}
    records: dict[str, list[RequestRecord]] = {s.name: [] for s in servers}
    counts: list[int] = []
    # A fresh connection per request: llama.cpp's server drops an idle kept-alive one, which a
    # reused connection would meet as a disconnect.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        for run in range(-1, runs):
            # The same prompt on every server within a run (the same work), a new one each run.
            messages, count = long_prompt(tokenizer, tokens, f"{os.urandom(4).hex()}: request {run + 1}.")
            body = {"messages": messages, "max_tokens": LONG_PROMPT_ANSWER_TOKENS, "temperature": 0}
            for server in servers[run % len(servers):] + servers[: run % len(servers)]:
                record = await stream_chat(session, endpoints[server.name], body, level_start=time.perf_counter(), timeout_s=1800)
                if run < 0:
                    continue
                records[server.name].append(record)
                ttft = f"{record.e2e_s:.3f} s" if record.ok else f"failed ({record.error_message})"
                print(f"long prompt {run + 1}/{runs} {server.name}: {count} tokens (server counted {record.prompt_tokens}), "
                      f"time to first token {ttft}", flush=True)
            if run >= 0:
                counts.append(count)
    result: dict[str, Any] = {"prompt_tokens": tokens, "runs": runs, "tokenizer_counts": sorted(set(counts)), "max_tokens": LONG_PROMPT_ANSWER_TOKENS}
    for name, done in records.items():
        ttfts = [r.e2e_s for r in done if r.ok]
        result[name] = {"ttft_s": ttfts, "median_ttft_s": statistics.median(ttfts) if ttfts else None,
                        "server_prompt_tokens": sorted({r.prompt_tokens for r in done if r.prompt_tokens is not None}),
                        "failed": [r.error_message for r in done if not r.ok]}
    theirs = result.get("llama.cpp", {}).get("median_ttft_s")
    for name in records:
        mine = result[name]["median_ttft_s"]
        result[name]["versus_llama_cpp"] = mine / theirs if mine and theirs and name != "llama.cpp" else None
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--datasets", default="chat,copy", help="shipped sets (chat, copy, ...) or JSONL files (flare bench's format)")
    parser.add_argument("--temperatures", default="0,0.7")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--waves", type=int, default=2, help="requests per level = max(--min-requests, waves x concurrency)")
    parser.add_argument("--min-requests", type=int, default=4)
    parser.add_argument("--level-duration", type=float, help="flare bench --duration of each level: no request starts after it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--package", type=Path, help="flare's package (default: the default model's in --dtype)")
    parser.add_argument("--gguf", type=Path, help="the GGUF llama.cpp (and transformers) serve (default: the default model's); "
                        "give --package as flare's export of the same file")
    parser.add_argument("--dtype", choices=(AUTO_DTYPE, *DTYPES), default=AUTO_DTYPE, help="the default model's package dtype (flare export --dtype)")
    parser.add_argument("--llama-server", type=Path, help="a llama-server binary to use instead of building one")
    parser.add_argument("--llama-cpp-dir", type=Path, help="where llama.cpp is built once (default $FLARE_CACHE_DIR/llama.cpp or ~/.cache/flare/llama.cpp)")
    parser.add_argument("--kv-cache-memory", default="1GiB", help="each flare daemon's KV cache (two run at once)")
    parser.add_argument("--slot-context", type=int, default=1024, help="llama.cpp's context per slot (-c is this x -np)")
    parser.add_argument("--versus-dtype", choices=DTYPES, help="also serve the default model's package in this dtype with --draft-tokens 0 (weight formats side by side)")
    parser.add_argument("--skip-speculation", action="store_true", help="leave out the flare side with speculation")
    parser.add_argument("--versus-drafter", choices=("ngram", "mtp", "auto"),
                        help="also serve flare's package with this --drafter (e.g. ngram beside a package whose head drafts)")
    parser.add_argument("--versus-draft-tokens", type=int, metavar="K",
                        help="also serve flare's package with --draft-tokens K (draft lengths side by side; at most the package's)")
    parser.add_argument("--flare-args", default="", help="more `flare run` flags for every flare daemon, one string (e.g. '--activations int8x2')")
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true",
                        help="leave out the datasets x temperatures x concurrency matrix (to run --long-prompt-tokens alone)")
    parser.add_argument("--long-prompt-tokens", type=int, default=0,
                        help="also time cold prompts of this many tokens to their first token on each server (0: not)")
    parser.add_argument("--long-prompt-runs", type=int, default=5, help="distinct long prompts per server (the figure is their median)")
    parser.add_argument("--one-server-at-a-time", action="store_true",
                        help="start, measure and stop each side in turn (files too large to share the page cache); not with --long-prompt-tokens")
    parser.add_argument(
        "--turns", type=int, default=None,
        help="rounds of every side: with all servers up (default 1), each level's turns alternate the sides within "
        "it, and a ratio of two sides is the median of their turns' ratios (each turn's runs next to each other "
        "in time); with --one-server-at-a-time (default 2), each side started in turn. A side's median turn counts",
    )
    parser.add_argument("--out-dir", type=Path, default=Path("compare-results"))
    args = parser.parse_args()
    if args.one_server_at_a_time and args.long_prompt_tokens:
        parser.error("--long-prompt-tokens takes turns between servers that are up at once: not with --one-server-at-a-time")
    turns = args.turns if args.turns is not None else 2 if args.one_server_at_a_time else 1
    if turns < 1:
        parser.error(f"--turns must be at least 1, not {turns}")
    if args.versus_draft_tokens is not None and args.versus_draft_tokens < 1:
        parser.error(f"--versus-draft-tokens must be at least 1 (K=0 is always served), not {args.versus_draft_tokens}")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    datasets = args.datasets.split(",")
    temperatures = [float(t) for t in args.temperatures.split(",")]
    args.out_dir.mkdir(parents=True, exist_ok=True)

    import torch

    from flare.preparation.default_model import default_gguf_path
    from flare.preparation.default_package import default_package_path
    from flare.package.directory import open_package

    torch.set_num_threads(args.threads)
    if args.gguf is not None and args.package is None:
        parser.error("--gguf needs --package: flare's export of that file, so both serve the same weights")
    gguf = args.gguf or default_gguf_path()
    package = args.package or default_package_path(dtype=args.dtype)
    package_serving = open_package(package).manifest.serving
    if args.versus_draft_tokens is not None and args.versus_draft_tokens > package_serving.draft_tokens:
        parser.error(f"--versus-draft-tokens {args.versus_draft_tokens} is more than the package's {package_serving.draft_tokens} "
                     f"(flare run may only lower it): export one with --mtp-draft-tokens {args.versus_draft_tokens}")
    llama_server = None
    if not args.skip_llama_cpp:
        cache = args.llama_cpp_dir or Path(os.environ.get("FLARE_CACHE_DIR", Path.home() / ".cache" / "flare")) / "llama.cpp"
        llama_server = args.llama_server or llama_server_binary(cache)
    reference = None if args.skip_transformers else TransformersReference(gguf)

    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    slot_context = max(args.slot_context, args.long_prompt_tokens + 64)  # room for the long prompt, if any
    def flare_command(served: Path) -> list[str]:
        return [sys.executable, "-m", "flare.cli.main", "run", str(served), "--log-level", "warning",
                "--max-concurrency", str(max(concurrencies)), "--kv-cache-memory", args.kv_cache_memory, *shlex.split(args.flare_args)]

    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    specs: list[tuple[str, list[str]]] = []  # (name, command without --port)
    sides = [("flare", package, []), ("flare K=0", package, ["--draft-tokens", "0"])][args.skip_speculation :]
    if args.versus_drafter:
        sides.append((f"flare {args.versus_drafter}", package, ["--drafter", args.versus_drafter]))
    if args.versus_draft_tokens is not None:
        sides.append((f"flare K={args.versus_draft_tokens}", package, ["--draft-tokens", str(args.versus_draft_tokens)]))
    if args.versus_dtype:
        sides.append((f"flare {args.versus_dtype} K=0", default_package_path(dtype=args.versus_dtype), ["--draft-tokens", "0"]))
    specs += [(name, [*flare_command(served), *extra]) for name, served, extra in sides]
    if llama_server is not None:
        specs.append(("llama.cpp", [str(llama_server), "-m", str(gguf), "-t", str(args.threads), "--host", "127.0.0.1",
                                    "-np", str(max(concurrencies)), "-c", str(slot_context * max(concurrencies)), "--cont-batching"]))

    def start(stack: contextlib.ExitStack, name: str, command: list[str]) -> Server:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        pid = stack.enter_context(server_process([*command, "--port", str(port)], env, name, url, args.out_dir / f"{slug(name)}.log"))
        print(f"{name} up (pid {pid}) at {url}", flush=True)
        return Server(name, url)

    names = [name for name, _ in specs]
    measured: dict[tuple[str, str, float, int], list[dict[str, Any]]] = {}  # (server, dataset, temperature, streams): turns
    levels = [(d, t, c) for d in ([] if args.skip_throughput else datasets) for t in temperatures for c in concurrencies]
    long_prompt_result = None
    # Each level and turn sends the set's prompts under a nonce of its own, the same to every
    # side: no server has them cached from a level before.
    prompt_files = {
        (level, turn): nonced_dataset(level[0], secrets.token_hex(4), args.out_dir / f"prompts-{dataset_label(level[0])}-t{level[1]:g}-c{level[2]}-turn{turn}.jsonl")
        for level in levels
        for turn in range(turns)
    }
    if args.one_server_at_a_time:
        # Each side alone, started, warmed, measured at every level and stopped, in turn, --turns
        # times: for files that together overflow the page cache, which servers up at once would
        # evict from each other between levels. A level's figure is its median turn's (below).
        for turn in range(turns):
            for name, command in specs:
                with contextlib.ExitStack() as stack:
                    server = start(stack, name, command)
                    for i, (dataset, temperature, concurrency) in enumerate(levels):
                        out = args.out_dir / f"{slug(name)}-{dataset_label(dataset)}-t{temperature:g}-c{concurrency}-turn{turn}.json"
                        prompts = prompt_files[((dataset, temperature, concurrency), turn)]
                        result = bench_level(server, str(prompts), temperature, concurrency, args, out, 2 if i == 0 else 0)
                        measured.setdefault((name, dataset, temperature, concurrency), []).append(result)
                        report_level(name, dataset, temperature, concurrency, result, turn)
    else:
        with contextlib.ExitStack() as stack:
            servers = [start(stack, name, command) for name, command in specs]
            if levels:
                # Warmed apart from the levels (two requests and one more, not counted), on the
                # set's own prompts, which no level sends.
                for server in servers:
                    bench_level(server, *levels[0][:2], 1, args, args.out_dir / f"{slug(server.name)}-warm-up.json", 2, requests=1)
            for dataset, temperature, concurrency in levels:
                # With several turns the sides alternate within the level, the first rotating, so
                # a machine whose speed changes within seconds (docs/benchmarks.md) moves both
                # sides of a turn alike.
                for turn in range(turns):
                    suffix = f"-turn{turn}" if turns > 1 else ""
                    prompts = prompt_files[((dataset, temperature, concurrency), turn)]
                    for server in servers[turn % len(servers):] + servers[: turn % len(servers)]:
                        out = args.out_dir / f"{slug(server.name)}-{dataset_label(dataset)}-t{temperature:g}-c{concurrency}{suffix}.json"
                        result = bench_level(server, str(prompts), temperature, concurrency, args, out, 0)
                        measured.setdefault((server.name, dataset, temperature, concurrency), []).append(result)
                        report_level(server.name, dataset, temperature, concurrency, result, turn if turns > 1 else None)
            if args.long_prompt_tokens:
                tokenizer = Tokenizer.from_package(open_package(package))
                long_prompt_result = asyncio.run(long_prompt_level(servers, tokenizer, args.long_prompt_tokens, args.long_prompt_runs))

    cells: list[dict[str, Any]] = []
    for dataset in [] if args.skip_throughput else datasets:
        for temperature in temperatures:
            per_server: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
            for concurrency in concurrencies:
                cell: dict[str, Any] = {"dataset": dataset, "temperature": temperature, "concurrency": concurrency}
                for name in names:
                    turns = measured[(name, dataset, temperature, concurrency)]
                    # The turn of median rate stands for the level (of an even count, the slower middle one);
                    # every turn's rate is kept beside it.
                    result = sorted(turns, key=lambda r: r["levels"][0]["output_tok_s"])[(len(turns) - 1) // 2]
                    per_server[name].append(result)
                    level = result["levels"][0]
                    cell[name] = {key: level[key] for key in ("output_tok_s", "req_s", "completed", "failed", "failures")}
                    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
                        cell[name][key] = {p: level[key][p] for p in ("mean", "p50", "p90", "p99")}
                    if len(turns) > 1:
                        cell[name]["turns_output_tok_s"] = [t["levels"][0]["output_tok_s"] for t in turns]
                    metrics = level.get("server_metrics") or {}
                    cell[name]["accepted_per_round"] = metrics.get("accepted_per_round")
                    cell[name]["tokens_per_row_round"] = metrics.get("tokens_per_row_round")
                    cell[name]["drafts_by_drafter"] = metrics.get("drafts_by_drafter")
                if reference is not None:
                    prompts = prompts_of(dataset)
                    batch = [prompts[i % len(prompts)] for i in range(concurrency)]
                    seconds, tokens = reference.generate(batch, args.max_tokens, temperature)
                    cell["transformers"] = {"output_tok_s": tokens / seconds}
                    print(f"{dataset} T={temperature:g} c={concurrency} transformers: {tokens / seconds:.1f} tok/s", flush=True)
                cells.append(cell)
            merged = [merge_levels(results) for results in per_server.values()]
            name = f"{dataset_label(dataset)}-t{temperature:g}"
            for result in merged:
                (args.out_dir / f"{slug(result['label'])}-{name}.json").write_text(json.dumps(result, indent=1))
            write_plots(merged, args.out_dir / "plots" / name, title=f"{dataset}, temperature {temperature:g}, {args.max_tokens} tokens")

    summary = {
        "command": " ".join(sys.argv),
        "started": started,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "versions": {**versions(), "torch": torch.__version__, "transformers": _version("transformers"),
                     "llama.cpp": f"vendored in llama-cpp-python {LLAMA_CPP_PYTHON}" if llama_server else None},
        "settings": {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                     "package": str(package), "package_dtype": package_serving.dtype,
                     "package_draft_tokens": package_serving.draft_tokens, "gguf": str(gguf),
                     "llama_server": str(llama_server) if llama_server else None,
                     "llama_cpp_slot_context": slot_context},
        "cells": cells,
        "long_prompt": long_prompt_result,
    }
    (args.out_dir / "comparison.json").write_text(json.dumps(summary, indent=1))
    if cells:
        print_table(cells, names + ([] if reference is None else ["transformers"]), args.versus_dtype, args.versus_drafter,
                    args.versus_draft_tokens)
    if long_prompt_result is not None:
        print_long_prompt(long_prompt_result, names)
    return 0


def print_table(
    cells: list[dict[str, Any]],
    systems: list[str],
    versus_dtype: str | None = None,
    versus_drafter: str | None = None,
    versus_draft_tokens: int | None = None,
) -> None:
    ratios = [("flare", "llama.cpp"), ("flare", "flare K=0"), ("flare K=0", "llama.cpp")]
    if versus_drafter:
        ratios.append(("flare", f"flare {versus_drafter}"))
    if versus_draft_tokens is not None:
        ratios.append(("flare", f"flare K={versus_draft_tokens}"))
    if versus_dtype:
        ratios.append(("flare K=0", f"flare {versus_dtype} K=0"))
    print("\n| dataset | T | streams | " + " | ".join(f"{s} tok/s" for s in systems) + " | "
          + " | ".join(f"{a} / {b}" for a, b in ratios) + " |")
    print("|" + " --- |" * (len(systems) + 3 + len(ratios)))
    for cell in cells:
        figures = [cell.get(s, {}).get("output_tok_s") for s in systems]
        row = " | ".join("-" if f is None else f"{f:.1f}" for f in figures)
        print(f"| {cell['dataset']} | {cell['temperature']:g} | {cell['concurrency']} | {row} | "
              + " | ".join(_ratio(cell, a, b) for a, b in ratios) + " |")
    medians = [r for r in (ratio_of(c, "flare", "llama.cpp") for c in cells) if r is not None]
    if medians:
        print(f"\nmedian flare / llama.cpp over {len(medians)} cells: {statistics.median(medians):.2f}x")


def print_long_prompt(result: dict[str, Any], systems: list[str]) -> None:
    """The cold long-prompt level: each system's median time to first token, and each flare side's against llama.cpp's."""
    flares = [s for s in systems if s != "llama.cpp" and "llama.cpp" in systems]
    print("\n| prompt tokens | runs | " + " | ".join(f"{s} median TTFT s" for s in systems) + " | "
          + " | ".join(f"{s} / llama.cpp" for s in flares) + " |")
    print("|" + " --- |" * (len(systems) + len(flares) + 2))
    row = " | ".join("-" if result[s]["median_ttft_s"] is None else f"{result[s]['median_ttft_s']:.3f}" for s in systems)
    ratios = " | ".join("-" if result[s]["versus_llama_cpp"] is None else f"{result[s]['versus_llama_cpp']:.2f}" for s in flares)
    print(f"| {'/'.join(map(str, result['tokenizer_counts']))} | {result['runs']} | {row} | {ratios} |")
    for system in systems:
        if result[system]["failed"]:
            print(f"{system}: {len(result[system]['failed'])} failed: {result[system]['failed'][0]}")


def ratio_of(cell: dict[str, Any], system: str, other: str) -> float | None:
    """system's tokens/s over other's: the median of their turns' ratios where both ran the
    same turns, else the ratio of their median turns; None where either has none."""
    mine, theirs = cell.get(system, {}), cell.get(other, {})
    mine_turns, their_turns = mine.get("turns_output_tok_s"), theirs.get("turns_output_tok_s")
    if mine_turns and their_turns and len(mine_turns) == len(their_turns) and all(their_turns):
        return statistics.median(m / t for m, t in zip(mine_turns, their_turns))
    mine, theirs = mine.get("output_tok_s"), theirs.get("output_tok_s")
    return mine / theirs if mine and theirs else None


def _ratio(cell: dict[str, Any], system: str, other: str) -> str:
    ratio = ratio_of(cell, system, other)
    return "-" if ratio is None else f"{ratio:.2f}x"


def _version(package: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
