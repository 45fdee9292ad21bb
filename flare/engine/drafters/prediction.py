"""A request's predicted output (OpenAI's `prediction`) as a draft source: propose the prediction's
continuation from where the row's output last matched it.

The state follows the output token by token with a cursor into the prediction: while the output
agrees with the prediction the cursor advances, and where it departs, the cursor is found again
where the output's last 1-3 tokens occur in the prediction (the first occurrence past the
furthest the output has followed it, else the first), so an answer that skips, inserts or edits
a stretch of the predicted text picks the prediction up again after it. Proposals are
deterministic: q is one-hot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flare.engine.drafters.base import Draft


@dataclass
class PredictionState:
    prediction: tuple[int, ...]
    min_n: int = 1
    max_n: int = 3
    # Where in the prediction the output's end stands (the next predicted token's index), or None
    # where the output's recent tokens occur nowhere in the prediction.
    cursor: int | None = 0
    # The furthest the output has been in step with the prediction: a realignment prefers an
    # occurrence past it, so a phrase the prediction repeats moves the output forward.
    reached: int = 0
    output: list[int] = field(default_factory=list)
    # n-gram of the prediction -> the indexes just past each of its occurrences, ascending.
    _ends: dict[tuple[int, ...], list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for n in range(self.min_n, self.max_n + 1):
            for end in range(n, len(self.prediction) + 1):
                self._ends.setdefault(self.prediction[end - n : end], []).append(end)

    def extend(self, token_ids: list[int] | tuple[int, ...]) -> None:
        for token in token_ids:
            self.output.append(token)
            cursor = self.cursor
            if cursor is not None and cursor < len(self.prediction) and self.prediction[cursor] == token:
                self.cursor = cursor + 1
            else:
                self.cursor = self._realign(self.reached)
            if self.cursor is not None:
                self.reached = max(self.reached, self.cursor)

    def propose(self, k: int) -> Draft:
        if k <= 0 or self.cursor is None:
            return Draft(())
        return Draft(self.prediction[self.cursor : self.cursor + k])

    def _realign(self, after: int) -> int | None:
        """Just past the longest of the output's last n-grams found in the prediction."""
        for n in range(min(self.max_n, len(self.output)), self.min_n - 1, -1):
            ends = self._ends.get(tuple(self.output[-n:]))
            if ends:
                return next((end for end in ends if end > after), ends[0])
        return None
