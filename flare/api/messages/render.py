"""The answer of Anthropic's Messages API (`POST /v1/messages`), and its error shape.

The body is a `message`: `content` blocks (a `thinking` block with the model's reasoning, for a
model that reasons; `text`, then one `tool_use` per call), `stop_reason`
(end_turn, max_tokens, tool_use), `usage`. Streaming sends Anthropic's events, each as
`event: <type>` with a `data:` JSON carrying `type`:

    message_start, ping
    ping again whenever the stream has had no event for `stream_keepalive_s`
    per block: content_block_start, content_block_delta ... (text_delta or
        input_json_delta; thinking_delta then an empty signature_delta), content_block_stop
    message_delta (stop_reason, usage), message_stop

A failure mid-stream is an `error` event. Errors are Anthropic's body,
`{"type": "error", "error": {"type", "message"}}`, with the same status as elsewhere. The
`flare` object rides on the message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from flare.api.errors import anthropic_error_body
from flare.api.prepare import Prepared
from flare.api.rendering import ChoiceText, IdForm, TextPiece
from flare.api.sse import sse_event
from flare.scheduler.request import RequestFailure, Usage

# Anthropic's ids: the message msg_..., a tool_use block's toolu_...
MESSAGE_IDS = IdForm("msg_", call="toolu_")

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _stop_reason(finish_reason: str, stop_string: str | None) -> str:
    """Anthropic's stop_reason: stop_sequence where one of the request's stop_sequences ended
    the answer, end_turn where the model did."""
    return "stop_sequence" if stop_string is not None else _STOP_REASONS[finish_reason]


def _sse(event_type: str, payload: dict[str, Any]) -> bytes:
    return sse_event(event_type, {"type": event_type, **payload})


def _usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def _tool_use(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        value = {}
    return {"type": "tool_use", "id": call_id, "name": name, "input": value}


@dataclass
class _Block:
    index: int
    kind: str  # "thinking", "text" or "tool_use"


class MessagesRenderer:
    """Anthropic's Messages answer (answer.py's `Renderer`)."""

    def __init__(self, prepared: Prepared) -> None:
        self._prepared = prepared
        self._blocks: list[_Block] = []
        self._text: _Block | None = None  # the open text or thinking block
        self._calls: dict[int, _Block] = {}
        self._reason = "end_turn"
        self._stop_sequence: str | None = None

    def message(
        self, content: list[dict[str, Any]], stop_reason: str | None, usage: Usage, stop_sequence: str | None = None
    ) -> dict[str, Any]:
        return {
            "id": self._prepared.id,
            "type": "message",
            "role": "assistant",
            "model": self._prepared.generation.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": _usage(usage),
        }

    def body(self, choices: list[ChoiceText], usage: Usage, flare: dict[str, Any]) -> dict[str, Any]:
        choice = choices[0]
        content: list[dict[str, Any]] = []
        if choice.reasoning:
            # flare signs nothing: the signature is empty, and a thinking block sent back is read as text.
            content.append({"type": "thinking", "thinking": choice.reasoning, "signature": ""})
        if choice.text or not choice.tool_calls:
            content.append({"type": "text", "text": choice.text})
        content.extend(_tool_use(c.id, c.name, c.arguments) for c in choice.tool_calls or ())
        reason = _stop_reason(choice.finish_reason, choice.stop_string)
        return {**self.message(content, reason, usage, choice.stop_string), "flare": flare}

    def failure_response(self, failure: RequestFailure) -> web.Response:
        return web.json_response(anthropic_error_body(failure.http_status, failure.message), status=failure.http_status)

    def start(self, flare: dict[str, Any]) -> list[bytes]:
        message = self.message([], None, Usage(self._prepared.prompt_tokens, 0))
        return [_sse("message_start", {"message": {**message, "flare": flare}}), *self.keep_alive()]

    def keep_alive(self) -> list[bytes]:
        return [_sse("ping", {})]

    def _open(self, kind: str, block: dict[str, Any]) -> tuple[_Block, list[bytes]]:
        frames = self._close_text()
        opened = _Block(len(self._blocks), kind)
        self._blocks.append(opened)
        frames.append(_sse("content_block_start", {"index": opened.index, "content_block": block}))
        return opened, frames

    def _close_text(self) -> list[bytes]:
        if self._text is None:
            return []
        closed, self._text = self._text, None
        frames = []
        if closed.kind == "thinking":
            signature = {"type": "signature_delta", "signature": ""}
            frames.append(_sse("content_block_delta", {"index": closed.index, "delta": signature}))
        return [*frames, _sse("content_block_stop", {"index": closed.index})]

    def text(self, piece: TextPiece) -> list[bytes]:
        frames: list[bytes] = []
        if piece.reasoning:
            if self._text is None:
                self._text, frames = self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            delta = {"type": "thinking_delta", "thinking": piece.reasoning}
            frames.append(_sse("content_block_delta", {"index": self._text.index, "delta": delta}))
        if not piece.text:
            return frames
        if self._text is not None and self._text.kind == "thinking":
            frames.extend(self._close_text())
        if self._text is None:
            self._text, opened = self._open("text", {"type": "text", "text": ""})
            frames.extend(opened)
        delta = {"type": "text_delta", "text": piece.text}
        frames.append(_sse("content_block_delta", {"index": self._text.index, "delta": delta}))
        return frames

    def calls(self, index: int, deltas: list[dict[str, Any]]) -> list[bytes]:
        frames: list[bytes] = []
        for delta in deltas:
            if "id" in delta:
                if self._calls:  # the call before is whole once the next one starts
                    frames.append(_sse("content_block_stop", {"index": self._blocks[-1].index}))
                block, opened = self._open("tool_use", _tool_use(delta["id"], delta["function"]["name"], ""))
                self._calls[delta["index"]] = block
                frames.extend(opened)
                continue
            block = self._calls[delta["index"]]
            partial = {"type": "input_json_delta", "partial_json": delta["function"]["arguments"]}
            frames.append(_sse("content_block_delta", {"index": block.index, "delta": partial}))
        return frames

    def finish(self, index: int, reason: str, fell_back: bool, stop_string: str | None) -> list[bytes]:
        self._reason, self._stop_sequence = _stop_reason(reason, stop_string), stop_string
        frames: list[bytes] = []
        if not self._blocks or (self._text is not None and self._text.kind == "thinking"):
            # An empty answer is still one (empty) text block, as Anthropic sends it.
            self._text, frames = self._open("text", {"type": "text", "text": ""})
        frames.append(_sse("content_block_stop", {"index": self._blocks[-1].index}))
        self._text = None
        return frames

    def end(self, usage: Usage) -> list[bytes]:
        delta = {"stop_reason": self._reason, "stop_sequence": self._stop_sequence}
        return [
            _sse("message_delta", {"delta": delta, "usage": {"output_tokens": usage.completion_tokens}}),
            _sse("message_stop", {}),
        ]

    def fail(self, failure: RequestFailure) -> list[bytes]:
        return [_sse("error", {"error": anthropic_error_body(failure.http_status, failure.message)["error"]})]
