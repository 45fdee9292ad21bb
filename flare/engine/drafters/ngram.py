"""N-gram prompt lookup: propose the tokens that followed an earlier occurrence of the
sequence's own last n tokens (n from `max_n` down to `min_n`).

Needs no weights and pays on repetitive text (editing, quoting, code). Proposals are
deterministic, so the draft distribution q is one-hot. The index maps each n-gram to the
positions just past its occurrences and is updated as tokens arrive, so a proposal costs
O(max_n + k + log occurrences), not a scan of the context.

Which occurrence: the one the sequence is copying from. A copy cursor starts where a proposal
was taken from and moves on with every token that continues it, so after the answer inserts,
drops or changes a few tokens of the text it copies, the lookup takes the first occurrence at
or past the cursor rather than the latest anywhere. The latest is what a short, frequent n-gram
(`self.`, `, the`, a newline and indent) gets wrong: it sits in some other line, and every
draft after it is rejected. Where nothing is at or past the cursor, the latest occurrence (the
nearest before it) is taken, as before any proposal.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

from flare.engine.drafters.base import Draft


@dataclass
class NgramState:
    min_n: int
    max_n: int
    tokens: list[int] = field(default_factory=list)
    # The index of the token that would continue the text the sequence copies: the last
    # proposal's start, moved on by each token that matched; None before the first proposal.
    cursor: int | None = None
    # n-gram -> the indexes just past its occurrences, ascending, the sequence's suffix excepted.
    _ends: dict[tuple[int, ...], list[int]] = field(default_factory=dict)

    def extend(self, token_ids: list[int] | tuple[int, ...]) -> None:
        tokens, old = self.tokens, len(self.tokens)
        tokens.extend(token_ids)
        if self.cursor is not None:
            cursor = self.cursor
            for at, token in enumerate(token_ids, old):
                if cursor < at and tokens[cursor] == token:
                    cursor += 1
            self.cursor = cursor
        # Index the n-grams ending at old .. len - 1, each list in ascending order: the one
        # ending at the new last token waits for the next extend, so a lookup never finds the
        # suffix itself.
        for n in range(self.min_n, self.max_n + 1):
            first = max(old, n)
            grams = zip(*(tokens[first - n + i : len(tokens) - n + i] for i in range(n)))
            for end, gram in enumerate(grams, first):
                self._ends.setdefault(gram, []).append(end)

    def propose(self, k: int) -> Draft:
        if k <= 0:
            return Draft(())
        tokens = self.tokens
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            ends = self._ends.get(tuple(tokens[len(tokens) - n :]))
            if ends:
                start = self._occurrence(ends)
                proposal = tokens[start : start + k]
                if proposal:
                    self.cursor = start
                    return Draft(tuple(proposal))
        return Draft(())

    def _occurrence(self, ends: list[int]) -> int:
        """The first of `ends` at or past the cursor, else the latest."""
        if self.cursor is not None:
            at = bisect_left(ends, self.cursor)
            if at < len(ends):
                return ends[at]
        return ends[-1]


@dataclass(frozen=True)
class NgramDrafter:
    min_n: int = 1
    max_n: int = 3
    name: str = "ngram"

    def new_state(self, prompt_ids: list[int] | tuple[int, ...]) -> NgramState:
        state = NgramState(self.min_n, self.max_n)
        state.extend(prompt_ids)
        return state
