"""Tools into the prompt: the conversation in flare's generic format (a system preamble listing
the functions, calls as ``<tool_call>{...}</tool_call>`` lines, results as user turns), or in
Hugging Face's convention for a template that knows tools."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from flare.api.tools.parse import ToolRequest

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


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
