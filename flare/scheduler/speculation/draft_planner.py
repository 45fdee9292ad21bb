"""The draft planner: which drafts each decode row verifies this round, how many drafts the head
proposes after a row for its next round, and what a round's acceptance teaches both.

Every per-sequence speculation field (`Sequence.draft_source`, `source_acceptance`, `head_use`,
`head_pause`, `head_draft`, `head_cached`, `draft_state`, `prediction_state`,
`prediction_accepted`, `prediction_rejected`) is written here, on the event-loop
thread, but for `head_cached` going back to 0 with the sequence's blocks (`BlockManager.release`). docs/speculative.md describes the policy; docs/benchmarks.md holds what it was measured
with.
"""

from __future__ import annotations

from collections.abc import Iterable

from flare.engine.drafters import Draft, Drafter, DraftState
from flare.sampler.status import DeviceStatus
from flare.scheduler.speculation.draft_length import HeadCostModel, RoundCostModel, choose_draft_lengths, worthwhile_head_steps
from flare.scheduler.round.plan import PlannedRow, RoundPlan
from flare.scheduler.round.result import RoundResult, RowResult
from flare.scheduler.options import SchedulerOptions
from flare.scheduler.sequence import GRAMMAR_SOURCE, PREDICTION_SOURCE, Sequence

# The most tokens a grammar's forced run is proposed at once (jump-forward drafts).
JUMP_FORWARD_TOKENS = 16

# Faults that need the row to verify at least one draft to reach their device path.
_DRAFT_FAULTS = (DeviceStatus.INVALID_DRAFT_TOKEN, DeviceStatus.INVALID_DRAFT_PROBABILITY)

# Rounds a row's draft head pauses after the draft-length model declined its drafts, per decode
# row of the round, before it drafts one token again to be weighed anew (`DraftPlanner.head_steps`).
HEAD_PAUSE_ROUNDS = 16


class DraftPlanner:
    def __init__(
        self,
        *,
        drafter: Drafter | None,
        head: bool,
        drafter_name: str,
        draft_tokens: int,
        max_context: int,
        options: SchedulerOptions,
    ) -> None:
        """`drafter`: n-gram lookup (alone, or beside the head under `auto`); `head`: a learned
        draft head runs inside the round (ModelRunner.head), its drafts coming back with the
        round's result to be kept on the sequence for its next round."""
        self._drafter = drafter
        self._head = head
        self._drafter_name = drafter_name
        self._draft_tokens = draft_tokens
        self._max_context = max_context
        self._options = options
        self._cost = RoundCostModel()
        self._head_cost = HeadCostModel()

    def new_state(self, prompt_token_ids: Iterable[int]) -> DraftState | None:
        """A new sequence's lookup state (None without n-gram lookup)."""
        return self._drafter.new_state(prompt_token_ids) if self._drafter is not None else None

    def token_seconds(self, base_tokens: int, decode_rows: int) -> float:
        """What a row's token is worth this round, against which a head step is weighed."""
        return self._cost.seconds(base_tokens) / max(1, decode_rows)

    def drafts(self, decode: list[Sequence], base_tokens: int, *, requests_waiting: bool) -> dict[Sequence, Draft]:
        """Each decode row's drafts, cut to the adaptive draft length."""
        constrained = [s for s in decode if s.grammar is not None]
        predicted = any(s.prediction_state is not None for s in decode)
        drafting = self._drafter is not None or self._head or predicted
        if not drafting and not self._options.fault_injection and not constrained:
            return {}
        forced: dict[Sequence, Draft] = {}
        proposals: list[Draft] = []
        for seq in decode:
            limit = self._draft_limit(seq)
            proposal = self._proposal(seq, limit) if limit > 0 else Draft(())
            if seq.grammar is not None:
                proposal, jump = self._grammar_draft(seq, proposal)
                if jump.token_ids:
                    forced[seq] = jump
                    proposal = Draft(())
                    seq.draft_source = GRAMMAR_SOURCE
            proposals.append(proposal)
        available = [len(d.token_ids) for d in proposals]
        lengths = (
            choose_draft_lengths(
                available,
                [s.draft_acceptance for s in decode],
                base_tokens,
                self._cost,
                requests_waiting=requests_waiting,
            )
            if self._options.draft_length == "adaptive"
            else available
        )
        drafts: dict[Sequence, Draft] = dict(forced)
        for seq, draft, k in zip(decode, proposals, lengths):
            if k:
                drafts[seq] = draft.cut(k)
            if seq.head_draft is not None and seq.head_draft.token_ids:
                seq.head_use.observe(proposed=1, accepted=int(bool(k) and seq.draft_source == "mtp"))
            else:  # so that a row whose head stopped drafting is weighed again
                seq.head_use.unobserved()
            if self._head and self._options.draft_length == "adaptive":
                # The head's drafts were there and not worth verifying: it pauses (`head_steps`)
                # for HEAD_PAUSE_ROUNDS rounds a decode row, so that paused rows probe about once
                # in that many rounds whatever the batch, and a pause shortens as the batch does.
                longest = HEAD_PAUSE_ROUNDS * len(decode)
                if not k and draft.token_ids and seq.draft_source == "mtp":
                    seq.head_pause = longest
                elif seq.head_pause:
                    seq.head_pause = min(seq.head_pause - 1, longest)
            fault = seq.fault_due() if self._options.fault_injection else None
            if fault in _DRAFT_FAULTS and seq not in drafts:
                # The draft fault path needs one draft to verify; propose the token 0.
                drafts[seq] = Draft((0,))
        return drafts

    def head_steps(self, seq: Sequence, row_tokens: int, drafts: int, token_seconds: float) -> int:
        """Drafts the head proposes after this row for the row's next round (0 once the sequence
        no longer speculates, or where they would pass the context).

        A step is paid whether or not the next round verifies its draft, so the head drafts at
        most one more than this round's length, only the steps whose expected saving covers
        their cost (`worthwhile_head_steps`), none while the row pauses (`HEAD_PAUSE_ROUNDS`)
        and none under `auto` after lookup drafted the row (docs/speculative.md says why).
        """
        if not self._head or seq.fell_back or self._draft_tokens <= 0 or seq.head_pause:
            return 0
        if (self._drafter_name == "auto" and seq.draft_source == "ngram") or seq.draft_source == PREDICTION_SOURCE:
            return 0
        if self._options.draft_length == "adaptive":
            steps = worthwhile_head_steps(
                min(self._draft_tokens, drafts + 1),
                seq.source_acceptance["mtp"].rate,
                seq.head_use.rate * token_seconds,
                self._head_cost.seconds_per_step(),
            )
        else:
            steps = self._draft_tokens
        # The last slot the head writes: the row's end, plus its new token, plus steps - 1.
        if seq.num_cached + row_tokens + steps > self._max_context:
            return 0
        return steps

    def observe_round(self, plan: RoundPlan, result: RoundResult) -> None:
        """The cost models learn what the round took. The round cost model weighs this round's
        drafts, what verifying T tokens takes; the head's pass drafts for the next round,
        whatever this one verified, so it is left out of it."""
        self._cost.observe(plan.num_tokens, result.seconds - result.head_seconds)
        self._head_cost.observe(sum(row.head_steps for row in plan.rows), result.head_seconds)

    def learn(self, seq: Sequence, drafts: int, accepted: int) -> None:
        """A decode row's drafts were verified (or it had none): the drafter whose drafts they
        were learns from them, the others recover. Call before the row's tokens are committed."""
        if not seq.in_decode:
            return
        if drafts and seq.draft_source == PREDICTION_SOURCE:
            seq.prediction_accepted += accepted
            seq.prediction_rejected += drafts - accepted
        for source, estimate in seq.source_acceptance.items():
            if drafts and source == seq.draft_source:
                estimate.observe(drafts, accepted)
            else:
                estimate.unobserved()

    def keep_head_drafts(self, seq: Sequence, row: PlannedRow, outcome: RowResult) -> None:
        """Keep the head's drafts for the row's next round; call after its tokens are committed."""
        if row.draft_head is not None and outcome.next_draft is not None:
            # The head computed every slot through the new token's (drafters/mtp.py).
            seq.head_cached = seq.num_cached + 1
        seq.head_draft = outcome.next_draft

    def extend(self, seq: Sequence, kept: list[int]) -> None:
        """Tokens appended to `seq`'s output: lookup finds its next drafts in them too."""
        if seq.draft_state is not None and kept:
            seq.draft_state.extend(kept)
        if seq.prediction_state is not None and kept:
            seq.prediction_state.extend(kept)

    def _grammar_draft(self, seq: Sequence, proposal: Draft) -> tuple[Draft, Draft]:
        """A constrained row's drafts: (the drafter's proposal cut at its first token the grammar
        refuses, the tokens the grammar forces from here). Forced tokens have p = 1 under the
        mask, so they are always accepted: proposed whole, past the draft-length model."""
        assert seq.grammar is not None
        if self._options.jump_forward:
            room = self._draft_limit(seq, JUMP_FORWARD_TOKENS)
            forced = seq.grammar.forced_tokens()[:room]
            if forced:
                return Draft(()), Draft(tuple(forced))
        valid = seq.grammar.valid_prefix(proposal.token_ids)
        return proposal.cut(valid), Draft(())

    def _proposal(self, seq: Sequence, limit: int) -> Draft:
        """The row's draft: the request's prediction's wherever it proposes (the client's own
        guess at the answer, free to make), else n-gram lookup's, the head's, or under `auto`
        lookup's wherever it proposes and the head's elsewhere: lookup's drafts cost nothing to
        make, the head's a step each, so a lookup draft accepted less often than the head's
        still pays better (docs/benchmarks.md, the drafters' runs)."""
        if seq.prediction_state is not None:
            predicted = seq.prediction_state.propose(limit)
            if predicted.token_ids:
                seq.draft_source = PREDICTION_SOURCE
                return predicted
        head = seq.head_draft.cut(limit) if self._head and seq.head_draft is not None else Draft(())
        if seq.draft_state is None:
            seq.draft_source = "mtp"
            return head
        ngram = seq.draft_state.propose(limit)
        if not self._head or ngram.token_ids:
            seq.draft_source = "ngram"
            return ngram
        seq.draft_source = "mtp"
        return head

    def _draft_limit(self, seq: Sequence, most: int | None = None) -> int:
        if seq.fell_back:
            return 0
        params = seq.request.params
        # Every emitted token counts: the accepted drafts plus one must fit max_tokens and the context.
        return max(
            0,
            min(
                self._draft_tokens if most is None else most,
                params.max_tokens - seq.num_output_tokens - 1,
                self._max_context - len(seq.tokens) - 1,
            ),
        )
