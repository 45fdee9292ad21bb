"""N-gram prompt lookup: propose the tokens that followed the latest earlier occurrence of
the sequence's own last n tokens (n from `max_n` down to `min_n`).

Needs no weights and pays on repetitive text (editing, quoting, code). Proposals are
deterministic, so the draft distribution q is one-hot. The index maps each n-gram to the
position after its latest occurrence and is updated as tokens arrive, so a proposal costs
O(max_n + k), not a scan of the context.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flare.engine.drafters.base import Draft


@dataclass
class NgramState:
    min_n: int
    max_n: int
    tokens: list[int] = field(default_factory=list)
    # n-gram -> index just past its latest occurrence that is not the sequence's suffix itself.
    _latest: dict[tuple[int, ...], int] = field(default_factory=dict)
    # The suffix n-grams are recorded one step late, so a lookup never finds the suffix itself.
    _pending: list[tuple[tuple[int, ...], int]] = field(default_factory=list)

    def extend(self, token_ids: list[int] | tuple[int, ...]) -> None:
        for token in token_ids:
            for key, end in self._pending:
                self._latest[key] = end
            self.tokens.append(token)
            end = len(self.tokens)
            self._pending = [
                (tuple(self.tokens[end - n : end]), end)
                for n in range(self.min_n, min(self.max_n, end) + 1)
            ]

    def propose(self, k: int) -> Draft:
        if k <= 0:
            return Draft(())
        tokens = self.tokens
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            start = self._latest.get(tuple(tokens[len(tokens) - n :]))
            if start is not None:
                proposal = tokens[start : start + k]
                if proposal:
                    return Draft(tuple(proposal))
        return Draft(())


@dataclass(frozen=True)
class NgramDrafter:
    min_n: int = 1
    max_n: int = 3
    name: str = "ngram"

    def new_state(self, prompt_ids: list[int] | tuple[int, ...]) -> NgramState:
        state = NgramState(self.min_n, self.max_n)
        state.extend(prompt_ids)
        return state
