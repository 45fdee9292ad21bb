"""One choice's position in its grammar: masks, drafts and acceptance.

Only accepted tokens are ever consumed, so a rejected draft needs no undo: masks for a verify
row's draft positions are computed by llguidance on a scratch walk (it consumes the drafts and
rolls them back inside the one call), and `accept` consumes what the round emitted. The state is
touched by the model thread while a round computes its masks and by the event loop between
rounds (drafts, acceptance), never both at once: the scheduler awaits each round.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flare.structured.compiler import Grammar


class GrammarState:
    def __init__(self, grammar: Grammar) -> None:
        self.grammar = grammar
        self._matcher = grammar.prototype.deep_copy()

    @property
    def finished(self) -> bool:
        """Nothing but the end of the answer may follow (the grammar is complete). A matcher in
        error is stopped too, but its answer is not complete: that is `error`."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar allows alone from here (a key name, a closing brace): proposed as
        drafts, they are accepted with probability 1 under the mask (jump-forward)."""
        return list(self._matcher.compute_ff_tokens())

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` the grammar allows in order from here."""
        return self._matcher.validate_tokens(list(tokens)) if tokens else 0

    def accept(self, tokens: Sequence[int]) -> bool:
        """Advance by emitted tokens; False when the grammar refuses one (a bug upstream)."""
        return self._matcher.consume_tokens(list(tokens)) if tokens else True

    @property
    def matcher(self) -> object:
        """The llguidance matcher, for the executor's batched mask calls only."""
        return self._matcher


def fill_masks(rows: Sequence[tuple[GrammarState, int, Sequence[int]]], out: torch.Tensor) -> None:
    """Write into `out` [N, ceil(V / 32)] int32 (CPU, contiguous) the masks of each grammar row:
    row (state, first, drafts) fills rows first .. first + len(drafts), the mask after the
    accepted tokens and after each draft. Other rows of `out` are left as they are."""
    if not rows:
        return
    assert out.dtype == torch.int32 and out.is_contiguous() and out.device.type == "cpu"
    executor = rows[0][0].grammar.executor
    # llguidance's draft call wants at least one draft; rows without drafts go the plain way.
    plain = [(state.matcher, first) for state, first, drafts in rows if not drafts]
    drafted = [(state.matcher, first, list(drafts)) for state, first, drafts in rows if drafts]
    if plain:
        executor.unsafe_compute_mask_ptr(plain, out.data_ptr(), out.shape[1] * 4, out.shape[0])
    if drafted:
        executor.unsafe_compute_mask_ptr_with_draft_token(drafted, out.data_ptr(), out.shape[1] * 4, out.shape[0])
