"""How far the default package's weight formats move the default model from float32, teacher-forced.

The default package stores float16; the engine multiplies it as float16 (its own kernel) on AVX2
CPUs and as bfloat16 through oneDNN where bfloat16 is native (`flare/engine/precision.py`).
For each chat prompt, the float32 package generates a greedy answer; every model then reads
prompt + answer in one forward, and at every answer position we compare its next-token
distribution with float32's: KL(float32 || format), whether the top choices agree, and the
negative log-likelihood each gives float32's answer. Each format also generates its own greedy
answer, and we report how many tokens it shares with float32's before they part.

    .venv/bin/python benchmarks/precision.py                       # every format this CPU runs
    .venv/bin/python benchmarks/precision.py --formats float16
    .venv/bin/python benchmarks/precision.py --formats float32 bfloat16 --kv-cache-dtypes float32 bfloat16

`--kv-cache-dtypes` stores the compared models' keys and values in each dtype given (`flare run
--kv-cache-dtype`): every format is compared with every cache dtype. The reference keeps float32
weights and a float32 cache.
"""

from __future__ import annotations

import argparse

import torch

from flare.engine.batch import ForwardBatch, ForwardRow
from flare.engine.kv_cache import BlockAllocator, KVCache
from flare.engine.model import DecoderModel, load_model
from flare.engine.precision import WeightFormat, available_formats
from flare.engine.tokenizer import Tokenizer
from flare.preparation.default_package import default_package_path
from flare.package.directory import open_package

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
    "Explain photosynthesis in two sentences.",
    "Write a Python function that reverses a string.",
    "What are the three laws of motion?",
    "Tell me a short story about a cat.",
    "How do I make a cup of tea?",
]
BLOCK_SIZE = 16


def new_sequence(model: DecoderModel, tokens: int, kv_dtype: torch.dtype) -> tuple[KVCache, list[int]]:
    """A KV cache in `kv_dtype` and a block table for one sequence of up to `tokens` tokens."""
    cache = KVCache.for_budget(model.config, 64 * 1024**2, BLOCK_SIZE, dtype=kv_dtype)
    return cache, BlockAllocator(cache.num_blocks).allocate(-(-tokens // BLOCK_SIZE))


def all_logits(model: DecoderModel, tokens: list[int], kv_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits at every position of `tokens`, read in one prompt row (the KV cache in `kv_dtype`)."""
    cache, table = new_sequence(model, len(tokens), kv_dtype)
    row = ForwardRow(tokens, 0, table, num_logits=len(tokens))
    return model.forward(ForwardBatch.build([row], BLOCK_SIZE), cache)


def greedy(
    model: DecoderModel, prompt: list[int], new_tokens: int, eos: set[int], kv_dtype: torch.dtype = torch.float32
) -> list[int]:
    """Greedy continuation as the daemon decodes it: the prompt in one row, then one token a
    round over the paged KV cache (in `kv_dtype`)."""
    cache, table = new_sequence(model, len(prompt) + new_tokens, kv_dtype)
    row = ForwardRow(prompt, 0, table, num_logits=1)
    out: list[int] = []
    while True:
        out.append(int(model.forward(ForwardBatch.build([row], BLOCK_SIZE), cache)[-1].argmax()))
        if len(out) == new_tokens or out[-1] in eos:
            return out
        row = ForwardRow(out[-1:], len(prompt) + len(out) - 1, table, num_logits=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    sixteen_bit = [f.value for f in available_formats(torch.device("cpu")) if f != WeightFormat.FLOAT32]
    parser.add_argument("--formats", nargs="+", choices=[f.value for f in WeightFormat], default=sixteen_bit)
    parser.add_argument("--kv-cache-dtypes", nargs="+", choices=["float32", "float16", "bfloat16"], default=["float32"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    exact_package = open_package(default_package_path(dtype="float32"))
    package = open_package(default_package_path())
    tokenizer = Tokenizer.from_package(exact_package)
    exact = load_model(exact_package)
    # A compared configuration: a weight format and the dtype of its KV cache.
    loaded = {name: load_model(package, weight_format=name) for name in args.formats}
    models = {
        (f"{name}, KV {kv}" if args.kv_cache_dtypes != ["float32"] else name): (loaded[name], getattr(torch, kv))
        for name in args.formats
        for kv in args.kv_cache_dtypes
    }
    print(f"default package stores {package.manifest.serving.dtype}; compared: {'; '.join(models)}")

    divergences: dict[str, list[torch.Tensor]] = {name: [] for name in models}
    agreements: dict[str, list[torch.Tensor]] = {name: [] for name in models}
    shared: dict[str, list[int]] = {name: [] for name in models}
    nll = dict.fromkeys(["float32", *models], 0.0)
    eos = set(tokenizer.eos_token_ids)
    for text in PROMPTS:
        prompt = tokenizer.encode_chat([{"role": "user", "content": text}])
        answer = greedy(exact, prompt, args.new_tokens, eos)
        # Positions len(prompt) - 1 ... end - 1 predict the answer's tokens.
        span = slice(len(prompt) - 1, len(prompt) + len(answer) - 1)
        targets = torch.tensor(answer).unsqueeze(1)
        log_p = all_logits(exact, prompt + answer)[span].log_softmax(-1)
        nll["float32"] -= log_p.gather(1, targets).sum().item()
        for name, (model, kv_dtype) in models.items():
            log_q = all_logits(model, prompt + answer, kv_dtype)[span].log_softmax(-1)
            divergences[name].append((log_p.exp() * (log_p - log_q)).sum(-1))
            agreements[name].append(log_p.argmax(-1) == log_q.argmax(-1))
            nll[name] -= log_q.gather(1, targets).sum().item()
            own = greedy(model, prompt, args.new_tokens, eos, kv_dtype)
            shared[name].append(next((i for i, (a, b) in enumerate(zip(answer, own)) if a != b), min(len(answer), len(own))))

    positions = sum(d.numel() for d in next(iter(divergences.values()))) if models else 0
    print(f"{len(PROMPTS)} prompts, {positions} answer positions; NLL per token of float32's answers: "
          f"float32 {nll['float32'] / max(positions, 1):.4f}")
    for name in models:
        kl = torch.cat(divergences[name])
        print(
            f"{name}: KL(float32 || {name}) nats mean {kl.mean():.2e}, median {kl.median():.2e}, max {kl.max():.2e}; "
            f"top-1 agreement {torch.cat(agreements[name]).float().mean():.4f}; NLL {nll[name] / positions:.4f}; "
            f"greedy answers shared with float32's for their first {shared[name]} tokens"
        )


if __name__ == "__main__":
    main()
