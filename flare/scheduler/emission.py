"""A round's sampled tokens into one choice: the tokens kept (up to EOS, max_tokens, the context
length, a stop string or the grammar's end), their text and log-probabilities on the stream, and
how the choice ends, if it does. Ending it (blocks, the Finished or Failed event) is the
scheduler's."""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass
from typing import Literal

from flare.scheduler.failures import grammar_failure
from flare.scheduler.request import RequestFailure, TextDelta, TokenLogprob, Usage
from flare.scheduler.sequence import Sequence


@dataclass(frozen=True)
class Emission:
    kept: tuple[int, ...]
    end: Literal["stop", "length"] | None = None  # the choice's answer is complete
    stop_string: str | None = None  # the request's stop string that ended it, if one did
    failure: RequestFailure | None = None  # the grammar refused the tokens: none were kept


def emit(
    seq: Sequence, new_tokens: tuple[int, ...], logprobs: tuple[TokenLogprob, ...], *, eos: Set[int], max_context: int
) -> Emission:
    """Append sampled tokens to `seq` and stream their text (and their log-probabilities, when
    asked); the choice ends at EOS, a stop string, max_tokens or the context length."""
    params = seq.request.params
    kept: list[int] = []
    reason: Literal["stop", "length"] | None = None
    for token in new_tokens:
        if token in eos:
            reason = "stop"
            break
        kept.append(token)
        if seq.num_output_tokens + len(kept) >= params.max_tokens or len(seq.tokens) + len(kept) >= max_context:
            reason = "length"
            break
    if seq.grammar is not None:
        # A grammar in error (its mask left no token but the end) ends the row with the
        # error, never a silent "stop" on an answer that does not follow it.
        if not seq.grammar.accept(kept) or seq.grammar.error is not None:
            return Emission((), failure=grammar_failure(seq.grammar.error, seq.grammar.grammar.spec.param))
        if reason is None and seq.grammar.finished:
            reason = "stop"  # the answer is complete: only its end may follow
    seq.tokens.extend(kept)
    text, stop_string = seq.stop_matcher.push(seq.detokenizer.push(kept))
    if stop_string is not None:
        reason = "stop"
    elif reason is not None:
        text += seq.stop_matcher.push(seq.detokenizer.flush())[0] + seq.stop_matcher.flush()
    # The first delta of a scored prompt's choice carries the prompt's entries, even empty.
    scored_first = not seq.emitted and seq.request.prompt_logprobs is not None
    if text or kept or scored_first:
        seq.emitted = True
        prompt = tuple(seq.prompt_logprobs) if scored_first else None
        seq.stream.put(TextDelta(text, tuple(kept), seq.index, tuple(logprobs[: len(kept)]), prompt))
    return Emission(tuple(kept), reason, stop_string)


def choice_usage(seq: Sequence) -> Usage:
    """One choice's usage, as its Finished event reports it."""
    return Usage(
        seq.num_prompt_tokens,
        seq.num_output_tokens,
        seq.cached_prompt_tokens,
        seq.prediction_accepted,
        seq.prediction_rejected,
    )
