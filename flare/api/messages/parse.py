"""Parsing Anthropic's Messages API request (`POST /v1/messages`, `/v1/messages/count_tokens`)
into a `Generation`.

Accepted: `system` (a string or text blocks), `messages` whose content is a string or blocks
(`text`; `tool_use` and earlier `thinking` on assistant turns, `tool_result` on user turns), `max_tokens` (required,
as Anthropic requires it), `temperature`, `top_p`, `top_k`, `stop_sequences`, `tools` (custom
tools: name, description, input_schema) with `tool_choice` (auto, any, tool, none;
`disable_parallel_tool_use`), and `stream`. The conversation becomes chat messages and the tools
the chat path's, so both go through the same checks, template and grammar as on chat (each
tool_result answers a tool_use of the turn before it). A final assistant turn is a prefill: the
prompt ends inside it and the answer continues it, as Anthropic's API does.
`thinking: {"type": "disabled"}` is what this model does (it does not think), and
`output_config.format` (a JSON schema) holds the answer to the schema as chat's response_format.
`metadata` (checked as every API checks it, api/fields.py), `service_tier` and the routing fields
(`speed`, `inference_geo`, ...) are accepted and ignored, `cache_control` (top-level, on blocks and
on tools) too (the prefix cache is automatic); anything else is refused by name: images and
documents (a text-only model), thinking enabled, server tools and their containers, MCP servers.
docs/api.md, "Every request field", holds the table of every field of Anthropic's request type and
what flare does with it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from flare.api.errors import bad_request
from flare.api.fields import check_fields, kind, metadata_field, model_field, no_other_keys, sampling_fields
from flare.api.generation import ChatPrompt, Generation, ThinkingSwitch
from flare.api.tools.parse import check_tool_results, parse_tools
from flare.structured.spec import GrammarSpec

# count_tokens takes what shapes the prompt, and the switches a Messages request would send with it.
_COUNT_FIELDS = frozenset(
    {
        "model", "messages", "system", "tools", "tool_choice", "thinking", "output_config", "cache_control", "speed",
        "user_profile_id", "workspace_id",
    }
)
# Accepted and ignored: they route, bill or label a request, and change nothing about its answer.
_IGNORED = frozenset(
    {"metadata", "service_tier", "cache_control", "speed", "inference_geo", "diagnostics", "user_profile_id", "workspace_id"}
)
_FIELDS = _COUNT_FIELDS | _IGNORED | {
    "max_tokens", "temperature", "top_p", "top_k", "stop_sequences", "stream", "thinking", "output_config", "container",
}


def parse_messages_request(body: Mapping[str, Any], *, counting: bool = False) -> Generation:
    """The request as a Generation; `counting` for count_tokens, which takes no max_tokens."""
    check_fields(body, _COUNT_FIELDS if counting else _FIELDS)
    model = model_field(body)
    system = _system(body.get("system"))
    conversation, prefill = _conversation(body.get("messages"))
    messages = [*system, *conversation]
    tools = parse_tools(
        {
            "tools": _tools(body.get("tools")),
            "tool_choice": _tool_choice(body.get("tool_choice")),
            "parallel_tool_calls": _parallel(body.get("tool_choice")),
        }
    )
    prompt = ChatPrompt(tuple(messages), tools, continues=prefill)
    thinking = _thinking(body.get("thinking"))
    constraint = _output_format(body.get("output_config"))
    if counting:
        return Generation(model, prompt, {}, thinking=thinking)
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise bad_request("max_tokens is required: the most tokens to generate", param="max_tokens")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request(f"stream must be true or false, got {kind(stream)}", param="stream")
    metadata_field(body)
    given = {
        "max_tokens": max_tokens,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "top_k": body.get("top_k"),
        "stop": body.get("stop_sequences"),
    }
    if given["stop"] is not None and not isinstance(given["stop"], list):
        raise bad_request(f"stop_sequences must be a list of strings, got {kind(given['stop'])}", param="stop_sequences")
    sampling = sampling_fields(given, renamed={"stop": "stop_sequences"})
    if body.get("container") is not None:
        raise bad_request(
            "container is not supported: it holds server tools' files, and this server has no tools of its own",
            param="container",
        )
    if constraint is not None and tools is not None and tools.calls_possible:
        raise bad_request(
            'tools and output_config.format cannot be combined: send tool_choice {"type": "none"} or leave the '
            "format out",
            param="output_config.format",
        )
    return Generation(model, prompt, sampling, bool(stream), constraint=constraint, thinking=thinking)


def _thinking(thinking: Any) -> ThinkingSwitch | None:
    """Extended thinking as a switch: served for a model that reasons (prepare refuses it for
    one that does not); its token budget is accepted and not enforced."""
    if thinking is None:
        return None
    if not isinstance(thinking, dict):
        raise bad_request(f"thinking must be an object with a type, got {kind(thinking)}", param="thinking")
    thinking_type = thinking.get("type")
    if thinking_type == "disabled":
        no_other_keys(thinking, {"type"}, "thinking")
        return ThinkingSwitch(False, "thinking")
    if thinking_type in ("enabled", "adaptive"):
        no_other_keys(thinking, {"type", "budget_tokens", "display"}, "thinking")
        return ThinkingSwitch(True, "thinking")
    raise bad_request(f"thinking.type must be enabled or disabled, got {thinking_type!r}", param="thinking.type")


def _output_format(config: Any) -> GrammarSpec | None:
    """output_config: `format` (a JSON schema the answer is held to, as chat's response_format)
    and `effort` (accepted and ignored: this model has one way of answering)."""
    where = "output_config"
    if config is None:
        return None
    if not isinstance(config, dict):
        raise bad_request(f"{where} must be an object, got {kind(config)}", param=where)
    no_other_keys(config, {"format", "effort"}, where)
    fmt = config.get("format")
    if fmt is None:
        return None
    where = "output_config.format"
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise bad_request(f'{where} must be {{"type": "json_schema", "schema": {{...}}}}', param=where)
    no_other_keys(fmt, {"type", "schema"}, where)
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise bad_request(f"{where}.schema must be a JSON schema object, got {kind(schema)}", param=f"{where}.schema")
    return GrammarSpec.json_schema(schema, f"{where}.schema")


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    if not isinstance(system, list):
        raise bad_request(f"system must be a string or a list of text blocks, got {kind(system)}", param="system")
    return [{"role": "system", "content": "".join(_text_block(f"system[{j}]", b) for j, b in enumerate(system))}]


def _conversation(messages: Any) -> tuple[list[dict[str, Any]], str | None]:
    """Anthropic's turns as chat messages: a user turn's tool_result blocks become tool messages
    (before its text), an assistant turn's tool_use blocks its tool_calls. Each tool result
    answers a tool_use of the turn before it (the check chat makes). A final assistant turn is a
    prefill, continued by the answer: the second value names it (None when the conversation ends
    with a user turn)."""
    if messages is None:
        raise bad_request("messages is required: a list of {role, content} objects", param="messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request(
            f"messages must be a non-empty list of {{role, content}} objects, got {kind(messages)}", param="messages"
        )
    converted: list[dict[str, Any]] = []
    id_fields: dict[int, str] = {}  # converted tool message -> where its tool_use_id was sent
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object with role and content, got {kind(message)}", param=where)
        unknown = sorted(set(message) - {"role", "content"})
        if unknown:
            raise bad_request(f"{where} has an unrecognized field {unknown[0]!r}", param=f"{where}.{unknown[0]}")
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise bad_request(f"{where}.role must be user or assistant, got {role!r}", param=f"{where}.role")
        content = message.get("content")
        final_assistant = role == "assistant" and i == len(messages) - 1
        if content in ("", []) and not final_assistant:
            # Anthropic's rule: only the final assistant turn (an empty prefill) may be empty.
            raise bad_request(
                f"{where}.content must not be empty (only the final assistant turn may be)", param=f"{where}.content"
            )
        if isinstance(content, str):
            converted.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad_request(
                f"{where}.content must be a string or a list of content blocks, got {kind(content)}",
                param=f"{where}.content",
            )
        for turn_message, id_field in _blocks(where, role, content):
            if id_field is not None:
                id_fields[len(converted)] = id_field
            converted.append(turn_message)
    check_tool_results(converted, id_fields.__getitem__)
    if messages[-1].get("role") != "assistant":
        return converted, None
    where = f"messages[{len(messages) - 1}]"
    if converted[-1].get("tool_calls"):
        raise bad_request(
            f"{where}: the final assistant turn ends with tool_use, so there is nothing to continue; "
            "send its tool_result in a user turn",
            param=where,
        )
    if converted[-1]["content"] != converted[-1]["content"].rstrip():
        # Anthropic's own rule: the continuation would otherwise start after a dangling space.
        raise bad_request(
            f"{where}.content: final assistant content cannot end with trailing whitespace", param=f"{where}.content"
        )
    return converted, where


def _blocks(where: str, role: str, blocks: list[Any]) -> list[tuple[dict[str, Any], str | None]]:
    """The turn's chat messages, each with the field of its tool_use_id (tool results only)."""
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[tuple[dict[str, Any], str | None]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        block_type = block.get("type") if isinstance(block, dict) else None
        if block_type == "tool_use" and role == "assistant":
            calls.append(_tool_use(at, block))
        elif block_type == "tool_result" and role == "user":
            results.append((_tool_result(at, block), f"{at}.tool_use_id"))
        elif block_type in ("thinking", "redacted_thinking") and role == "assistant":
            # An earlier answer's thinking, sent back: the template's `thinking` (gpt-oss's renders
            # it before a call not yet answered; the others leave it out of the prompt).
            if block_type == "thinking" and isinstance(block.get("thinking"), str):
                thoughts.append(block["thinking"])
        elif block_type in ("tool_use", "tool_result"):
            raise bad_request(
                f"{at}: {block_type} blocks belong on {'assistant' if block_type == 'tool_use' else 'user'} turns",
                param=at,
            )
        else:
            texts.append(_text_block(at, block))
    turn = [*results]
    thinking = {"thinking": "".join(thoughts)} if thoughts else {}
    if calls:
        turn.append(({"role": "assistant", "content": "".join(texts), "tool_calls": calls, **thinking}, None))
    elif texts or not results:
        turn.append(({"role": role, "content": "".join(texts), **thinking}, None))
    return turn


def _text_block(where: str, block: Any) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        shown = block.get("type") if isinstance(block, dict) else kind(block)
        raise bad_request(
            f'{where} must be a text block {{"type": "text", "text": ...}}; {shown!r} blocks are not supported by '
            "this text-only model",
            param=where,
        )
    unknown = sorted(set(block) - {"type", "text", "cache_control", "citations"})
    if unknown:
        raise bad_request(f"{where} has an unrecognized field {unknown[0]!r}", param=f"{where}.{unknown[0]}")
    text = block.get("text")
    if not isinstance(text, str):
        raise bad_request(f"{where}.text must be a string, got {kind(text)}", param=f"{where}.text")
    return text


def _tool_use(where: str, block: Mapping[str, Any]) -> dict[str, Any]:
    for field in ("id", "name"):
        if not isinstance(block.get(field), str) or not block[field]:
            raise bad_request(f"{where}.{field} must be a non-empty string", param=f"{where}.{field}")
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise bad_request(f"{where}.input must be an object, got {kind(arguments)}", param=f"{where}.input")
    return {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": json.dumps(arguments)}}


def _tool_result(where: str, block: Mapping[str, Any]) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise bad_request(f"{where}.tool_use_id must be a non-empty string", param=f"{where}.tool_use_id")
    content = block.get("content", "")
    if isinstance(content, list):
        content = "".join(_text_block(f"{where}.content[{k}]", b) for k, b in enumerate(content))
    if not isinstance(content, str):
        raise bad_request(f"{where}.content must be a string or text blocks, got {kind(content)}", param=f"{where}.content")
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise bad_request(f"{where}.is_error must be true or false, got {kind(is_error)}", param=f"{where}.is_error")
    if is_error:
        content = f"Error: {content}"
    return {"role": "tool", "content": content, "tool_call_id": call_id}


def _tools(tools: Any) -> Any:
    """Anthropic's tools ({"name", "description", "input_schema"}) in chat's shape."""
    if not isinstance(tools, list):
        return tools  # parse_tools names what is wrong
    converted = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            shown = tool.get("type") if isinstance(tool, dict) else kind(tool)
            raise bad_request(f"{where}: only custom tools are supported, got {shown!r}", param=f"{where}.type")
        unknown = sorted(set(tool) - {"type", "name", "description", "input_schema", "cache_control"})
        if unknown:
            raise bad_request(f"{where} has an unrecognized field {unknown[0]!r}", param=f"{where}.{unknown[0]}")
        if "input_schema" not in tool:
            raise bad_request(f"{where}.input_schema is required: a JSON schema object", param=f"{where}.input_schema")
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if "description" in tool:
            function["description"] = tool["description"]
        converted.append({"type": "function", "function": function})
    return converted


def _tool_choice(choice: Any) -> Any:
    if choice is None:
        return None
    if not isinstance(choice, dict):
        raise bad_request(f"tool_choice must be an object with a type, got {kind(choice)}", param="tool_choice")
    choice_type = choice.get("type")
    if choice_type == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    named = {"auto": "auto", "any": "required", "none": "none"}
    if choice_type not in named:
        raise bad_request(
            f"tool_choice.type must be auto, any, tool or none, got {choice_type!r}", param="tool_choice.type"
        )
    return named[choice_type]


def _parallel(choice: Any) -> bool | None:
    if not isinstance(choice, dict) or choice.get("disable_parallel_tool_use") is None:
        return None
    disable = choice["disable_parallel_tool_use"]
    if not isinstance(disable, bool):
        raise bad_request(
            "tool_choice.disable_parallel_tool_use must be true or false", param="tool_choice.disable_parallel_tool_use"
        )
    return not disable
