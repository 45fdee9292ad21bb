"""What the daemon submits to the scheduler, and the events it reads back."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Literal

from flare.sampler.status import DeviceStatus
from flare.policy.params import SamplingParams
from flare.structured import Grammar


@dataclass(frozen=True)
class FaultSpec:
    """A device status to inject on this request's row (tests only, `--fault-injection`).

    round None means the first round in which the request samples a token.
    """

    status: DeviceStatus
    round: int | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt and its sampling parameters; `n` choices are sampled from it independently
    (the prompt is computed once and its KV blocks shared), choice i with `choice_seed(seed, i)`."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    fault: FaultSpec | None = None
    n: int = 1
    logprobs: int | None = None
    """None: no log-probabilities; k >= 0: each output token's, with its k most likely
    alternatives (kernels/logprobs.py says of which distribution)."""
    raw_logprobs: bool = False
    """Report the raw model distribution (temperature 1, nothing applied) for output tokens."""
    prompt_logprobs: int | None = None
    """None: the prompt is not scored; k >= 0: every prompt token after the first is scored by
    the model (echo with logprobs), with k alternatives. Such a request computes its whole
    prompt: the prefix cache's blocks hold no logits."""
    grammar: Grammar | None = None
    """The compiled constraint every choice's answer follows (structured output), or None."""
    cache_scope: bytes = b""
    """Who may share this request's prefix-cache blocks (engine/prefix_cache.py `scoped_root`):
    empty for everyone, else only requests of the same scope (api/cache_scope.py)."""
    prediction: tuple[int, ...] = ()
    """The token ids of the answer the client predicts (OpenAI's `prediction`): every choice
    drafts from them (engine/drafters/prediction.py); empty: no prediction."""


# A Weyl step of the golden ratio: choices of nearby seeds (s and s + 1) get unrelated streams.
_CHOICE_SEED_STEP = 0x9E3779B97F4A7C15


def choice_seed(seed: int, index: int) -> int:
    """The seed choice `index` samples with: the request's own for choice 0 (so n = 1 and the
    first of n choices agree), `seed + index * 0x9E3779B97F4A7C15` wrapped to a signed 64-bit
    integer for the others."""
    wrapped = (seed + index * _CHOICE_SEED_STEP) % (1 << 64)
    return wrapped - (1 << 64) if wrapped >= 1 << 63 else wrapped


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability and the most likely tokens at its position (most likely first)."""

    token_id: int
    logprob: float  # -inf where the distribution gives the token no mass
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TextDelta:
    """New text of choice `index`, never a broken UTF-8 sequence and never part of a stop string.

    `logprobs` are aligned with `token_ids` when the request asked for them. The first delta of
    a choice whose request scores its prompt carries `prompt_logprobs`: prompt tokens 1.. (the
    first has nothing to be predicted from)."""

    text: str
    token_ids: tuple[int, ...]
    index: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class Usage:
    """Tokens of a request (or of one of its choices: its own completion tokens); the prompt
    counts once however many choices share it. `cached_tokens` of the prompt were served from
    the prefix cache rather than computed. Of the tokens a request's `prediction` drafted,
    `accepted_prediction_tokens` were accepted and `rejected_prediction_tokens` rejected."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Finished:
    """Choice `index` ended; `usage` counts the prompt and this choice's completion tokens."""

    reason: Literal["stop", "length"]
    usage: Usage
    fell_back: bool = False
    index: int = 0
    stop_string: str | None = None  # the request's stop string that ended the choice, if one did


@dataclass(frozen=True)
class RequestFailure:
    """Why one request ended without finishing; the daemon turns it into an OpenAI error body."""

    code: str  # DeviceStatus name, or "cancelled", "shutdown", ...
    message: str
    http_status: int
    type: str = "server_error"
    param: str | None = None
    status: DeviceStatus | None = None
    round: int | None = None
    # False when sending the same request again is pointless (an operator cancelled it); the
    # daemon then says so to clients that retry 5xx answers on their own (x-should-retry).
    retryable: bool = True


@dataclass(frozen=True)
class Failed:
    """The request ended without finishing: every choice not finished yet ends with it."""

    failure: RequestFailure
    usage: Usage


StreamEvent = TextDelta | Finished | Failed


class RequestStream:
    """The daemon's end of one request: `async for event in stream`. The events of its
    `choices` interleave; the stream ends after one Finished per choice, or at a Failed.
    Events are put from the event loop by the scheduler; the queue is unbounded because a
    round adds at most K+1 tokens per choice."""

    def __init__(self, request_id: str, choices: int = 1) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self._ended = False
        self._unfinished = choices

    def put(self, event: StreamEvent) -> None:
        self._queue.put_nowait(event)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamEvent:
        if self._ended:
            raise StopAsyncIteration
        event = await self._queue.get()
        if isinstance(event, Finished):
            self._unfinished -= 1
        if isinstance(event, Failed) or self._unfinished == 0:
            self._ended = True
        return event
