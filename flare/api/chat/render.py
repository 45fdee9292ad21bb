"""The bodies and stream chunks of OpenAI's chat completions and (legacy) completions APIs.

One shape class per endpoint, with the same methods, and one renderer (`OpenAIRenderer`) that
writes either through the request path's steps (api/answer.py). Streams follow
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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

from flare.api.errors import failure_body, failure_response
from flare.api.rendering import ChoiceText, IdForm, RenderedToken, TextPiece
from flare.api.sse import DONE, KEEP_ALIVE, sse_data
from flare.scheduler.request import RequestFailure, Usage

# OpenAI's ids: chatcmpl-... and cmpl-..., tool calls call_...
CHAT_IDS = IdForm("chatcmpl-")
COMPLETION_IDS = IdForm("cmpl-")


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
        "completion_tokens_details": {
            "accepted_prediction_tokens": usage.accepted_prediction_tokens,
            "rejected_prediction_tokens": usage.rejected_prediction_tokens,
        },
    }


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

    def reasoning_chunk(
        self, text: str, index: int = 0, logprobs: list[RenderedToken] | None = None
    ) -> dict[str, Any]:
        """A piece of the reasoning, as vLLM and llama.cpp stream it: `delta.reasoning_content`."""
        return self._chunk({"reasoning_content": text}, None, index, None if logprobs is None else chat_logprobs(logprobs))

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
    message: dict[str, Any] = {"role": "assistant", "content": choice.text}
    if choice.reasoning is not None:
        message["reasoning_content"] = choice.reasoning  # vLLM's and llama.cpp's field
    if choice.tool_calls:
        message["content"] = choice.text or None
        message["tool_calls"] = [call.to_json() for call in choice.tool_calls]
    return message


def _text_choice(text: str, finish_reason: str | None, index: int, logprobs: Any = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


class OpenAIRenderer:
    """Chat completions' or completions' answer (answer.py's `Renderer`), through its shape.

    `echoes` holds each choice's echoed prompt (completions' echo), or None. Without logprobs
    the echo is the first text of every choice; with them it waits for the prompt's entries,
    which come with each choice's first piece."""

    def __init__(
        self, shape: ChatCompletionShape | TextCompletionShape, echoes: Sequence[str | None], logprobs: bool
    ) -> None:
        self.shape = shape
        self._echoes = list(echoes)
        self._logprobs = logprobs
        self._offsets = [0] * len(self._echoes)  # characters of each choice written (text_offset)

    def start(self, flare: dict[str, Any]) -> list[bytes]:
        frames = []
        for index, echo in enumerate(self._echoes):
            first = self.shape.first_chunk(index)
            if index == 0:
                first["flare"] = flare
            frames.append(sse_data(first))
            if echo is not None and not self._logprobs:
                frames.append(sse_data(self.shape.text_chunk(echo, index)))
                self._offsets[index] = len(echo)
        return frames

    def text(self, piece: TextPiece) -> list[bytes]:
        frames = []
        index = piece.index
        echo = self._echoes[index]
        if piece.prompt_entries is not None and echo is not None:
            frames.append(sse_data(self.shape.text_chunk(echo, index, piece.prompt_entries, self._offsets[index])))
            self._offsets[index] += len(echo)
        reasoned = bool(piece.reasoning) and isinstance(self.shape, ChatCompletionShape)
        if reasoned:
            # The piece's logprob entries ride on its content chunk, or on its reasoning chunk
            # when it has no content.
            entries = None if piece.text else piece.entries
            frames.append(sse_data(self.shape.reasoning_chunk(piece.reasoning, index, entries)))
        if piece.text or (piece.entries and not reasoned):
            frames.append(sse_data(self.shape.text_chunk(piece.text, index, piece.entries, self._offsets[index])))
            self._offsets[index] += len(piece.text)
        return frames

    def calls(self, index: int, deltas: list[dict[str, Any]]) -> list[bytes]:
        if not isinstance(self.shape, ChatCompletionShape):
            return []
        return [sse_data(self.shape.tool_calls_chunk(deltas, index))]

    def finish(self, index: int, reason: str, fell_back: bool, stop_string: str | None) -> list[bytes]:
        final = self.shape.final_chunk(reason, index)
        if fell_back:
            final["flare"] = {"fell_back": True}
        return [sse_data(final)]

    def end(self, usage: Usage) -> list[bytes]:
        usage_chunk = [sse_data(self.shape.usage_chunk(usage))] if self.shape.include_usage else []
        return [*usage_chunk, DONE]

    def fail(self, failure: RequestFailure) -> list[bytes]:
        return [sse_data(failure_body(failure)), DONE]

    def keep_alive(self) -> list[bytes]:
        return [KEEP_ALIVE]

    def body(self, choices: list[ChoiceText], usage: Usage, flare: dict[str, Any]) -> dict[str, Any]:
        return {**self.shape.body(choices, usage), "flare": flare}

    def failure_response(self, failure: RequestFailure) -> web.Response:
        return failure_response(failure)
