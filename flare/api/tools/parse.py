"""The request's tools: `tools`, `tool_choice` and `parallel_tool_calls` checked into a
`ToolRequest`, and tool messages checked against the calls they answer."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from flare.api.errors import bad_request
from flare.structured.bounds import BoundError, check_schema
from flare.structured.strict import StrictError, close_objects

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


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


def chat_id_field(index: int) -> str:
    """Where chat completions carries the call id of its message `index`."""
    return f"messages[{index}].tool_call_id"


def check_tool_results(messages: Sequence[Mapping[str, Any]], id_field: Callable[[int], str] = chat_id_field) -> None:
    """Each `tool` message (a chat tool message, an Anthropic tool_result block, a Responses
    function_call_output, all parsed into chat messages) answers a call of the assistant turn
    just before it (only tool messages between them), by that call's id: as OpenAI and Anthropic
    do, a 400 otherwise naming the request field that holds the id (`id_field` of the message's
    index: each API says where its id came from)."""
    calls: set[str] | None = None  # the ids of the calls tool messages may answer here
    for index, message in enumerate(messages):
        if message["role"] == "tool":
            where = id_field(index)
            if calls is None:
                raise bad_request(
                    f"{where} {message['tool_call_id']!r}: a tool result must answer a tool call of the assistant turn "
                    "just before it, and none comes before it",
                    param=where,
                )
            if message["tool_call_id"] not in calls:
                raise bad_request(
                    f"{where} {message['tool_call_id']!r} matches no tool call of the assistant turn just before it "
                    f"(its calls: {', '.join(sorted(calls)) or 'none'})",
                    param=where,
                )
        elif message.get("tool_calls"):
            calls = {call["id"] for call in message["tool_calls"]}
        else:
            calls = None
