"""How far 8-bit activations move the default package from its float32 package (issue 38's bars).

On the default package (SmolLM2-135M, Q4_1 + Q8_0 blocks) served with `--activations int8`
against its float32 package (`flare export --dtype float32`, the same values dequantized):

- mean and max |delta logprob| of an echoed text of 60 tokens (every position's logprob of the
  next token of the text; bars 1e-3 and 2e-2);
- the mean and max KL divergence KL(float32 || int8) of the next-token distributions along it;
- greedy answers (48 tokens) equal on how many of 6 chat prompts (bar: 5);
- beside them, the top-N KL: both distributions coarsened onto the served side's N most likely
  tokens plus one bin for the rest (--top-n, 100), a lower bound on the full KL, because that is
  all llama.cpp's server returns.

With --llama-server, llama.cpp's server on the same GGUF gets the same figures against the same
float32 reference (issue 38: llama.cpp's logprobs for the same text beside flare's): its server
echoes no prompt logprobs, so each position is one /completion of the text up to it (see
`llama_cpp_fidelity`); the full KL is not known there, the top-N KL is.

    .venv/bin/python benchmarks/activation_fidelity.py --activations int8 float32
    .venv/bin/python benchmarks/activation_fidelity.py --package P --activations int8x2 int8
    .venv/bin/python benchmarks/activation_fidelity.py --activations auto int8 float32 \
        --llama-server .../llama.cpp/build/bin/llama-server    # llama.cpp on the default GGUF beside them

(any other blocks package with --package; the reference is its float32 export with --reference,
else the package itself at float32 activations, which differs from that export by the summation
order alone).

`float32` is the exact path: it measures the summation order alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flare.engine.batch import ForwardBatch, ForwardRow
from flare.engine.kv_cache import BlockAllocator, KVCache
from flare.engine.model import DecoderModel, load_model
from flare.engine.quantized import served_activations
from flare.engine.tokenizer import Tokenizer
from flare.package.directory import open_package
from flare.preparation.default_model import default_gguf_path
from flare.preparation.default_package import default_package_path

# benchmarks/compare.py's helpers: a server subprocess, healthy on entry, on a free port.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import free_port, server_process  # noqa: E402

BLOCK_SIZE = 16
ECHOED_TEXT = (
    "The river rose slowly through the night, and by morning the lower fields were under water. "
    "Farmers moved their animals to the hills, while children watched the boats drift past the "
    "church, carrying chairs, baskets and a very surprised cat. By noon the rain had stopped, the "
    "sun came out over the flooded valley, and the mayor promised that the old bridge would be "
    "rebuilt before the first snow of winter."
)
PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three prime numbers and explain why they are prime."}],
    [{"role": "user", "content": "How do I boil an egg?"}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish and German."}],
    [{"role": "user", "content": "Give me two tips for writing clear emails."}],
]
ANSWER_TOKENS = 48


def echoed_logprobs(model: DecoderModel, tokens: list[int]) -> torch.Tensor:
    """log_softmax of every position's logits [len - 1, vocab] (the next token's distribution), in
    float64: the KL of two distributions this close (1e-8) is a sum over the vocabulary of terms
    that cancel, and float32's rounding of the normalizers and the sum gave small negative KLs."""
    rows = [ForwardRow(tokens, 0, list(range(-(-len(tokens) // BLOCK_SIZE))), num_logits=len(tokens))]
    cache = KVCache.for_budget(model.config, 64 * 1024**2, BLOCK_SIZE)
    return model.forward(ForwardBatch.build(rows, BLOCK_SIZE), cache)[:-1].double().log_softmax(-1)


def greedy(model: DecoderModel, prompts: list[list[int]], eos: set[int]) -> list[list[int]]:
    cache = KVCache.for_budget(model.config, 64 * 1024**2, BLOCK_SIZE)
    allocator = BlockAllocator(cache.num_blocks)
    tables = [allocator.allocate(-(-(len(p) + ANSWER_TOKENS) // BLOCK_SIZE)) for p in prompts]
    logits = model.forward(ForwardBatch.build([ForwardRow(p, 0, t, num_logits=1) for p, t in zip(prompts, tables)], BLOCK_SIZE), cache)
    outputs = [[int(t)] for t in logits.argmax(-1)]
    for _ in range(ANSWER_TOKENS - 1):
        running = [i for i, out in enumerate(outputs) if out[-1] not in eos]
        if not running:
            break
        rows = [ForwardRow([outputs[i][-1]], len(prompts[i]) + len(outputs[i]) - 1, tables[i], num_logits=1) for i in running]
        for i, token in zip(running, model.forward(ForwardBatch.build(rows, BLOCK_SIZE), cache).argmax(-1)):
            outputs[i].append(int(token))
    return outputs


@dataclass(frozen=True)
class Reference:
    """The exact side: the echoed text's tokens, every position's next-token logprobs, greedy answers."""

    tokens: list[int]
    logprobs: torch.Tensor  # [len(tokens) - 1, vocab]
    prompts: list[list[int]]
    answers: list[list[int]]
    eos: set[int]


def reference(exact: DecoderModel, tokenizer: Tokenizer) -> Reference:
    tokens = tokenizer.encode(ECHOED_TEXT)[:61]
    eos = set(tokenizer.eos_token_ids)
    prompts = [tokenizer.encode_chat(m) for m in PROMPTS]
    return Reference(tokens, echoed_logprobs(exact, tokens), prompts, greedy(exact, prompts, eos), eos)


def top_n_kl(exact: torch.Tensor, ids: torch.Tensor, served: torch.Tensor) -> torch.Tensor:
    """KL(exact || served) per position, both distributions coarsened the same way: onto the
    served side's top-N tokens `ids` [positions, N] plus one bin holding all other tokens' mass.
    `exact` is full log-probabilities [positions, vocab]; `served` the log-probabilities of `ids`
    [positions, N] (all a server returns). Merging bins never raises a KL (data-processing
    inequality), so this is a lower bound on the full KL, the gap being what the tail hides."""
    p = exact.gather(1, ids).exp()
    q = served.exp()
    p = torch.cat([p, (1 - p.sum(1, keepdim=True)).clamp_min(1e-12)], 1)
    q = torch.cat([q, (1 - q.sum(1, keepdim=True)).clamp_min(1e-12)], 1)
    return (p * (p.log() - q.log())).sum(1)


def figures(exact: Reference, text: torch.Tensor, kl: torch.Tensor | None, top_kl: torch.Tensor,
            answers: list[list[int]]) -> dict[str, float | int | None]:
    """The issue's figures: |delta logprob| of the text's own tokens `text` [positions], the full
    KL (None where only the top N are known), the top-N KL, and greedy answers equal."""
    nxt = torch.tensor(exact.tokens[1:]).unsqueeze(1)
    delta = (exact.logprobs.gather(1, nxt).squeeze(1) - text).abs()
    equal = sum(a == b for a, b in zip(answers, exact.answers))  # both keep a closing EOS
    return {"mean_delta": delta.mean().item(), "max_delta": delta.max().item(),
            "mean_kl": None if kl is None else kl.mean().item(), "max_kl": None if kl is None else kl.max().item(),
            "mean_top_n_kl": top_kl.mean().item(), "max_top_n_kl": top_kl.max().item(),
            "greedy_equal": equal, "tokens": len(exact.tokens) - 1}


def fidelity(served: DecoderModel, exact: Reference, top_n: int) -> dict[str, float | int | None]:
    """The issue's figures of a flare model `served` against `exact`."""
    q = echoed_logprobs(served, exact.tokens)
    kl = (exact.logprobs.exp() * (exact.logprobs - q)).sum(-1)
    top = q.topk(top_n, dim=1)
    text = q.gather(1, torch.tensor(exact.tokens[1:]).unsqueeze(1)).squeeze(1)
    return figures(exact, text, kl, top_n_kl(exact.logprobs, top.indices, top.values), greedy(served, exact.prompts, exact.eos))


def completion(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(f"{url}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def llama_cpp_fidelity(url: str, exact: Reference, top_n: int) -> dict[str, float | int | None]:
    """The same figures of llama.cpp's server at `url` against `exact`.

    Its server echoes no prompt logprobs, so the text is teacher-forced: one /completion per
    position with the text up to it as token ids (no BOS added to ids, no chat template, prompt
    cache off so each is computed whole as a prompt), `n_probs` N for the top N of the softmax of
    the raw logits (pre-sampling probabilities), and a logit bias that makes the one sampled token
    the text's own next token, whose raw-softmax logprob the server reports beside them."""
    text, ids, served = [], [], []
    for position in range(1, len(exact.tokens)):
        target = exact.tokens[position]
        body = {"prompt": exact.tokens[:position], "n_predict": 1, "n_probs": top_n, "temperature": 0,
                "cache_prompt": False, "logit_bias": [[target, 1000.0]]}
        probs = completion(url, body)["completion_probabilities"][0]
        if probs["id"] != target:
            raise RuntimeError(f"llama.cpp sampled {probs['id']}, not the forced token {target}")
        text.append(probs["logprob"])
        ids.append([t["id"] for t in probs["top_logprobs"]])
        served.append([t["logprob"] for t in probs["top_logprobs"]])
    top_kl = top_n_kl(exact.logprobs, torch.tensor(ids), torch.tensor(served, dtype=torch.float64))
    answers = [completion(url, {"prompt": p, "n_predict": ANSWER_TOKENS, "temperature": 0, "cache_prompt": False,
                                "return_tokens": True})["tokens"] for p in exact.prompts]
    return figures(exact, torch.tensor(text, dtype=torch.float64), None, top_kl, answers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--activations", nargs="+", default=["int8", "float32"])
    parser.add_argument("--package", type=Path, help="the blocks package served (default: the default model's)")
    parser.add_argument(
        "--reference", type=Path,
        help="its float32 export (`flare export --dtype float32`); with --package alone, the package itself at float32 "
        "activations (the same values, summed in another order: no float32 copy of a large model in memory)",
    )
    parser.add_argument("--llama-server", type=Path, help="also measure llama.cpp's server (this binary) on --gguf")
    parser.add_argument("--gguf", type=Path, help="the GGUF llama.cpp serves (default: the default model's; give it with --package)")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's -t")
    parser.add_argument("--top-n", type=int, default=100, help="the N of the top-N KL (llama.cpp's n_probs)")
    args = parser.parse_args()
    if args.llama_server is not None and args.package is not None and args.gguf is None:
        parser.error("--llama-server with --package needs --gguf: the file that package was exported from")
    blocks = open_package(args.package or default_package_path())
    if args.reference is None and args.package is not None:
        exact, tokenizer = load_model(blocks, activations="float32"), Tokenizer.from_package(blocks)
    else:
        exact_package = open_package(args.reference or default_package_path(dtype="float32"))
        exact, tokenizer = load_model(exact_package), Tokenizer.from_package(exact_package)
    truth = reference(exact, tokenizer)
    del exact
    rows: dict[str, dict[str, float | int | None]] = {}
    for activations in args.activations:
        served = served_activations(blocks.weight_types(), activations)  # auto as `flare run` resolves it here
        side = f"flare {activations}" + (f" ({served})" if served != activations else "")
        rows[side] = fidelity(load_model(blocks, activations=served), truth, args.top_n)
        print(f"{side}: {rows[side]}", flush=True)
    if args.llama_server is not None:
        gguf = args.gguf or default_gguf_path()
        url = f"http://127.0.0.1:{free_port()}"
        command = [str(args.llama_server), "-m", str(gguf), "-t", str(args.threads), "--host", "127.0.0.1",
                   "--port", url.rsplit(":", 1)[1], "-np", "1", "-c", "4096"]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        with tempfile.TemporaryDirectory() as logs, server_process(command, env, "llama.cpp", url, Path(logs) / "llama.cpp.log"):
            rows["llama.cpp"] = llama_cpp_fidelity(url, truth, args.top_n)
        print(f"llama.cpp: {rows['llama.cpp']}", flush=True)
    print(f"\n| side | mean abs delta logprob | max abs delta logprob | mean KL | max KL | mean top-{args.top_n} KL "
          f"| max top-{args.top_n} KL | greedy equal |")
    print("|" + " --- |" * 8)
    for side, row in rows.items():
        cells = ["-" if row[k] is None else f"{row[k]:.3g}" for k in
                 ("mean_delta", "max_delta", "mean_kl", "max_kl", "mean_top_n_kl", "max_top_n_kl")]
        print(f"| {side} | " + " | ".join(cells) + f" | {row['greedy_equal']}/{len(PROMPTS)} |")


if __name__ == "__main__":
    main()
