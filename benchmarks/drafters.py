"""Drafters side by side in one process: each wave of answers through every configuration in turn.

No HTTP: each configuration is a scheduler over the same package, all on one model thread (so
they share one OpenMP team: flare/scheduler/round/model_thread.py), and every wave of `--streams`
answers of the dataset (submitted at once) runs through each of them in turn, the order
alternating, so load on the machine falls on all of them alike. Prints tokens/s (a wave's tokens
over its wall time), the ratio to the first configuration, tokens per verification round, and
how many answers equal the first configuration's (greedy: all of them); then n-gram lookup's
ceiling on the first configuration's answers: the tokens a round would yield if every draft that
lookup proposes (up to K) were verified, K = 4, 8, 16 and unbounded. A configuration's tokens
per round can only approach it, and its speed-up is bounded by it (`lookup_ceiling`).

    .venv/bin/python benchmarks/drafters.py PACKAGE --configs K0,ngram,mtp,auto --answers 20
    .venv/bin/python benchmarks/drafters.py PACKAGE --configs K0,mtp:1,mtp:2 --draft-length fixed --dataset copy
    .venv/bin/python benchmarks/drafters.py PACKAGE --configs K0,auto --streams 8 --answers 32

A configuration is `K0` (no speculation) or a drafter (`ngram`, `mtp`, `auto`) with an optional
`:K` draft length; `--draft-length fixed` (as `flare run`'s) turns adaptive draft length off for
all of them.
"""

from __future__ import annotations

import os

from flare.engine.openmp import set_wait_policy

set_wait_policy(os.environ)

import argparse
import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import structlog
import torch

from flare.bench.datasets import Conversation, load_dataset
from flare.engine.drafters.ngram import NgramDrafter
from flare.engine.precision import cpu_flags
from flare.package.directory import open_package
from flare.policy.params import SamplingParams
from flare.scheduler.round.model_thread import ModelThread
from flare.scheduler.round.plan import RoundPlan
from flare.scheduler.round.result import RoundResult
from flare.scheduler.request import GenerationRequest, TextDelta
from flare.scheduler.scheduler import Scheduler, SchedulerOptions


@dataclass
class Tally:
    seconds: float = 0.0
    tokens: int = 0
    verify_rounds: int = 0
    verified_tokens: int = 0
    answers: list[list[int]] = field(default_factory=list)
    prompts: list[tuple[int, ...]] = field(default_factory=list)


def options_of(name: str, draft_length: Literal["adaptive", "fixed"]) -> SchedulerOptions:
    drafter, _, k = name.partition(":")
    if drafter == "K0":
        return SchedulerOptions(draft_tokens=0)
    return SchedulerOptions(
        drafter=drafter, draft_tokens=int(k) if k else None, draft_length=draft_length
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("package", type=Path)
    parser.add_argument("--configs", default="K0,ngram,mtp,auto")
    parser.add_argument("--dataset", default="chat")
    parser.add_argument("--answers", type=int, default=20)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--draft-length", choices=("adaptive", "fixed"), default="adaptive")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--streams", type=int, default=1, help="answers submitted at once")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    torch.set_num_threads(args.threads)
    package = open_package(args.package)
    names = args.configs.split(",")
    thread = ModelThread()
    loop = asyncio.get_running_loop()
    schedulers = {
        name: await loop.run_in_executor(
            None, lambda name=name: Scheduler.from_package(package, options_of(name, args.draft_length), model_thread=thread)
        )
        for name in names
    }
    tallies = {name: Tally() for name in names}
    for name, scheduler in schedulers.items():
        execute, tally = scheduler._runner.execute, tallies[name]

        def counted(plan: RoundPlan, execute=execute, tally=tally) -> RoundResult:
            result = execute(plan)
            for row, outcome in zip(plan.rows, result.rows):
                if outcome is not None and row.draft_ids:
                    tally.verify_rounds += 1
                    tally.verified_tokens += len(outcome.tokens)
            return result

        scheduler._runner.execute = counted
    runs = [asyncio.create_task(s.run()) for s in schedulers.values()]
    conversations = load_dataset(args.dataset)[: args.answers]
    waves = [range(start, min(start + args.streams, len(conversations))) for start in range(0, len(conversations), args.streams)]
    for w, wave in enumerate(waves):
        for name in names if w % 2 == 0 else names[::-1]:
            scheduler = schedulers[name]
            started = time.perf_counter()
            answered = await asyncio.gather(*(answer(scheduler, f"{name}-{i}", conversations[i], i, args) for i in wave))
            tallies[name].seconds += time.perf_counter() - started
            tallies[name].tokens += sum(len(got) for _, got in answered)
            tallies[name].prompts.extend(ids for ids, _ in answered)
            tallies[name].answers.extend(got for _, got in answered)
    for scheduler in schedulers.values():
        scheduler.stop()
    await asyncio.gather(*runs)
    thread.shutdown(wait=True)
    print(f"cpu flags: {' '.join(cpu_flags())}; load {os.getloadavg()[0]:.2f}; {args.dataset}, T = {args.temperature:g}, "
          f"{len(conversations)} answers of up to {args.max_tokens} tokens, {args.streams} at once")
    print("| config | tok/s | / first | tokens per verification round | verification rounds | answers equal to the first's |")
    print("| --- | --- | --- | --- | --- | --- |")
    first = tallies[names[0]]
    for name in names:
        t = tallies[name]
        rate, base = t.tokens / t.seconds, first.tokens / first.seconds
        same = sum(a == b for a, b in zip(t.answers, first.answers))
        per_round = f"{t.verified_tokens / t.verify_rounds:.2f}" if t.verify_rounds else "-"
        print(f"| {name} | {rate:.1f} | {rate / base:.2f}x | {per_round} | {t.verify_rounds} | {same}/{len(t.answers)} |")
    ceilings = {k: lookup_ceiling(first.prompts, first.answers, k) for k in (4, 8, 16, None)}
    print(f"\nn-gram lookup's ceiling on {names[0]}'s answers, tokens a round with every proposed draft verified "
          "(and the drafts it proposed that the answer did not take, a round): "
          + ", ".join(f"K = {'unbounded' if k is None else k}: {c.tokens_per_round:.2f} ({c.rejected_per_round:.2f})"
                      for k, c in ceilings.items()))


@dataclass(frozen=True)
class LookupCeiling:
    tokens_per_round: float
    rejected_per_round: float  # drafts lookup proposed that the answer did not continue with


def lookup_ceiling(prompts: list[tuple[int, ...]], answers: list[list[int]], k: int | None) -> LookupCeiling:
    """Tokens a round yields over `answers` if every round verified all that n-gram lookup (the
    daemon's drafter) proposes, up to k: the drafts up to the first that differs from the answer,
    plus the round's own token. No draft planner does better: it verifies at most what lookup
    proposes, and a draft after a rejected one is never kept."""
    tokens = rounds = rejected = 0
    for prompt, answer in zip(prompts, answers):
        state = NgramDrafter().new_state(prompt)
        at = 0
        while at < len(answer):
            proposal = state.propose(len(answer) if k is None else k).token_ids
            accepted = 0
            while accepted < len(proposal) and at + accepted < len(answer) and proposal[accepted] == answer[at + accepted]:
                accepted += 1
            rejected += len(proposal) - accepted
            step = min(accepted + 1, len(answer) - at)
            state.extend(answer[at : at + step])
            at += step
            rounds += 1
        tokens += len(answer)
    return LookupCeiling(tokens / rounds, rejected / rounds) if rounds else LookupCeiling(0.0, 0.0)


async def answer(
    scheduler: Scheduler, request_id: str, conversation: Conversation, seed: int, args: argparse.Namespace
) -> tuple[tuple[int, ...], list[int]]:
    """(the prompt's token ids, the answer's)."""
    ids = tuple(scheduler.tokenizer.encode_chat([*conversation.history, {"role": "user", "content": conversation.turns[0]}]))
    params = SamplingParams(
        temperature=args.temperature, top_p=0.9 if args.temperature > 0 else 1.0, max_tokens=args.max_tokens, seed=seed
    )
    got: list[int] = []
    async for event in scheduler.submit(GenerationRequest(request_id, ids, params)):
        if isinstance(event, TextDelta):
            got.extend(event.token_ids)
    return ids, got


if __name__ == "__main__":
    asyncio.run(main())
