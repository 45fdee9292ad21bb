"""Tool calls read back from an answer as it streams, in the format the grammar held it to."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from flare.package.tool_formats import FLARE, ToolFormat


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_json(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


_DECODER = json.JSONDecoder()


def _object_end(body: str) -> int:
    """Where the JSON object that `body` starts with ends; -1 while it is not whole yet (a
    string argument may hold braces and closing tags: only the JSON's own end counts)."""
    try:
        _, end = _DECODER.raw_decode(body)
    except ValueError:
        return -1
    return end


def _call(body: str, fmt: ToolFormat, call_prefix: str) -> ToolCall | None:
    """A whole call's JSON object as a ToolCall; the arguments as the model wrote them (the
    grammar held them to the schema), re-serialized only for another layout."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    head = fmt.head.match(body)
    if head is not None and body.endswith("}"):
        arguments = body[head.end() : -1]
    else:
        arguments = json.dumps(value.get(fmt.arguments_key, {}))
    return ToolCall(fmt.new_call_id(call_prefix), value["name"], arguments)


def _named_call(name: str | None, arguments: str, fmt: ToolFormat, call_prefix: str) -> ToolCall | None:
    """A whole call whose name was written outside its arguments' JSON (which the grammar held
    to the function's parameters schema, as `_call`'s)."""
    try:
        json.loads(arguments)
    except ValueError:
        return None
    return None if name is None else ToolCall(fmt.new_call_id(call_prefix), name, arguments)


@dataclass
class _OpenCall:
    """The call being generated: its id once its name is known, and how much of its arguments
    has been sent."""

    index: int
    id: str | None = None
    sent: int = 0


@dataclass
class ToolCallReader:
    """Reads one choice's answer as it streams, in the tool-call format `fmt`: text passes
    through; from the format's leading character on (the grammar lets text never start with
    it), the answer is calls. Reasoning that opens the answer (Qwen 3's thinking) is read apart
    before this reader sees the answer (api/reasoning.py). Each call is given out as OpenAI streams them: a first delta with
    its index, id, type and name (arguments ""), then its arguments in pieces as they are
    generated, up to the end of the call's JSON object."""

    active: bool
    fmt: ToolFormat = FLARE
    call_prefix: str = "call_"  # the API's form of a call id (OpenAI's call_, Anthropic's toolu_)
    _mode: Literal["unknown", "text", "calls"] = "unknown"
    _buffer: str = ""
    _open: _OpenCall | None = None
    calls: list[ToolCall] = field(default_factory=list)

    def push(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(text to send as content, tool_calls deltas for this piece)."""
        if not self.active:
            return text, []
        if self._mode == "unknown":
            self._buffer += text
            if not self._buffer:
                return "", []
            self._mode = "calls" if self._buffer.startswith(self.fmt.lead) else "text"
            text, self._buffer = self._buffer, ""
        if self._mode == "text":
            return text, []
        self._buffer += text
        deltas: list[dict[str, Any]] = []
        while (body := self._call_body()) is not None:
            call = self._open or _OpenCall(len(self.calls))
            self._open = call
            name, arguments, end = self._parts(body)
            if name is not None and call.id is None:
                call.id = self.fmt.new_call_id(self.call_prefix)
                deltas.append({"index": call.index, "id": call.id, "type": "function",
                               "function": {"name": name, "arguments": ""}})
            if len(arguments) > call.sent:
                deltas.append({"index": call.index, "function": {"arguments": arguments[call.sent :]}})
                call.sent = len(arguments)
            rest = self._after_close(body[end:]) if end >= 0 else None
            if rest is None:
                break
            if self.fmt.name_outside is None:
                finished = _call(body[:end], self.fmt, self.call_prefix)
            else:
                finished = _named_call(name, arguments, self.fmt, self.call_prefix)
            if finished is not None:
                self.calls.append(ToolCall(call.id or finished.id, finished.name, finished.arguments))
            self._open = None
            self._buffer = rest
        return "", deltas

    def _parts(self, body: str) -> tuple[str | None, str, int]:
        """(the call's name once it is whole, its arguments written so far, where its JSON
        ends in `body` or -1 while it is open). In the JSON object of a call, everything after
        its head is arguments while the object is open, all but its closing brace once it closes;
        where the name is outside (Kimi's), the arguments are the JSON object after the header."""
        named = self.fmt.name_outside
        if named is None:
            head = self.fmt.head.match(body)
            end = _object_end(body)
            if head is None:
                return None, "", end
            arguments = body[head.end() : end - 1] if end >= 0 else body[head.end() :]
            return json.loads(f'"{head.group(1)}"'), arguments, end
        header = named.header.match(body)
        if header is None:
            return None, "", -1
        arguments = body[header.end() :]
        end = _object_end(arguments)
        return header.group(1), arguments[:end] if end >= 0 else arguments, header.end() + end if end >= 0 else -1

    def _call_body(self) -> str | None:
        """The buffer from the next call's JSON object on (from its header, where the name is
        outside it), or None until it has begun."""
        buffer = self._buffer
        mark = self.fmt.call_open.strip()
        if mark:
            start = buffer.find(mark)
            if start < 0:
                return None
            buffer = buffer[start + len(mark) :]
        if self.fmt.name_outside is not None:
            return buffer
        start = buffer.find("{")
        return buffer[start:] if start >= 0 else None

    def _after_close(self, rest: str) -> str | None:
        """What follows the call's closing mark in `rest` (the text after its JSON object), or
        None until the mark is whole."""
        mark = self.fmt.call_close.strip()
        if not mark:
            return rest
        end = rest.find(mark)
        return None if end < 0 else rest[end + len(mark) :]

    @property
    def called(self) -> bool:
        return bool(self.calls)
