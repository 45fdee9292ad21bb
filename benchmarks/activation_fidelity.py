"""How far 8-bit activations move the default package from its float32 package (issue 38's bars).

On the default package (SmolLM2-135M, Q4_1 + Q8_0 blocks) served with `--activations int8`
against its float32 package (`flare export --dtype float32`, the same values dequantized):

- mean and max |delta logprob| of an echoed text of 60 tokens (every position's logprob of the
  next token of the text; bars 1e-3 and 2e-2);
- the mean and max KL divergence KL(float32 || int8) of the next-token distributions along it;
- greedy answers (48 tokens) equal on how many of 6 chat prompts (bar: 5).

    .venv/bin/python benchmarks/activation_fidelity.py --activations int8 float32

`float32` is the exact path: it measures the summation order alone.
"""

from __future__ import annotations

import argparse

import torch

from flare.engine.batch import ForwardBatch, ForwardRow
from flare.engine.kv_cache import BlockAllocator, KVCache
from flare.engine.model import DecoderModel, load_model
from flare.engine.tokenizer import Tokenizer
from flare.package.directory import open_package
from flare.preparation.default_package import default_package_path

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
    """log_softmax of every position's logits [len - 1, vocab] (the next token's distribution)."""
    rows = [ForwardRow(tokens, 0, list(range(-(-len(tokens) // BLOCK_SIZE))), num_logits=len(tokens))]
    cache = KVCache.for_budget(model.config, 64 * 1024**2, BLOCK_SIZE)
    return model.forward(ForwardBatch.build(rows, BLOCK_SIZE), cache)[:-1].log_softmax(-1)


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


def fidelity(served: DecoderModel, exact: DecoderModel, tokenizer: Tokenizer) -> dict[str, float]:
    """The issue's figures of `served` against `exact`."""
    tokens = tokenizer.encode(ECHOED_TEXT)[:61]
    p, q = echoed_logprobs(exact, tokens), echoed_logprobs(served, tokens)
    nxt = torch.tensor(tokens[1:]).unsqueeze(1)
    delta = (p.gather(1, nxt) - q.gather(1, nxt)).abs()
    kl = (p.exp() * (p - q)).sum(-1)
    eos = set(tokenizer.eos_token_ids)
    prompts = [tokenizer.encode_chat(m) for m in PROMPTS]
    equal = sum(a == b for a, b in zip(greedy(served, prompts, eos), greedy(exact, prompts, eos)))
    return {"mean_delta": delta.mean().item(), "max_delta": delta.max().item(), "mean_kl": kl.mean().item(),
            "max_kl": kl.max().item(), "greedy_equal": equal, "tokens": len(tokens) - 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--activations", nargs="+", default=["int8", "float32"])
    args = parser.parse_args()
    exact_package = open_package(default_package_path(dtype="float32"))
    exact, tokenizer = load_model(exact_package), Tokenizer.from_package(exact_package)
    blocks = open_package(default_package_path())
    for activations in args.activations:
        figures = fidelity(load_model(blocks, activations=activations), exact, tokenizer)
        print(f"activations {activations}: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
