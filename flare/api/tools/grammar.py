"""The grammar of an answer with tools: text or calls, in the tool-call format the package's
template teaches, each call's arguments held to its function's parameters schema."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from flare.api.reasoning import reasoning_rule
from flare.api.tools.parse import Tool, ToolRequest
from flare.package.reasoning_formats import ReasoningFormat
from flare.package.tool_formats import FLARE, NameOutside, ToolFormat
from flare.structured.compiler import JSON_OPTIONS
from flare.structured.spec import GrammarSpec


def tool_grammar(
    tools: ToolRequest,
    fmt: ToolFormat = FLARE,
    control: Mapping[str, int] | None = None,
    reasoning: ReasoningFormat | None = None,
    inside: bool = False,
) -> GrammarSpec | None:
    """The Lark grammar (llguidance's, with %json for the arguments) the answer follows, in the
    tool-call format `fmt` (package/tool_formats.py); `control` names the control tokens
    among its marks by id (Mistral's [TOOL_CALLS] is one token, not its spelling). With
    `reasoning`, the model's reasoning opens the answer, free (api/reasoning.py; `inside`: the
    prompt opened it), and the grammar holds what follows."""
    if not tools.calls_possible:
        return None
    allowed = [t for t in tools.tools if tools.choice != "named" or t.name == tools.named]
    control = control or {}
    several = tools.parallel and fmt.several
    calls = f"call ({literal(fmt.separator, control)} call)*" if several else "call"
    if fmt.name_outside is None:
        call = f"%json {json.dumps(_call_schema(allowed, fmt.arguments_key))}"
    else:
        call = "(" + " | ".join(_named_call(t, fmt.name_outside, control) for t in allowed) + ")"
    start = "text | calls" if tools.choice == "auto" else "calls"
    thinking = ""
    if reasoning is not None:
        opens, thinking = reasoning_rule(reasoning, inside)
        start = f"{opens}({start})"
    lark = (
        f"start: {start}\n"
        f"{thinking}"
        "text: TEXT\n"
        f"TEXT: /[^{re.escape(fmt.lead)}](.|\\n)*/\n"
        f"calls: {literal(fmt.prefix, control)} {calls} {literal(fmt.suffix, control)}\n"
        f"call: {literal(fmt.call_open, control)} {call} {literal(fmt.call_close, control)}\n"
        + ("CALL_NUMBER: /[0-9]{1,3}/\n" if fmt.name_outside is not None and fmt.name_outside.numbered else "")
    )
    return GrammarSpec("lark", lark, "tools", tuple(p for t in allowed for p in t.closed_objects))


def _call_schema(allowed: list[Tool], arguments_key: str) -> dict[str, Any]:
    """A call as one JSON object, `{"name": ..., arguments_key: {...}}`, of one of the functions.
    Each function's parameters sit under the schema's $defs, their local references rewritten to
    point there: a reference resolves against the parameters schema it was written in
    (Pydantic's "#/$defs/Model"), not against the call schema around it."""
    return {
        "x-guidance": JSON_OPTIONS,
        "$defs": {_parameters_key(t): _rebased(t.parameters, f"#/$defs/{_parameters_key(t)}") for t in allowed},
        "oneOf": [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, arguments_key: {"$ref": f"#/$defs/{_parameters_key(t)}"}},
                "required": ["name", arguments_key],
                "additionalProperties": False,
            }
            for t in allowed
        ],
    }


def _named_call(tool: Tool, named: NameOutside, control: Mapping[str, int]) -> str:
    """One function's call where the name is written outside the arguments (Kimi K2's): its
    header, then its arguments as their own JSON object."""
    number = " CALL_NUMBER" if named.numbered else ""
    header = f"{literal(named.before + tool.name + named.after, control)}{number} {literal(named.arguments_open, control)}"
    return f"{header} %json {json.dumps({'x-guidance': JSON_OPTIONS, **tool.parameters})}"


def literal(text: str, control: Mapping[str, int]) -> str:
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
