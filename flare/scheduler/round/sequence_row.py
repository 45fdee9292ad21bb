"""One running sequence's row of a round (plan.py's `PlannedRow`): its uncached tokens, then its
drafts', and the parts the row needs: sampling when it reaches the end of its tokens, prompt
scoring for echo, the draft head's pass after it."""

from __future__ import annotations

from flare.engine.drafters import Draft
from flare.scheduler.round.plan import DraftHeadPass, PlannedRow, Sampling, Scoring
from flare.scheduler.sequence import Sequence


def sequence_row(
    seq: Sequence,
    tail: list[int],
    draft: Draft,
    samples: bool,
    head_steps: int,
    *,
    vocabulary_parallel: bool,
    fault_injection: bool,
) -> PlannedRow:
    """`seq`'s row: `tail` (its uncached tokens) then `draft`'s, and the parts it needs.
    `vocabulary_parallel`: the package's sampler setting; `fault_injection`: whether the row
    carries the fault its request asked for (--fault-injection)."""
    request = seq.request
    sampling = None
    if samples:
        penalized = request.params.penalized
        sampling = Sampling(
            params=request.params,
            seed=seq.seed,
            output_position=seq.num_output_tokens,
            prompt_ids=request.prompt_token_ids if penalized else (),
            output_ids=tuple(seq.output_ids) if penalized else (),
            vocabulary_parallel=vocabulary_parallel and not seq.fell_back,
            fault=seq.fault_due() if fault_injection else None,
            logprobs=request.logprobs,
            raw_logprobs=request.raw_logprobs,
            grammar=seq.grammar,
        )
    targets = prompt_targets(seq, len(tail)) if not seq.in_decode else ()
    return PlannedRow(
        request_id=seq.request_id,
        choice=seq.index,
        token_ids=tuple(tail) + draft.token_ids,
        start_position=seq.num_cached,
        block_table=tuple(seq.block_table),
        sampling=sampling,
        drafts=draft if draft.token_ids else None,
        scoring=Scoring(targets, request.prompt_logprobs or 0) if targets else None,
        draft_head=(
            DraftHeadPass(head_steps, seq.head_cached, tuple(seq.tokens[seq.head_cached : seq.num_cached + len(tail)]))
            if head_steps
            else None
        ),
    )


def prompt_targets(seq: Sequence, fed: int) -> tuple[int, ...]:
    """The prompt tokens a prefill chunk of `fed` tokens from `num_cached` predicts, when the
    request scores its prompt: position i predicts token i + 1, up to the prompt's last."""
    if seq.request.prompt_logprobs is None:
        return ()
    start = seq.num_cached
    end = min(start + fed, seq.num_prompt_tokens - 1)
    return tuple(seq.tokens[start + 1 : end + 1]) if end > start else ()
