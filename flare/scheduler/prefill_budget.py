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
