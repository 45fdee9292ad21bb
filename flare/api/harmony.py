"""A gpt-oss answer read as it streams: harmony's messages split into reasoning, answer text and
tool calls (package/tool_formats.py `HARMONY`, package/reasoning_formats.py `HARMONY`).

The prompt ends with ``<|start|>assistant``, and the model writes one or more messages, each a
header, ``<|message|>``, a body, and an end mark:

    <|channel|>analysis<|message|>Let me think.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

The header names the channel and, for a call, the recipient (``to=functions.NAME``, before or
after the channel). A body on the analysis channel is reasoning; on the final channel, the
answer; a commentary body addressed to a function is that call's arguments (JSON), and one
addressed to no one is a preamble the user sees, so answer text too. <|end|> closes a message
and the next one's <|start|> follows; <|call|> and <|return|> end the generation, so they
usually never reach the text. Text that may still become a mark is held back until it is known.

`HarmonyReader` gives each piece's reasoning and answer text as `ReasoningReader` does, and its
`calls` reader the calls as `ToolCallReader` does, so the answer path reads harmony through the
same two steps as every other format. `harmony_grammar` holds an answer that must be a call or
JSON to harmony's form of it, its reasoning left free.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from flare.api.errors import bad_request
from flare.api.tools.grammar import literal
from flare.api.tools.parse import ToolRequest
from flare.api.tools.reader import ToolCall
from flare.package.tool_formats import HARMONY
from flare.structured.compiler import JSON_OPTIONS
from flare.structured.spec import GrammarSpec

MESSAGE = "<|message|>"
START = "<|start|>"
# What ends a message's body: <|end|> (another message follows), <|call|>, <|return|>.
BODY_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")


def _held(buffer: str, marks: tuple[str, ...]) -> int:
    """How many characters at the end of `buffer` may be the start of one of `marks`."""
    return max((n for mark in marks for n in range(1, min(len(mark), len(buffer) + 1)) if buffer.endswith(mark[:n])), default=0)


@dataclass(frozen=True)
class Header:
    """A message's header: its channel (None where it names none) and recipient (None: the user)."""

    channel: str | None
    recipient: str | None

    @classmethod
    def parse(cls, text: str) -> Header:
        channel = _CHANNEL.search(text)
        recipient = _RECIPIENT.search(text)
        return cls(channel.group(1) if channel else None, recipient.group(1) if recipient else None)

    @property
    def kind(self) -> Literal["reasoning", "answer", "call"]:
        if self.recipient is not None and self.recipient != "assistant":
            return "call"
        return "reasoning" if self.channel == "analysis" else "answer"


@dataclass
class _Call:
    index: int
    id: str
    name: str
    arguments: str = ""


@dataclass
class HarmonyReader:
    """Splits one choice's harmony text into (reasoning, answer) pieces, collecting its calls'
    deltas for `calls` (OpenAI's streamed form: a first delta with index, id, type and name, then
    the arguments in pieces)."""

    call_prefix: str = "call_"
    _mode: Literal["header", "body"] = "header"
    _buffer: str = ""
    _header: Header | None = None
    _call: _Call | None = None
    _deltas: list[dict[str, Any]] = field(default_factory=list)
    finished_calls: list[ToolCall] = field(default_factory=list)
    calls: HarmonyCalls = field(init=False)  # this reader's calls, as the answer path reads calls

    def __post_init__(self) -> None:
        self.calls = HarmonyCalls(self)

    def push(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) of this piece of text."""
        self._buffer += text
        reasoning: list[str] = []
        answer: list[str] = []
        while True:
            if self._mode == "header":
                at = self._buffer.find(MESSAGE)
                if at < 0:
                    return "".join(reasoning), "".join(answer)
                self._open(Header.parse(self._buffer[:at]))
                self._buffer = self._buffer[at + len(MESSAGE) :]
            ends = [(at, mark) for mark in BODY_ENDS if (at := self._buffer.find(mark)) >= 0]
            if not ends:
                cut = len(self._buffer) - _held(self._buffer, BODY_ENDS)
                self._body(self._buffer[:cut], reasoning, answer)
                self._buffer = self._buffer[cut:]
                return "".join(reasoning), "".join(answer)
            at, mark = min(ends)
            self._body(self._buffer[:at], reasoning, answer)
            self._close()
            rest = self._buffer[at + len(mark) :]
            self._buffer = rest[rest.find(START) + len(START) :] if START in rest else rest

    def flush(self) -> tuple[str, str]:
        """What is held back when the choice ends: a body's partial mark is its text after all;
        text that never became a header (a model that wrote no harmony) is answer text."""
        held, self._buffer = self._buffer, ""
        reasoning: list[str] = []
        answer: list[str] = []
        if self._mode == "body":
            self._body(held, reasoning, answer)
            self._close()
        elif held.strip() and not any(token in held for token in HARMONY.control_marks):
            answer.append(held)  # an unfinished header is dropped
        return "".join(reasoning), "".join(answer)

    def _open(self, header: Header) -> None:
        self._mode, self._header = "body", header
        if header.kind == "call":
            name = header.recipient.removeprefix("functions.")  # type: ignore[union-attr]
            self._call = _Call(len(self.finished_calls), HARMONY.new_call_id(self.call_prefix), name)
            self._deltas.append(
                {"index": self._call.index, "id": self._call.id, "type": "function", "function": {"name": name, "arguments": ""}}
            )

    def _body(self, text: str, reasoning: list[str], answer: list[str]) -> None:
        if not text or self._header is None:
            return
        if self._call is not None:
            self._call.arguments += text
            self._deltas.append({"index": self._call.index, "function": {"arguments": text}})
        elif self._header.kind == "reasoning":
            reasoning.append(text)
        else:
            answer.append(text)

    def _close(self) -> None:
        if self._call is not None:
            call = self._call
            self.finished_calls.append(ToolCall(call.id, call.name, call.arguments.strip() or "{}"))
        self._mode, self._header, self._call = "header", None, None

    def take_deltas(self) -> list[dict[str, Any]]:
        deltas, self._deltas = self._deltas, []
        return deltas


@dataclass
class HarmonyCalls:
    """The calls of a `HarmonyReader`, read as `ToolCallReader` gives them: the answer text it is
    handed passes through (the reader has already taken the calls out of it), with the call
    deltas gathered since."""

    reader: HarmonyReader

    def push(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        return text, self.reader.take_deltas()

    @property
    def calls(self) -> list[ToolCall]:
        return self.reader.finished_calls

    @property
    def called(self) -> bool:
        return bool(self.reader.finished_calls)


def harmony_grammar(tools: ToolRequest | None, constraint: GrammarSpec | None, control: Mapping[str, int]) -> GrammarSpec | None:
    """The Lark grammar (llguidance's) of a gpt-oss answer held to tools or a JSON schema, or None
    for an answer left free. `control` names harmony's control tokens by id, so the grammar asks
    for those tokens, not their spelling (api/tools/grammar.py `literal`).

        start: message* answer
        message: <|channel|> (analysis | commentary) <|message|> TEXT <|end|> <|start|> assistant
        answer: <|channel|> commentary to=functions.NAME <|constrain|>json <|message|> %json{its parameters}
              | <|channel|> final <|message|> TEXT          (tool_choice auto: text or a call)
              | <|channel|> final <|message|> %json{schema}  (a JSON schema)

    The messages before the answer (reasoning, preambles) are free. One call a turn: <|call|>
    ends the generation. Another kind of constraint (a regular expression, a choice, a Lark
    grammar) cannot follow the reasoning yet and is a 400 naming its field."""

    def mark(name: str) -> str:
        return literal(name, control)

    channel, body = mark("<|channel|>"), mark("<|message|>")
    answers: list[str] = []
    if tools is not None and tools.calls_possible:
        allowed = [t for t in tools.tools if tools.choice != "named" or t.name == tools.named]
        for tool in allowed:
            to = json.dumps(f"commentary to=functions.{tool.name} ")
            schema = {"x-guidance": JSON_OPTIONS, **tool.parameters}
            answers.append(f'{channel} {to} {mark("<|constrain|>")} "json" {body} %json {json.dumps(schema)}')
        if tools.choice == "auto":
            answers.append(f'{channel} "final" {body} TEXT')
        param, closed = "tools", tuple(p for t in allowed for p in t.closed_objects)
    elif constraint is not None:
        if constraint.kind != "json_schema":
            raise bad_request(
                f"{constraint.param}: gpt-oss reasons before it answers, and this grammar cannot yet be held after its "
                "reasoning (a JSON schema can)",
                param=constraint.param,
            )
        schema = {"x-guidance": JSON_OPTIONS, **json.loads(constraint.source)}
        answers.append(f'{channel} "final" {body} %json {json.dumps(schema)}')
        param, closed = constraint.param, constraint.closed_objects
    else:
        return None
    lark = (
        "start: message* answer\n"
        f'message: {channel} ("analysis" | "commentary") {body} TEXT {mark("<|end|>")} {mark("<|start|>")} "assistant"\n'
        f"answer: {' | '.join(answers)}\n"
        "TEXT: /(.|\\n)*/\n"
    )
    return GrammarSpec("lark", lark, param, closed)
