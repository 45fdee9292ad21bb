"""Greedy answers through a scheduler, one prompt after another, and what the drafts were worth:
how the tests of a package's draft head check that it keeps greedy output while its drafts are
accepted."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from flare.package.directory import Package
from flare.policy.params import SamplingParams
from flare.scheduler.request import GenerationRequest, TextDelta
from flare.scheduler.scheduler import Scheduler, SchedulerOptions


@dataclass
class GreedyAnswers:
    drafter: str  # the drafter the scheduler chose (`auto` resolved)
    outputs: list[list[int]] = field(default_factory=list)  # each prompt's answer, in order
    # Target rounds of the rows that had drafts to verify, and the tokens those rows emitted:
    # each such round emits the row's own token and the drafts accepted before it.
    drafting_rounds: int = 0
    drafting_emitted: int = 0

    @property
    def accepted(self) -> int:
        """Draft tokens accepted."""
        return self.drafting_emitted - self.drafting_rounds


async def greedy_answers(
    package: Package, prompts: Sequence[str], options: SchedulerOptions, *, max_tokens: int
) -> GreedyAnswers:
    """Each prompt's greedy answer (of at most `max_tokens`), counting the drafting rows' rounds
    as the runner executes them."""
    scheduler = Scheduler.from_package(package, options)
    answers = GreedyAnswers(scheduler.drafter_name)
    execute = scheduler.runner.execute

    def counting(plan):
        result = execute(plan)
        for row, outcome in zip(plan.rows, result.rows):
            if outcome is not None and row.draft_ids:
                answers.drafting_emitted += len(outcome.tokens)
                answers.drafting_rounds += 1
        return result

    scheduler.runner.execute = counting
    loop = asyncio.create_task(scheduler.run())
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    try:
        for i, text in enumerate(prompts):
            ids: list[int] = []
            async for event in scheduler.submit(GenerationRequest(f"r{i}", tuple(scheduler.tokenizer.encode(text)), params)):
                if isinstance(event, TextDelta):
                    ids.extend(event.token_ids)
            answers.outputs.append(ids)
    finally:
        scheduler.stop()
        await loop
    return answers
