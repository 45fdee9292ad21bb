"""The bodies and stream chunks of OpenAI's chat completions and (legacy) completions APIs.

One class per endpoint, with the same methods, so that one handler serves both. Streams follow
OpenAI exactly: chat sends a role chunk first, then content deltas, then a chunk with
`finish_reason` and an empty delta; with `stream_options.include_usage` every chunk carries
`"usage": null` and a last chunk with empty `choices` carries the usage. With n choices every
chunk carries one choice, named by its `index`, and the choices' chunks interleave as their
tokens come. The server adds the `flare` object (`flare_object`) to the non-streaming body
and to the first chunk.

Log-probabilities come in each endpoint's own shape: chat's `logprobs.content` list of
{token, logprob, bytes, top_logprobs}, completions' {tokens, token_logprobs, top_logprobs,
text_offset}; a stream carries the entries of each chunk's tokens in that chunk. A token of
probability 0 (masked or filtered out) reports -9999.0, as JSON has no -infinity; such tokens
are left out of top_logprobs. A token whose bytes are not whole UTF-8 is written as OpenAI
does: "bytes:\\xe2\\x80" with its bytes in `bytes`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from flare.sampling.params import SamplingParams
from flare.sampling.policy import ClampResult
from flare.scheduler.request import TokenLogprob, Usage

ZERO_PROBABILITY_LOGPROB = -9999.0


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


def chat_logprobs(tokens: list[RenderedToken]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": t.text,
                "logprob": t.logprob,
                "bytes": t.bytes,
                "top_logprobs": [{"token": text, "logprob": v, "bytes": raw} for text, raw, v in t.top or ()],
            }
            for t in tokens
        ],
        "refusal": None,
    }


def completion_logprobs(tokens: list[RenderedToken], text_offset: int) -> dict[str, Any]:
    """Completions' shape; `text_offset` is where the first token's text starts in the choice."""
    offsets = []
    for t in tokens:
        offsets.append(text_offset)
        text_offset += len(t.text)
    return {
        "tokens": [t.text for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [None if t.top is None else {text: v for text, _, v in t.top} for t in tokens],
        "text_offset": offsets,
    }


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


@dataclass(frozen=True)
class ChoiceText:
    """One choice of a non-streaming answer; `logprobs` when the request asked for them."""

    text: str
    finish_reason: str
    logprobs: list[RenderedToken] | None = field(default=None)
    tool_calls: list[dict[str, Any]] | None = field(default=None)  # then text is None in the body


def _envelope(shape: ChatCompletionShape | TextCompletionShape, object_name: str, choices: list[Any]) -> dict[str, Any]:
    """The fields every body and chunk of both endpoints share, in OpenAI's order."""
    return {"id": shape.id, "object": object_name, "created": shape.created, "model": shape.model, "choices": choices}


class ResponseShape(Protocol):
    id: str
    include_usage: bool

    def first_chunk(self, index: int = 0) -> dict[str, Any]: ...
    def text_chunk(
        self, text: str, index: int = 0, logprobs: list[RenderedToken] | None = None, text_offset: int = 0
    ) -> dict[str, Any]: ...
    def final_chunk(self, finish_reason: str, index: int = 0) -> dict[str, Any]: ...
    def usage_chunk(self, usage: Usage) -> dict[str, Any]: ...
    def body(self, choices: list[ChoiceText], usage: Usage) -> dict[str, Any]: ...


@dataclass(frozen=True)
class ChatCompletionShape:
    id: str  # "chatcmpl-..."
    created: int
    model: str
    include_usage: bool

    def _chunk(
        self, delta: dict[str, Any], finish_reason: str | None, index: int, logprobs: Any = None
    ) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        chunk = _envelope(self, "chat.completion.chunk", [choice])
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def first_chunk(self, index: int = 0) -> dict[str, Any]:
        return self._chunk({"role": "assistant", "content": ""}, None, index)

    def text_chunk(
        self, text: str, index: int = 0, logprobs: list[RenderedToken] | None = None, text_offset: int = 0
    ) -> dict[str, Any]:
        return self._chunk({"content": text}, None, index, None if logprobs is None else chat_logprobs(logprobs))

    def final_chunk(self, finish_reason: str, index: int = 0) -> dict[str, Any]:
        return self._chunk({}, finish_reason, index)

    def tool_calls_chunk(self, calls: list[dict[str, Any]], index: int = 0) -> dict[str, Any]:
        """A delta of whole calls, each with its `index` among the choice's calls."""
        return self._chunk({"tool_calls": calls}, None, index)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**_envelope(self, "chat.completion.chunk", []), "usage": usage_json(usage)}

    def body(self, choices: list[ChoiceText], usage: Usage) -> dict[str, Any]:
        bodies = [
            {
                "index": index,
                "message": _message(choice),
                "logprobs": None if choice.logprobs is None else chat_logprobs(choice.logprobs),
                "finish_reason": choice.finish_reason,
            }
            for index, choice in enumerate(choices)
        ]
        return {**_envelope(self, "chat.completion", bodies), "usage": usage_json(usage)}


@dataclass(frozen=True)
class TextCompletionShape:
    id: str  # "cmpl-..."
    created: int
    model: str
    include_usage: bool

    def _chunk(self, text: str, finish_reason: str | None, index: int, logprobs: Any = None) -> dict[str, Any]:
        chunk = _envelope(self, "text_completion", [_text_choice(text, finish_reason, index, logprobs)])
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def first_chunk(self, index: int = 0) -> dict[str, Any]:
        # OpenAI's completions stream has no role chunk; an empty first chunk carries `flare`
        # and changes nothing for clients, which concatenate the texts.
        return self._chunk("", None, index)

    def text_chunk(
        self, text: str, index: int = 0, logprobs: list[RenderedToken] | None = None, text_offset: int = 0
    ) -> dict[str, Any]:
        rendered = None if logprobs is None else completion_logprobs(logprobs, text_offset)
        return self._chunk(text, None, index, rendered)

    def final_chunk(self, finish_reason: str, index: int = 0) -> dict[str, Any]:
        return self._chunk("", finish_reason, index)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**_envelope(self, "text_completion", []), "usage": usage_json(usage)}

    def body(self, choices: list[ChoiceText], usage: Usage) -> dict[str, Any]:
        bodies = [
            _text_choice(
                choice.text,
                choice.finish_reason,
                index,
                None if choice.logprobs is None else completion_logprobs(choice.logprobs, 0),
            )
            for index, choice in enumerate(choices)
        ]
        return {**_envelope(self, "text_completion", bodies), "usage": usage_json(usage)}


def _message(choice: ChoiceText) -> dict[str, Any]:
    if choice.tool_calls:
        return {"role": "assistant", "content": choice.text or None, "tool_calls": choice.tool_calls}
    return {"role": "assistant", "content": choice.text}


def _text_choice(text: str, finish_reason: str | None, index: int, logprobs: Any = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
