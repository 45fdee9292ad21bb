"""The drafter interface.

A drafter proposes up to k tokens that continue a sequence. Deterministic drafters (n-gram
lookup) return no probabilities: their draft distribution q is one-hot on each proposed
token, which rejection sampling handles exactly (accept x with probability p(x), and on
rejection sample from normalize(max(p - q, 0)), i.e. p with x removed). A learned draft head
(`mtp.py`) runs inside the model runner's round rather than through this per-sequence interface:
its drafts arrive with the round's result as `Draft`s with q over its draft vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class Draft:
    token_ids: tuple[int, ...]
    probs: torch.Tensor | None = None  # [len(token_ids), vocab]; None means one-hot q
    # The token ids probs' columns stand for (a draft head's restricted vocabulary; q is zero
    # at every other id); None: probs covers the whole vocabulary.
    vocab: torch.Tensor | None = None

    def cut(self, k: int) -> Draft:
        """The first k tokens, with their q."""
        return Draft(self.token_ids[:k], None if self.probs is None else self.probs[:k], self.vocab)


class DraftState(Protocol):
    """Per-sequence drafter state, fed every token of the sequence in order."""

    def extend(self, token_ids: list[int] | tuple[int, ...]) -> None: ...

    def propose(self, k: int) -> Draft: ...


class Drafter(Protocol):
    name: str

    def new_state(self, prompt_ids: list[int] | tuple[int, ...]) -> DraftState: ...
