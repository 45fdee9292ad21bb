"""How a round's prefill tokens are shared among the prompts still prefilling: the prefill policy
(docs/architecture.md, "Prefill policy").

Decode rows come first and are never left out; what they leave of `max_batched_tokens` is the
round's prefill budget. The oldest prompt still prefilling keeps a share of every round
(`oldest_prefill_share`), so that nothing arriving after it can starve it; the rest goes to the
prompts with the fewest tokens left first, so that a short prompt behind a long one is computed
in the next round rather than after the whole long one. A prompt alone gets the whole budget,
exactly as in arrival order.
"""

from __future__ import annotations

from collections.abc import Sequence

from flare.scheduler import sequence
from flare.scheduler.options import SchedulerOptions


def share_prefill_budget(remaining: Sequence[int], budget: int, oldest_share: int) -> list[int]:
    """Each prefilling prompt's chunk this round, in the order given (arrival order, oldest
    first), from the prompt tokens each has left to compute.

    The oldest gets up to `oldest_share` tokens even when decode rows left no budget (its
    progress does not depend on how many streams decode); then, fewest tokens left first (ties:
    the older), each prompt takes what it still needs from what is left of `budget`.
    """
    chunks = [0] * len(remaining)
    if not remaining:
        return chunks
    chunks[0] = min(remaining[0], max(oldest_share, 0))
    left = max(budget - chunks[0], 0)
    for i in sorted(range(len(remaining)), key=lambda i: (remaining[i] - chunks[i], i)):
        if left <= 0:
            break
        take = min(remaining[i] - chunks[i], left)
        chunks[i] += take
        left -= take
    return chunks


def prefill_chunks(
    prefilling: list[sequence.Sequence], decode_rows: int, options: SchedulerOptions
) -> dict[sequence.Sequence, int]:
    """Each prefilling sequence's chunk this round, in arrival order: decode rows take their
    token first, and the rest of the round is shared by the policy."""
    budget = options.max_batched_tokens
    # A first choice whose other choices wait stops short of the prompt's last token: each
    # choice computes that one itself, to sample its first token from it.
    remaining = [(len(s.tokens) - 1 if s.pending_choices else len(s.tokens)) - s.num_cached for s in prefilling]
    shares = share_prefill_budget(remaining, budget - decode_rows, min(options.oldest_prefill_share, budget))
    return dict(zip(prefilling, shares))
