"""The answer of OpenAI's Responses API (`POST /v1/responses`): the `response` object, or its
stream of typed events.

The response's `output` is a list of items: a `reasoning` item holding the model's reasoning as
one `reasoning_text` part (for a model that reasons), a `message` item holding one
`output_text` part, and a `function_call` item for each tool call. Streaming sends, each as `event: <type>` with a
`data:` JSON carrying `type` and a `sequence_number`:

    response.created, response.in_progress
    reasoning: response.output_item.added, response.reasoning_text.delta ...,
        response.reasoning_text.done, response.output_item.done (before the next item opens)
    per message: response.output_item.added, response.content_part.added,
        response.output_text.delta ..., response.output_text.done,
        response.content_part.done, response.output_item.done
    per call: response.output_item.added, response.function_call_arguments.delta ...,
        response.function_call_arguments.done, response.output_item.done
    response.completed (or response.incomplete at max_output_tokens, response.failed)

There is no `data: [DONE]`. The `flare` object rides on the response object. A complete
response (completed or incomplete, never failed) is handed to `keep`, which stores it when the
request asked for that (store.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from flare.api.errors import failure_body, failure_response
from flare.api.generation import Generation
from flare.api.prepare import Prepared
from flare.api.rendering import ChoiceText, IdForm, TextPiece, new_id
from flare.api.sse import KEEP_ALIVE, sse_event
from flare.scheduler.request import RequestFailure, Usage


# OpenAI's ids: the response resp_..., its output items msg_... (a message) and fc_... (a
# function call), a call's call_id call_...
RESPONSE_IDS = IdForm("resp_")
MESSAGE_ITEM, CALL_ITEM, REASONING_ITEM = "msg_", "fc_", "rs_"


def _usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


@dataclass
class _OpenItem:
    """An output item being streamed: the message, or one call."""

    output_index: int
    id: str
    call_id: str | None = None  # a function call's
    name: str = ""
    text: list[str] = field(default_factory=list)  # the message's or reasoning's text, or the call's arguments
    reasoning: bool = False

    def done(self) -> dict[str, Any]:
        if self.reasoning:
            return _reasoning_item(self.id, "".join(self.text), "completed")
        if self.call_id is None:
            return _message_item(self.id, "".join(self.text), "completed")
        return _call_item(self.id, self.call_id, self.name, "".join(self.text), "completed")


class ResponsesRenderer:
    """The Responses API's answer (answer.py's `Renderer`)."""

    def __init__(
        self,
        prepared: Prepared,
        created: int,
        instructions: str | None = None,
        *,
        store: bool = False,
        previous_response_id: str | None = None,
        keep: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self._prepared = prepared
        self._instructions = instructions
        self._store = store
        self._previous_response_id = previous_response_id
        self._keep = keep
        self._created = created
        self._sequence = 0
        self._flare: dict[str, Any] = {}
        self._items: list[_OpenItem] = []
        self._message: _OpenItem | None = None
        self._reasoning: _OpenItem | None = None  # the reasoning item while it streams
        self._calls: dict[int, _OpenItem] = {}
        self._reason = "stop"

    # --- the response object ------------------------------------------------------------

    def response(
        self, status: str, output: list[dict[str, Any]], usage: Usage | None, flare: dict[str, Any]
    ) -> dict[str, Any]:
        generation = self._prepared.generation
        sampling = self._prepared.clamp.params
        tools = generation.tools
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self._prepared.id,
            "object": "response",
            "created_at": self._created,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": self._instructions,
            "max_output_tokens": sampling.max_tokens,
            "model": generation.model,
            "output": output,
            "parallel_tool_calls": tools.parallel if tools is not None else True,
            "previous_response_id": self._previous_response_id,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "tool_choice": _tool_choice(generation),
            "tools": _tools(generation),
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "store": self._store,
            "metadata": {},
            "usage": None if usage is None else _usage(usage),
            "flare": flare,
        }

    def body(self, choices: list[ChoiceText], usage: Usage, flare: dict[str, Any]) -> dict[str, Any]:
        choice = choices[0]
        output: list[dict[str, Any]] = []
        if choice.reasoning:
            output.append(_reasoning_item(new_id(REASONING_ITEM), choice.reasoning, "completed"))
        if choice.text or not choice.tool_calls:
            output.append(_message_item(new_id(MESSAGE_ITEM), choice.text, "completed"))
        for call in choice.tool_calls or ():
            output.append(_call_item(new_id(CALL_ITEM), call.id, call.name, call.arguments, "completed"))
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        return self._kept(self.response(status, output, usage, flare))

    def _kept(self, response: dict[str, Any]) -> dict[str, Any]:
        if self._keep is not None:
            self._keep(response)
        return response

    def failure_response(self, failure: RequestFailure) -> web.Response:
        return failure_response(failure)

    # --- the stream ---------------------------------------------------------------------

    def _event(self, event_type: str, **fields: Any) -> bytes:
        payload = {"type": event_type, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return sse_event(event_type, payload)

    def start(self, flare: dict[str, Any]) -> list[bytes]:
        self._flare = flare
        response = self.response("in_progress", [], None, flare)
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def _reasoning_text(self, text: str) -> list[bytes]:
        frames = []
        if self._reasoning is None:
            item = self._reasoning = _OpenItem(len(self._items), new_id(REASONING_ITEM), reasoning=True)
            self._items.append(item)
            added = _reasoning_item(item.id, None, "in_progress")
            frames.append(self._event("response.output_item.added", output_index=item.output_index, item=added))
        item = self._reasoning
        item.text.append(text)
        frames.append(
            self._event(
                "response.reasoning_text.delta",
                item_id=item.id,
                output_index=item.output_index,
                content_index=0,
                delta=text,
            )
        )
        return frames

    def _close_reasoning(self) -> list[bytes]:
        """The reasoning item is whole once the answer's first item opens (or the answer ends)."""
        item, self._reasoning = self._reasoning, None
        if item is None:
            return []
        whole = "".join(item.text)
        return [
            self._event(
                "response.reasoning_text.done", item_id=item.id, output_index=item.output_index, content_index=0, text=whole
            ),
            self._event("response.output_item.done", output_index=item.output_index, item=item.done()),
        ]

    def _open(self, call_id: str | None = None, name: str = "") -> tuple[_OpenItem, bytes]:
        item = _OpenItem(len(self._items), new_id(CALL_ITEM if call_id else MESSAGE_ITEM), call_id, name)
        self._items.append(item)
        if call_id is None:
            added = _message_item(item.id, None, "in_progress")
        else:
            added = _call_item(item.id, call_id, name, "", "in_progress")
        return item, self._event("response.output_item.added", output_index=item.output_index, item=added)

    def _open_message(self) -> list[bytes]:
        item, added = self._open()
        self._message = item
        part = self._event(
            "response.content_part.added",
            item_id=item.id,
            output_index=item.output_index,
            content_index=0,
            part=_text_part(""),
        )
        return [added, part]

    def text(self, piece: TextPiece) -> list[bytes]:
        frames = self._reasoning_text(piece.reasoning) if piece.reasoning else []
        if not piece.text:
            return frames
        if self._message is None:
            frames.extend(self._close_reasoning())
            frames.extend(self._open_message())
        item = self._message
        assert item is not None
        item.text.append(piece.text)
        frames.append(
            self._event(
                "response.output_text.delta",
                item_id=item.id,
                output_index=item.output_index,
                content_index=0,
                delta=piece.text,
                logprobs=[],
            )
        )
        return frames

    def calls(self, index: int, deltas: list[dict[str, Any]]) -> list[bytes]:
        frames = []
        for delta in deltas:
            if "id" in delta:
                frames.extend(self._close_reasoning())
                item, added = self._open(delta["id"], delta["function"]["name"])
                self._calls[delta["index"]] = item
                frames.append(added)
                continue
            item = self._calls[delta["index"]]
            piece = delta["function"]["arguments"]
            item.text.append(piece)
            frames.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item.id,
                    output_index=item.output_index,
                    delta=piece,
                )
            )
        return frames

    def finish(self, index: int, reason: str, fell_back: bool, stop_string: str | None) -> list[bytes]:
        self._reason = reason
        frames = self._close_reasoning()
        if not any(not item.reasoning for item in self._items):
            frames.extend(self._open_message())
        for item in self._items:
            if item.reasoning:
                continue
            whole = "".join(item.text)
            if item.call_id is None:
                frames.append(
                    self._event(
                        "response.output_text.done",
                        item_id=item.id,
                        output_index=item.output_index,
                        content_index=0,
                        text=whole,
                        logprobs=[],
                    )
                )
                frames.append(
                    self._event(
                        "response.content_part.done",
                        item_id=item.id,
                        output_index=item.output_index,
                        content_index=0,
                        part=_text_part(whole),
                    )
                )
            else:
                frames.append(
                    self._event(
                        "response.function_call_arguments.done",
                        item_id=item.id,
                        output_index=item.output_index,
                        name=item.name,
                        arguments=whole,
                    )
                )
            frames.append(self._event("response.output_item.done", output_index=item.output_index, item=item.done()))
        if fell_back:
            self._flare = {**self._flare, "fell_back": True}
        return frames

    def end(self, usage: Usage) -> list[bytes]:
        status = "incomplete" if self._reason == "length" else "completed"
        output = [item.done() for item in self._items]
        response = self._kept(self.response(status, output, usage, self._flare))
        return [self._event(f"response.{status}", response=response)]

    def fail(self, failure: RequestFailure) -> list[bytes]:
        output = [item.done() for item in self._items]
        response = self.response("failed", output, None, self._flare)
        response["error"] = {"code": failure.code, "message": failure.message, "flare": failure_body(failure)["error"]["flare"]}
        return [self._event("response.failed", response=response)]

    def keep_alive(self) -> list[bytes]:
        return [KEEP_ALIVE]


def _tool_choice(generation: Generation) -> Any:
    tools = generation.tools
    if tools is None:
        return "auto"
    if tools.choice == "named":
        return {"type": "function", "name": tools.named}
    return tools.choice


def _tools(generation: Generation) -> list[dict[str, Any]]:
    tools = generation.tools
    if tools is None:
        return []
    return [
        {"type": "function", "name": t.name, "description": t.description, "parameters": dict(t.parameters), "strict": True}
        for t in tools.tools
    ]

