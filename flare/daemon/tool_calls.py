"""Tool calls (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`): the prompt, the grammar
that holds the answer to a text or a call, and the calls read back from the answer.

The format is the one Hermes and Qwen models are trained on, written by flare for a package
whose chat template does not know tools (the default model's):

- a system preamble lists the functions as JSON between <tools> and </tools> and says how to
  call one: ``<tool_call>{"name": NAME, "arguments": {...}}</tool_call>``, one per line;
- an assistant message with tool_calls is written as those lines; a `tool` message as a user
  turn holding ``<tool_response>...</tool_response>``;
- the answer's grammar: with tool_choice "auto", either text that does not start with "<", or
  one or more calls; "required" forces calls, a named function forces one call of it;
  parallel_tool_calls false allows one call. Each call's arguments are held to the function's
  parameters schema by the grammar (llguidance's %json), so they always validate; its local
  references resolve within it, and `strict: true` closes its open objects as for
  response_format (structured/strict.py).

A package whose template knows tools (it names `tools`, as Qwen's, Llama 3.1's and Mistral's
do) gets the functions and the conversation through its template instead, in Hugging Face's
convention (`template_messages`, `template_tools`); the answer is held to and read in the format
that template teaches (preparation/tool_formats.py), the one above where it teaches none of those.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from flare.daemon.errors import bad_request
from flare.package.tool_formats import FLARE, ToolFormat
from flare.structured.bounds import BoundError, check_schema
from flare.structured.compiler import JSON_OPTIONS
from flare.structured.spec import GrammarSpec
from flare.structured.strict import StrictError, close_objects

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: Mapping[str, Any]
    closed_objects: tuple[str, ...] = ()  # what `strict: true` closed (structured/strict.py)


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[Tool, ...]
    choice: Literal["none", "auto", "required", "named"]
    named: str | None = None
    parallel: bool = True

    @property
    def calls_possible(self) -> bool:
        return self.choice != "none" and bool(self.tools)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_json(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


# --- parsing the request ------------------------------------------------------------------


def parse_tools(body: Mapping[str, Any]) -> ToolRequest | None:
    """`tools`, `tool_choice` and `parallel_tool_calls`, or None when no tools are given."""
    raw = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls must be true or false", param="parallel_tool_calls")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice names a tool but no tools are given", param="tool_choice")
        return None
    if not isinstance(raw, list):
        raise bad_request("tools must be a list of function definitions", param="tools")
    if len(raw) > MAX_TOOLS:
        raise bad_request(f"tools has {len(raw)} entries; at most {MAX_TOOLS} are allowed", param="tools")
    tools = tuple(_tool(i, t) for i, t in enumerate(raw))
    names = [t.name for t in tools]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise bad_request(f"tools names the function {duplicate!r} twice", param="tools")
    if choice is None:
        return ToolRequest(tools, "auto", parallel=parallel is not False)
    if choice in ("none", "auto", "required"):
        return ToolRequest(tools, choice, parallel=parallel is not False)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
        return ToolRequest(tools, "named", named=name, parallel=False)
    raise bad_request(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        param="tool_choice",
    )


def _tool(index: int, value: Any) -> Tool:
    where = f"tools[{index}]"
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(value.get("function"), dict):
        raise bad_request(f'{where} must be {{"type": "function", "function": {{...}}}}', param=where)
    unknown = sorted(set(value) - {"type", "function"})
    if unknown:
        raise bad_request(f"{where} has an unrecognized field {unknown[0]!r}", param=f"{where}.{unknown[0]}")
    function = value["function"]
    unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
    if unknown:
        raise bad_request(f"{where}.function has an unrecognized field {unknown[0]!r}", param=f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request(
            f"{where}.function.name must be 1 to 64 letters, digits, underscores or dashes, got {name!r}",
            param=f"{where}.function.name",
        )
    description = function.get("description", "")
    if not isinstance(description, str):
        raise bad_request(f"{where}.function.description must be a string", param=f"{where}.function.description")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}, "additionalProperties": False}
    if not isinstance(parameters, dict):
        raise bad_request(
            f"{where}.function.parameters must be a JSON schema object", param=f"{where}.function.parameters"
        )
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"{where}.function.strict must be true or false", param=f"{where}.function.strict")
    try:
        check_schema(parameters)
    except BoundError as error:
        raise bad_request(f"{where}.function.parameters {error}", param=f"{where}.function.parameters") from None
    closed: tuple[str, ...] = ()
    if strict:
        try:
            parameters, closed = close_objects(parameters)
        except StrictError as error:
            raise bad_request(f"{where}.function.parameters: {error}", param=f"{where}.function.parameters") from None
    return Tool(name, description, parameters, tuple(f"{name}:{pointer}" for pointer in closed))


def check_tool_results(messages: Sequence[Mapping[str, Any]]) -> None:
    """Each `tool` message answers a call of the assistant message before it (only tool messages
    between them), by that call's id: as OpenAI does, a 400 naming the message otherwise."""
    calls: set[str] | None = None  # the ids of the calls tool messages may answer here
    for index, message in enumerate(messages):
        if message["role"] == "tool":
            where = f"messages[{index}]"
            if calls is None:
                raise bad_request(
                    f"{where}: a tool message must answer a tool call of the assistant message before it, "
                    "and none comes before it",
                    param=where,
                )
            if message["tool_call_id"] not in calls:
                raise bad_request(
                    f"{where}.tool_call_id {message['tool_call_id']!r} matches no tool call of the assistant message "
                    f"before it (its calls: {', '.join(sorted(calls)) or 'none'})",
                    param=f"{where}.tool_call_id",
                )
        elif message.get("tool_calls"):
            calls = {call["id"] for call in message["tool_calls"]}
        else:
            calls = None


# --- the prompt ---------------------------------------------------------------------------


def render_messages(
    messages: Sequence[Mapping[str, Any]], tools: ToolRequest | None, *, system_turn: bool = True
) -> list[dict[str, Any]]:
    """The conversation in the generic format: plain {role, content} messages for any template.
    The preamble is a system turn, or opens the first user turn where the template takes no
    system turn (`system_turn` False)."""
    rendered: list[dict[str, Any]] = []
    for message in messages:
        if message["role"] == "tool":
            rendered.append({"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"})
        elif message.get("tool_calls"):
            calls = "\n".join(
                CALL_OPEN
                + json.dumps({"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])})
                + CALL_CLOSE
                for c in message["tool_calls"]
            )
            content = message.get("content") or ""
            rendered.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
        else:
            rendered.append({"role": message["role"], "content": message["content"]})
    if tools is not None and tools.calls_possible:
        preamble = _preamble(tools)
        first_user = next((i for i, m in enumerate(rendered) if m["role"] == "user"), None)
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {"role": "system", "content": f"{rendered[0]['content']}\n\n{preamble}"}
        elif not system_turn and first_user is not None:
            rendered[first_user] = {"role": "user", "content": f"{preamble}\n\n{rendered[first_user]['content']}"}
        else:
            rendered.insert(0, {"role": "system", "content": preamble})
    return rendered


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The conversation for a template that knows tools, in Hugging Face's convention: a call's
    arguments as an object (templates write them with `tojson`), tool turns as they are."""
    rendered = []
    for message in messages:
        if message.get("tool_calls"):
            calls = [
                {"id": c["id"], "type": "function",
                 "function": {"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}}
                for c in message["tool_calls"]
            ]
            rendered.append({**message, "tool_calls": calls})
        else:
            rendered.append(dict(message))
    return rendered


def template_tools(tools: ToolRequest | None) -> list[dict[str, Any]] | None:
    """The functions as a template's `tools` variable (OpenAI's shape), or None when none is offered."""
    if tools is None or not tools.calls_possible:
        return None
    offered = [t for t in tools.tools if tools.choice != "named" or t.name == tools.named]
    return [
        {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": dict(t.parameters)}}
        for t in offered
    ]


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # an earlier call's arguments as the client sent them


def _preamble(tools: ToolRequest) -> str:
    listed = "\n".join(
        json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters}) for t in tools.tools
    )
    how = (
        f'To call a function, answer with {CALL_OPEN}{{"name": <function name>, "arguments": <arguments as JSON>}}'
        f"{CALL_CLOSE}"
    )
    if tools.choice == "named":
        rule = f"You must call the function {tools.named}."
    elif tools.choice == "required":
        rule = "You must call one or more of the functions."
    else:
        rule = "If no function helps, answer in plain text."
    many = " You may call several, one per line." if tools.parallel and tools.choice != "named" else ""
    return f"You can call these functions:\n<tools>\n{listed}\n</tools>\n{how}.{many} {rule}"


# --- the grammar --------------------------------------------------------------------------


def tool_grammar(
    tools: ToolRequest, fmt: ToolFormat = FLARE, control: Mapping[str, int] | None = None
) -> GrammarSpec | None:
    """The Lark grammar (llguidance's, with %json for the arguments) the answer follows, in the
    tool-call format `fmt` (preparation/tool_formats.py); `control` names the control tokens
    among its marks by id (Mistral's [TOOL_CALLS] is one token, not its spelling)."""
    if not tools.calls_possible:
        return None
    allowed = [t for t in tools.tools if tools.choice != "named" or t.name == tools.named]
    # Each function's parameters sit under the call schema's $defs, their local references
    # rewritten to point there: a reference resolves against the parameters schema it was
    # written in (Pydantic's "#/$defs/Model"), not against the call schema around it.
    call_schema = {
        "x-guidance": JSON_OPTIONS,
        "$defs": {_parameters_key(t): _rebased(t.parameters, f"#/$defs/{_parameters_key(t)}") for t in allowed},
        "oneOf": [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, fmt.arguments_key: {"$ref": f"#/$defs/{_parameters_key(t)}"}},
                "required": ["name", fmt.arguments_key],
                "additionalProperties": False,
            }
            for t in allowed
        ],
    }
    control = control or {}
    several = tools.parallel and fmt.several
    calls = f"call ({_literal(fmt.separator, control)} call)*" if several else "call"
    start = "text | calls" if tools.choice == "auto" else "calls"
    thinking = ""
    if fmt.thinking is not None:
        start = f"THINKING? ({start})"
        thinking = f"THINKING: /{_thinking_regex(*fmt.thinking)}/\n"
    lark = (
        f"start: {start}\n"
        f"{thinking}"
        "text: TEXT\n"
        f"TEXT: /[^{re.escape(fmt.lead)}](.|\\n)*/\n"
        f"calls: {_literal(fmt.prefix, control)} {calls} {_literal(fmt.suffix, control)}\n"
        f"call: {_literal(fmt.call_open, control)} %json {json.dumps(call_schema)} {_literal(fmt.call_close, control)}\n"
    )
    return GrammarSpec("lark", lark, "tools", tuple(p for t in allowed for p in t.closed_objects))


def _thinking_regex(opening: str, closing: str) -> str:
    """A regular expression (Lark's, slashes escaped) of `opening`, text without `closing`,
    `closing` and newlines: one lexeme, so that the reasoning ends at its first closing tag."""

    def escaped(text: str) -> str:
        return re.escape(text).replace("/", "\\/")

    # Text without `closing`: each character but the tag's first, or a proper prefix of the
    # tag followed by a character that does not continue it.
    avoid = "|".join(
        f"{escaped(closing[:n])}[^{escaped(closing[n])}]" for n in range(len(closing))
    )
    return f"{escaped(opening)}({avoid})*{escaped(closing)}\\n*"


def _literal(text: str, control: Mapping[str, int]) -> str:
    """`text` as Lark: its control tokens by id (`<[id]>`), the rest as string literals (JSON's
    escapes are Lark's); nothing for no text."""
    pieces: list[str] = []
    start = 0
    names = sorted((name for name in control if name in text), key=len, reverse=True)
    if names:
        for match in re.finditer("|".join(re.escape(name) for name in names), text):
            if match.start() > start:
                pieces.append(json.dumps(text[start : match.start()]))
            pieces.append(f"<[{control[match.group()]}]>")
            start = match.end()
    if start < len(text):
        pieces.append(json.dumps(text[start:]))
    return " ".join(pieces)


_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # values, not schemas


def _parameters_key(tool: Tool) -> str:
    return f"parameters_{tool.name}"


def _rebased(schema: Any, root: str) -> Any:
    """`schema` with every local reference ("#", "#/...") moved under `root`. The body parser
    bounds the nesting, so recursion is safe here."""
    if isinstance(schema, list):
        return [_rebased(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rebased = {key: value if key in _DATA_KEYWORDS else _rebased(value, root) for key, value in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        rebased["$ref"] = root + ref[1:]
    return rebased


# --- the answer ---------------------------------------------------------------------------


_DECODER = json.JSONDecoder()


def _object_end(body: str) -> int:
    """Where the JSON object that `body` starts with ends; -1 while it is not whole yet (a
    string argument may hold braces and closing tags: only the JSON's own end counts)."""
    try:
        _, end = _DECODER.raw_decode(body)
    except ValueError:
        return -1
    return end


def _call(body: str, fmt: ToolFormat) -> ToolCall | None:
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
    return ToolCall(fmt.new_call_id(), value["name"], arguments)


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
    it), the answer is calls. Reasoning the format lets open the answer (Qwen 3's thinking)
    passes through as text, and the answer after it is read the same way. Each call is given out as OpenAI streams them: a first delta with
    its index, id, type and name (arguments ""), then its arguments in pieces as they are
    generated, up to the end of the call's JSON object."""

    active: bool
    fmt: ToolFormat = FLARE
    _mode: Literal["unknown", "thinking", "thought", "text", "calls"] = "unknown"
    _buffer: str = ""
    _open: _OpenCall | None = None
    calls: list[ToolCall] = field(default_factory=list)

    def push(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(text to send as content, tool_calls deltas for this piece)."""
        if not self.active:
            return text, []
        thought = ""
        if self._mode in ("thinking", "thought"):
            thought, text = self._thinking(text)
            if self._mode != "unknown":
                return thought, []
        if self._mode == "unknown":
            self._buffer += text
            opening = self.fmt.thinking[0] if self.fmt.thinking else None
            if not self._buffer or (opening is not None and opening.startswith(self._buffer) and self._buffer != opening):
                return thought, []  # nothing yet, or what may still become the reasoning's opening tag
            if opening is not None and self._buffer.startswith(opening):
                self._mode = "thinking"
                text, self._buffer = self._buffer, ""
                more, deltas = self.push(text)
                return thought + more, deltas
            self._mode = "calls" if self._buffer.startswith(self.fmt.lead) else "text"
            text, self._buffer = self._buffer, ""
        if self._mode == "text":
            return thought + text, []
        self._buffer += text
        deltas: list[dict[str, Any]] = []
        while (body := self._call_body()) is not None:
            call = self._open or _OpenCall(len(self.calls))
            self._open = call
            head = self.fmt.head.match(body)
            if head is not None and call.id is None:
                call.id = self.fmt.new_call_id()
                name = json.loads(f'"{head.group(1)}"')
                deltas.append({"index": call.index, "id": call.id, "type": "function",
                               "function": {"name": name, "arguments": ""}})
            end = _object_end(body)
            if head is not None:
                # While the call's object is open, everything after its head is arguments;
                # once it closes, all but the object's closing brace.
                arguments = body[head.end() :]
                upto = end - head.end() - 1 if end >= 0 else len(arguments)
                if upto > call.sent:
                    deltas.append({"index": call.index, "function": {"arguments": arguments[call.sent : upto]}})
                    call.sent = upto
            rest = self._after_close(body[end:]) if end >= 0 else None
            if rest is None:
                break
            finished = _call(body[:end], self.fmt)
            if finished is not None:
                self.calls.append(ToolCall(call.id or finished.id, finished.name, finished.arguments))
            self._open = None
            self._buffer = rest
        return thought, deltas

    def _thinking(self, text: str) -> tuple[str, str]:
        """The reasoning that opens the answer (Qwen 3's <think>...</think> and the newlines
        after it) passes through as content; (that content, the text after it). The mode turns
        "unknown" once the answer proper begins."""
        closing = self.fmt.thinking[1] if self.fmt.thinking else ""
        if self._mode == "thought":  # the closing tag is out: newlines until the answer
            answer = text.lstrip("\n")
            if answer:
                self._mode = "unknown"
            return text[: len(text) - len(answer)], answer
        self._buffer += text
        end = self._buffer.find(closing)
        if end < 0:
            # Hold back what may be the start of the closing tag.
            held = next((n for n in range(len(closing) - 1, 0, -1) if self._buffer.endswith(closing[:n])), 0)
            thought, self._buffer = self._buffer[: len(self._buffer) - held], self._buffer[len(self._buffer) - held :]
            return thought, ""
        thought, rest = self._buffer[: end + len(closing)], self._buffer[end + len(closing) :]
        self._buffer = ""
        self._mode = "thought"
        more, answer = self._thinking(rest)
        return thought + more, answer

    def _call_body(self) -> str | None:
        """The buffer from the next call's JSON object on, or None until it has begun."""
        buffer = self._buffer
        mark = self.fmt.call_open.strip()
        if mark:
            start = buffer.find(mark)
            if start < 0:
                return None
            buffer = buffer[start + len(mark) :]
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
