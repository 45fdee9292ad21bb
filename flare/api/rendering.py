"""What a renderer is given and what it does: one API's answer, streamed or in one body.

`answer.py` reads a request's events and hands each renderer the same pieces (text with its
log-probability entries, tool-call deltas, each choice's end, the usage or the failure); the
renderer writes its API's frames (chat/render.py, responses/render.py, messages/render.py).
A token of probability 0 (masked or filtered out) reports -9999.0, as JSON has no -infinity.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web

from flare.api.tools.reader import ToolCall
from flare.policy.params import SamplingParams
from flare.policy.policy import ClampResult
from flare.scheduler.request import RequestFailure, TokenLogprob, Usage

ZERO_PROBABILITY_LOGPROB = -9999.0


def new_id(prefix: str) -> str:
    """An id in the form the APIs use: a prefix naming what it is, then random hex."""
    return f"{prefix}{uuid.uuid4().hex}"


@dataclass(frozen=True)
class IdForm:
    """How one API spells the ids it makes, as its documentation does: the answer's (OpenAI's
    `chatcmpl-`, `cmpl-`, `resp_`; Anthropic's `msg_`) and its tool calls' (`call_`, `toolu_`).
    Each renderer module states its API's form; a template that demands its own call ids
    (Mistral's nine characters) keeps them (package/tool_formats.py)."""

    answer: str
    call: str = "call_"

    def answer_id(self) -> str:
        return new_id(self.answer)


def flare_object(clamp: ClampResult) -> dict[str, Any]:
    """What was applied: the effective sampling parameters and every requested value changed."""
    sampling = dataclasses.asdict(clamp.params)
    sampling["stop"] = list(clamp.params.stop)
    sampling["logit_bias"] = {str(token): bias for token, bias in clamp.params.logit_bias}
    return {"sampling": sampling, "adjusted": [adjustment.to_json() for adjustment in clamp.adjusted]}


def logprobs_object(params: SamplingParams, *, raw: bool) -> dict[str, Any]:
    """Which distribution the logprobs come from, after the package policy: its temperature (1
    for greedy answers, whose argmax is taken at 1) and whether filters truncate it."""
    if raw:
        return {"mode": "raw", "temperature": 1.0, "filtered": False}
    return {
        "mode": "processed",
        "temperature": 1.0 if params.greedy else params.temperature,
        "filtered": params.filtered and not params.greedy,
    }


@dataclass(frozen=True)
class RenderedToken:
    """One token as a log-probability entry shows it; logprob None for a prompt's first token."""

    text: str
    bytes: list[int]
    logprob: float | None
    top: tuple[tuple[str, list[int], float], ...] | None


def token_text(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TokenRenderer:
    """Token ids to their text and bytes (cached: a request names the same tokens often)."""

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self._token_bytes = token_bytes
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def _text(self, token_id: int) -> tuple[str, list[int]]:
        known = self._cache.get(token_id)
        if known is None:
            raw = self._token_bytes(token_id)
            known = self._cache[token_id] = (token_text(raw), list(raw))
        return known

    def render(self, entry: TokenLogprob) -> RenderedToken:
        text, raw = self._text(entry.token_id)
        top = tuple((*self._text(t), _finite(v)) for t, v in entry.top)
        return RenderedToken(text, raw, _finite(entry.logprob), top)

    def unscored(self, token_id: int) -> RenderedToken:
        text, raw = self._text(token_id)
        return RenderedToken(text, raw, None, None)


def _finite(logprob: float) -> float:
    return logprob if logprob > ZERO_PROBABILITY_LOGPROB else ZERO_PROBABILITY_LOGPROB


@dataclass(frozen=True)
class ChoiceText:
    """One choice of a non-streaming answer; `logprobs` when the request asked for them."""

    text: str
    finish_reason: str  # "stop", "length", or "tool_calls" when the answer is calls
    logprobs: list[RenderedToken] | None = field(default=None)
    tool_calls: list[ToolCall] | None = field(default=None)
    stop_string: str | None = None  # the request's stop string that ended it, if one did
    reasoning: str | None = None  # what the model reasoned before its answer, for a model that reasons


@dataclass(frozen=True)
class TextPiece:
    """A piece of one choice's streamed answer, as a renderer writes it."""

    index: int
    text: str  # answer text (not tool calls)
    entries: list[RenderedToken] | None  # its tokens' logprob entries, when asked for
    prompt_entries: list[RenderedToken] | None = None  # the echoed prompt's, with the first piece
    reasoning: str = ""  # reasoning text (before the answer), for a model that reasons


class Renderer(Protocol):
    """One API's answer. Streaming: frames for each step, in order; otherwise one body."""

    def start(self, flare: dict[str, Any]) -> list[bytes]: ...
    def text(self, piece: TextPiece) -> list[bytes]: ...
    def calls(self, index: int, deltas: list[dict[str, Any]]) -> list[bytes]: ...
    def finish(self, index: int, reason: str, fell_back: bool, stop_string: str | None) -> list[bytes]: ...
    def end(self, usage: Usage) -> list[bytes]: ...
    def fail(self, failure: RequestFailure) -> list[bytes]: ...
    def keep_alive(self) -> list[bytes]: ...
    def body(self, choices: list[ChoiceText], usage: Usage, flare: dict[str, Any]) -> dict[str, Any]: ...
    def failure_response(self, failure: RequestFailure) -> web.Response: ...
