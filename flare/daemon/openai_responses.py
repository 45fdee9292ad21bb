"""The bodies and stream chunks of OpenAI's chat completions and (legacy) completions APIs.

One class per endpoint, with the same methods, so that one handler serves both. Streams follow
OpenAI exactly: chat sends a role chunk first, then content deltas, then a chunk with
`finish_reason` and an empty delta; with `stream_options.include_usage` every chunk carries
`"usage": null` and a last chunk with empty `choices` carries the usage. With n choices every
chunk carries one choice, named by its `index`, and the choices' chunks interleave as their
tokens come. The server adds the `flare` object (`flare_object`) to the non-streaming body
and to the first chunk.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

from flare.sampling.policy import ClampResult
from flare.scheduler.request import Usage


def flare_object(clamp: ClampResult) -> dict[str, Any]:
    """What was applied: the effective sampling parameters and every requested value changed."""
    sampling = dataclasses.asdict(clamp.params)
    sampling["stop"] = list(clamp.params.stop)
    return {"sampling": sampling, "adjusted": [adjustment.to_json() for adjustment in clamp.adjusted]}


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


@dataclass(frozen=True)
class ChoiceText:
    """One choice of a non-streaming answer."""

    text: str
    finish_reason: str


def _envelope(shape: ChatCompletionShape | TextCompletionShape, object_name: str, choices: list[Any]) -> dict[str, Any]:
    """The fields every body and chunk of both endpoints share, in OpenAI's order."""
    return {"id": shape.id, "object": object_name, "created": shape.created, "model": shape.model, "choices": choices}


class ResponseShape(Protocol):
    id: str
    include_usage: bool

    def first_chunk(self, index: int = 0) -> dict[str, Any]: ...
    def text_chunk(self, text: str, index: int = 0) -> dict[str, Any]: ...
    def final_chunk(self, finish_reason: str, index: int = 0) -> dict[str, Any]: ...
    def usage_chunk(self, usage: Usage) -> dict[str, Any]: ...
    def body(self, choices: list[ChoiceText], usage: Usage) -> dict[str, Any]: ...


@dataclass(frozen=True)
class ChatCompletionShape:
    id: str  # "chatcmpl-..."
    created: int
    model: str
    include_usage: bool

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None, index: int) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        chunk = _envelope(self, "chat.completion.chunk", [choice])
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def first_chunk(self, index: int = 0) -> dict[str, Any]:
        return self._chunk({"role": "assistant", "content": ""}, None, index)

    def text_chunk(self, text: str, index: int = 0) -> dict[str, Any]:
        return self._chunk({"content": text}, None, index)

    def final_chunk(self, finish_reason: str, index: int = 0) -> dict[str, Any]:
        return self._chunk({}, finish_reason, index)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**_envelope(self, "chat.completion.chunk", []), "usage": usage_json(usage)}

    def body(self, choices: list[ChoiceText], usage: Usage) -> dict[str, Any]:
        bodies = [
            {
                "index": index,
                "message": {"role": "assistant", "content": choice.text},
                "logprobs": None,
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

    def _chunk(self, text: str, finish_reason: str | None, index: int) -> dict[str, Any]:
        chunk = _envelope(self, "text_completion", [_text_choice(text, finish_reason, index)])
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def first_chunk(self, index: int = 0) -> dict[str, Any]:
        # OpenAI's completions stream has no role chunk; an empty first chunk carries `flare`
        # and changes nothing for clients, which concatenate the texts.
        return self._chunk("", None, index)

    def text_chunk(self, text: str, index: int = 0) -> dict[str, Any]:
        return self._chunk(text, None, index)

    def final_chunk(self, finish_reason: str, index: int = 0) -> dict[str, Any]:
        return self._chunk("", finish_reason, index)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**_envelope(self, "text_completion", []), "usage": usage_json(usage)}

    def body(self, choices: list[ChoiceText], usage: Usage) -> dict[str, Any]:
        bodies = [_text_choice(choice.text, choice.finish_reason, index) for index, choice in enumerate(choices)]
        return {**_envelope(self, "text_completion", bodies), "usage": usage_json(usage)}


def _text_choice(text: str, finish_reason: str | None, index: int) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
