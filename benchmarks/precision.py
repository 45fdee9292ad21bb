"""How far bfloat16 GEMMs move the default model from float32, teacher-forced.

For each chat prompt, float32 generates a greedy answer; both models then read prompt + answer
in one forward, and at every answer position we compare their next-token distributions:
KL(float32 || bfloat16), whether their top choices agree, and the negative log-likelihood each
gives float32's answer. The bfloat16 side is what a bfloat16 package runs on a CPU with native
bfloat16 (weights packed for oneDNN); elsewhere it runs torch's plain bfloat16 GEMMs.

    .venv/bin/python benchmarks/precision.py
"""

from __future__ import annotations

import argparse

import torch

from flare.engine.batch import ForwardBatch, ForwardRow
from flare.engine.kv_cache import BlockAllocator, KVCache
from flare.engine.model import LlamaModel, load_model
from flare.engine.tokenizer import Tokenizer
from flare.preparation.default_model import default_package_path
from flare.preparation.package import open_package

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


def all_logits(model: LlamaModel, tokens: list[int]) -> torch.Tensor:
    """Logits at every position of `tokens`, read in one prompt row."""
    cache = KVCache.for_budget(model.config, 64 * 1024**2, BLOCK_SIZE)
    table = BlockAllocator(cache.num_blocks).allocate(-(-len(tokens) // BLOCK_SIZE))
    row = ForwardRow(tokens, 0, table, num_logits=len(tokens))
    return model.forward(ForwardBatch.build([row], BLOCK_SIZE), cache)


def greedy(model: LlamaModel, prompt: list[int], new_tokens: int, eos: set[int]) -> list[int]:
    """Greedy continuation, recomputing the whole sequence each step (simple, and exact)."""
    out: list[int] = []
    while len(out) < new_tokens and (not out or out[-1] not in eos):
        out.append(int(all_logits(model, prompt + out)[-1].argmax()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    exact_package = open_package(default_package_path(dtype="float32"))
    rounded_package = open_package(default_package_path(dtype="bfloat16"))
    tokenizer = Tokenizer.from_package(exact_package)
    exact = load_model(exact_package)
    rounded = LlamaModel(
        rounded_package.manifest.model, rounded_package.load_state_dict(), gemm_dtype=torch.bfloat16
    )
    print(f"bfloat16 weights packed for oneDNN: {rounded.packed_weights}")

    divergences, agreements = [], []
    nll = {"float32": 0.0, "bfloat16": 0.0}
    eos = set(tokenizer.eos_token_ids)
    for text in PROMPTS:
        prompt = tokenizer.encode_chat([{"role": "user", "content": text}])
        answer = greedy(exact, prompt, args.new_tokens, eos)
        # Positions len(prompt) - 1 ... end - 1 predict the answer's tokens.
        span = slice(len(prompt) - 1, len(prompt) + len(answer) - 1)
        log_p = all_logits(exact, prompt + answer)[span].log_softmax(-1)
        log_q = all_logits(rounded, prompt + answer)[span].log_softmax(-1)
        divergences.append((log_p.exp() * (log_p - log_q)).sum(-1))
        agreements.append(log_p.argmax(-1) == log_q.argmax(-1))
        targets = torch.tensor(answer).unsqueeze(1)
        nll["float32"] -= log_p.gather(1, targets).sum().item()
        nll["bfloat16"] -= log_q.gather(1, targets).sum().item()

    kl = torch.cat(divergences)
    positions = kl.numel()
    print(f"{len(PROMPTS)} prompts, {positions} answer positions")
    print(f"KL(float32 || bfloat16) nats: mean {kl.mean():.2e}, median {kl.median():.2e}, max {kl.max():.2e}")
    print(f"top-1 agreement: {torch.cat(agreements).float().mean():.4f}")
    print(
        f"NLL per token of float32's answers: float32 {nll['float32'] / positions:.4f}, "
        f"bfloat16 {nll['bfloat16'] / positions:.4f}"
    )


if __name__ == "__main__":
    main()
