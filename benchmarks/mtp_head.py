"""What a learned draft head costs a round, and what its restricted vocabulary costs acceptance.

Rounds of R decode rows at a given context through `ModelRunner.execute` (forward, sampling,
the head's catch-up and K draft steps, the host read), with the package's head and without it,
alternating, medians:

    .venv/bin/python benchmarks/mtp_head.py PACKAGE --batch 1 8 32 --context 150 --rounds 20

With --acceptance, also the held-out greedy acceptance of the head (as `flare export` measures
it) with its restricted LM head and with the target's whole one, and how many of the target's
held-out greedy tokens the draft vocabulary covers (this regenerates the held-out answers).
"""

from __future__ import annotations

import os

from flare.engine.openmp import set_wait_policy

set_wait_policy(os.environ)

import argparse
import logging
import statistics
import time
from pathlib import Path

import structlog
import torch

from flare.engine.drafters.mtp import load_draft_head
from flare.engine.kv_cache import KVCache
from flare.engine.model import load_model
from flare.engine.precision import cpu_flags
from flare.package.directory import open_package
from flare.policy.params import SamplingParams
from flare.scheduler.round.model_runner import ModelRunner
from flare.scheduler.round.plan import DraftHeadPass, PlannedRow, RoundPlan, Sampling


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("package", type=Path)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--acceptance", action="store_true")
    args = parser.parse_args()
    # The scheduler's per-round events (of the --acceptance generation) are not the output.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    torch.set_num_threads(args.threads)
    package = open_package(args.package)
    config = package.manifest.model
    k = package.manifest.serving.draft_tokens
    model = load_model(package)
    block_size = 16
    blocks_per_row = -(-(args.context + k + 2) // block_size)
    num_blocks = max(args.batch) * blocks_per_row
    kv = KVCache(num_layers=config.num_layers, num_blocks=num_blocks, block_size=block_size,
                 num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)
    head = load_draft_head(package, model, num_blocks=num_blocks, block_size=block_size)
    runners = {
        "without head": ModelRunner(model, kv, vocab_size=config.vocab_size, vocabulary_shards=1,
                                    fallback_on_invalid_speculation=True, device=torch.device("cpu")),
        "with head": ModelRunner(model, kv, vocab_size=config.vocab_size, vocabulary_shards=1,
                                 fallback_on_invalid_speculation=True, device=torch.device("cpu"), head=head),
    }
    params = SamplingParams(temperature=args.temperature, max_tokens=1000, seed=1)
    print(f"cpu flags: {' '.join(cpu_flags())}; weight format {model.weight_format}; K={k}; "
          f"draft vocabulary {head.vocab_size}; load {os.getloadavg()[0]:.2f}")
    print("| rows | round without head (ms) | round with head (ms) | head share |")
    print("| --- | --- | --- | --- |")
    generator = torch.Generator().manual_seed(0)
    for rows in args.batch:
        tables = [tuple(range(r * blocks_per_row, (r + 1) * blocks_per_row)) for r in range(rows)]
        # Fill the context once (prefill rows that sample, the head catching up on them), for both pools.
        contexts = [torch.randint(0, config.vocab_size, (args.context,), generator=generator).tolist() for _ in range(rows)]
        prefill = RoundPlan(0, tuple(
            _row(f"r{r}", contexts[r], 0, tables[r], params, head_steps=1, head_tokens=tuple(contexts[r]))
            for r in range(rows)
        ))
        runners["with head"].execute(prefill)
        # Steady state of a drafting row: the head has every slot through the new token's.
        decode = RoundPlan(1, tuple(
            _row(f"r{r}", [7], args.context, tables[r], params, head_steps=k, head_from=args.context + 1)
            for r in range(rows)
        ))
        times: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(3):
            for runner in runners.values():
                runner.execute(decode)
        for _ in range(args.rounds):
            for name, runner in runners.items():
                started = time.perf_counter()
                runner.execute(decode)
                times[name].append(time.perf_counter() - started)
        without, with_head = (statistics.median(times[n]) * 1000 for n in ("without head", "with head"))
        print(f"| {rows} | {without:.1f} | {with_head:.1f} | {(with_head - without) / with_head:.0%} |")
    if args.acceptance:
        _acceptance(package, k)


def _row(request_id, tokens, start, table, params, *, head_steps=0, head_from=0, head_tokens=()) -> PlannedRow:
    return PlannedRow(
        request_id=request_id, choice=0, token_ids=tuple(tokens), start_position=start, block_table=table,
        sampling=Sampling(params, seed=1, output_position=0, prompt_ids=(), output_ids=(), vocabulary_parallel=False),
        draft_head=DraftHeadPass(head_steps, head_from, head_tokens) if head_steps else None,
    )


def _acceptance(package, k: int) -> None:
    from flare.distill import distill
    from flare.distill.head_model import DraftHeadModule
    from flare.distill.prompts import distill_prompts
    from flare.engine.tokenizer import Tokenizer
    from flare.scheduler.scheduler import Scheduler, SchedulerOptions

    held = [p for p in distill_prompts() if p.held_out]
    recorder = distill.FeatureRecorder()
    scheduler = Scheduler.from_package(package, SchedulerOptions(draft_tokens=0, prefix_cache=False), round_observer=recorder)
    options = distill.DistillOptions()
    progress = distill.Progress(None)
    conversations = distill._generate(
        scheduler, Tokenizer.from_package(package), held, options, progress, time.monotonic() + 3600, recorder
    )
    conversations = [c for c in conversations if c.temperature == 0]
    state = package.load_state_dict()
    head_state = package.load_draft_head()
    vocab = head_state["mtp.draft_vocab"]
    embed = state["model.embed_tokens.weight"].float()
    restricted = DraftHeadModule(package.manifest.model, vocab, embed, embed[vocab].contiguous(), state["model.norm.weight"].float(), seed=0)
    restricted.load_package_state(head_state)
    full = DraftHeadModule(package.manifest.model, torch.arange(embed.shape[0]), embed, embed, state["model.norm.weight"].float(), seed=0)
    full.load_package_state({**head_state, "mtp.draft_vocab": torch.arange(embed.shape[0])})
    inside = torch.isin(torch.cat([c.top_ids[c.labelled, 0] for c in conversations]), vocab).float().mean()
    for name, head in (("restricted", restricted), ("full vocabulary", full)):
        result = distill.measure_acceptance(head, conversations, k)
        print(f"{name}: {result.tokens_per_round:.2f} tokens/round at K={k}, chain per step "
              f"{', '.join(f'{r:.3f}' for r in result.per_step)} ({result.positions} positions)")
    print(f"draft vocabulary covers {inside:.1%} of the target's held-out greedy tokens")


if __name__ == "__main__":
    main()
