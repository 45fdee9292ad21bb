"""Parsing OpenAI's Responses API request (`POST /v1/responses`) into a `Generation`.

Accepted: `input` as a string or a list of items (messages with string content or
`input_text` / `output_text` parts; `function_call` and `function_call_output` items),
`instructions`, `max_output_tokens`, `temperature`, `top_p`, `text.format` (text, json_object,
json_schema: the chat path's response_format), function `tools` with `tool_choice` and
`parallel_tool_calls`, and `stream`. The conversation becomes chat messages and the tools the
chat path's tools, so both go through the same checks, template and grammar as on chat.

`store` (true when absent, as on OpenAI) and `previous_response_id` are the stored responses'
(store.py): the handler looks the earlier response up and hands its items to the parser as
`earlier`, the conversation before `input`. `conversation`, `context_management`, stored
`prompt` templates and `background: true` are refused by name.
Fields that change nothing about the answer are accepted and ignored, once checked (`metadata`
within OpenAI's bounds, `include` among OpenAI's values, items' `id` and `status`, `user`,
`service_tier`, `truncation: "disabled"`, ...); `safety_identifier` and `prompt_cache_key` are
logged with the request, as on chat. Any other field is refused as unrecognized, as on chat;
docs/api.md, "Every request field", holds the table of them all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flare.api.errors import ApiError, bad_request
from flare.api.fields import (
    check_fields,
    effort_switch,
    kind,
    label_field,
    metadata_field,
    model_field,
    no_other_keys,
    response_format,
    sampling_fields,
)
from flare.api.generation import ChatPrompt, Generation, ThinkingSwitch
from flare.api.tools.parse import check_tool_results, parse_tools
from flare.structured.spec import GrammarSpec

_IGNORED = frozenset(
    {
        "metadata", "user", "service_tier", "include", "stream_options", "prompt_cache_options",
        "prompt_cache_retention", "access_programs", "background_options", "image",
    }
)
_FIELDS = _IGNORED | {
    "safety_identifier", "prompt_cache_key", "context_management", "prompt", "moderation",
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "text", "tools",
    "tool_choice", "parallel_tool_calls", "stream", "store", "previous_response_id", "conversation",
    "background", "truncation", "reasoning", "max_tool_calls", "top_logprobs",
}
_ROLES = ("user", "system", "developer", "assistant")
# The values OpenAI's `include` takes: each asks for output this server never produces (no
# built-in tools, images, reasoning or log-probabilities here), so each is accepted and ignored.
INCLUDE_VALUES = frozenset(
    {
        "code_interpreter_call.outputs", "computer_call_output.output.image_url", "file_search_call.results",
        "message.input_image.image_url", "message.output_text.logprobs", "reasoning.encrypted_content",
        "web_search_call.action.sources", "web_search_call.results",
    }
)
# An input item's status, as OpenAI's items carry it.
ITEM_STATUSES = ("in_progress", "completed", "incomplete")


def parse_response_request(body: Mapping[str, Any], earlier: Sequence[Mapping[str, Any]] = ()) -> Generation:
    """`earlier`: the stored items of the response `previous_response_id` names (its input
    items, then its output items), checked when they were stored."""
    check_fields(body, _FIELDS)
    _refuse_unsupported(body)
    model = model_field(body)
    metadata_field(body)
    _include(body.get("include"))
    messages = _conversation(body, earlier)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request(f"stream must be true or false, got {kind(stream)}", param="stream")
    given = {"temperature": body.get("temperature"), "top_p": body.get("top_p"), "max_tokens": body.get("max_output_tokens")}
    sampling = sampling_fields(given, renamed={"max_tokens": "max_output_tokens"})
    constraint = _text_format(body.get("text"))
    tools = parse_tools(
        {
            "tools": _tools(body.get("tools")),
            "tool_choice": _tool_choice(body.get("tool_choice")),
            "parallel_tool_calls": body.get("parallel_tool_calls"),
        }
    )
    if tools is not None and tools.calls_possible and constraint is not None:
        raise bad_request(
            'tools and text.format cannot be combined: send tool_choice "none" or leave text.format out',
            param="tools",
        )
    return Generation(
        model,
        ChatPrompt(tuple(messages), tools, "input"),
        sampling,
        bool(stream),
        constraint=constraint,
        safety_identifier=label_field(body, "safety_identifier"),
        prompt_cache_key=label_field(body, "prompt_cache_key"),
        thinking=_reasoning(body.get("reasoning")),
    )


def _reasoning(reasoning: Any) -> ThinkingSwitch | None:
    """`reasoning.effort` switches the reasoning ("none" off); a summary is accepted and the
    reasoning item carries the whole reasoning text instead."""
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise bad_request(f"reasoning must be an object, got {kind(reasoning)}", param="reasoning")
    no_other_keys(reasoning, {"effort", "summary", "generate_summary"}, "reasoning")
    return effort_switch(reasoning.get("effort"), "reasoning.effort")


@dataclass(frozen=True)
class Storing:
    """What a request asks of the store: to keep its answer, and which response it continues."""

    store: bool
    previous_response_id: str | None


def parse_storing(body: Mapping[str, Any]) -> Storing:
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise bad_request(f"store must be true or false, got {kind(store)}", param="store")
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise bad_request(
            f"previous_response_id must be a response's id (a non-empty string), got {kind(previous)}",
            param="previous_response_id",
        )
    return Storing(store is not False, previous)


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    if body.get("conversation") is not None:
        raise bad_request(
            "conversation is not supported: continue a stored response with previous_response_id, or send the "
            "whole conversation in input",
            param="conversation",
        )
    if body.get("context_management") not in (None, []):
        raise bad_request(
            "context_management is not supported: this server keeps no conversation state to compact; "
            "leave it out",
            param="context_management",
        )
    if body.get("prompt") is not None:
        raise bad_request(
            "prompt (a stored prompt template) is not supported: this server keeps no prompts; send the text in "
            "instructions and input",
            param="prompt",
        )
    if body.get("moderation") is not None:
        raise bad_request(
            "moderation is not supported: this server runs no moderation of input or output", param="moderation"
        )
    if body.get("background") not in (None, False):
        raise bad_request("background: true is not supported; leave background out", param="background")
    if body.get("truncation") not in (None, "disabled"):
        raise bad_request('truncation must be "disabled": a prompt too long is refused, never cut', param="truncation")
    if body.get("top_logprobs") not in (None, 0):
        raise bad_request("top_logprobs is not supported on /v1/responses; use /v1/chat/completions", param="top_logprobs")
    if body.get("max_tool_calls") is not None:
        raise bad_request("max_tool_calls is not supported; use parallel_tool_calls: false for one call", param="max_tool_calls")


def _include(include: Any) -> None:
    if include is None:
        return
    if not isinstance(include, list):
        raise bad_request(f"include must be a list of strings, got {kind(include)}", param="include")
    for k, value in enumerate(include):
        if not isinstance(value, str) or value not in INCLUDE_VALUES:
            shown = repr(value) if isinstance(value, str) else kind(value)
            raise bad_request(
                f"include[{k}] must be one of {', '.join(sorted(INCLUDE_VALUES))}; got {shown}", param=f"include[{k}]"
            )


def _conversation(body: Mapping[str, Any], earlier: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """`instructions`, the `earlier` items and `input` as chat messages: a system message first,
    function calls joined to the assistant turn they follow, function outputs as tool messages,
    each answering a function_call of the turn just before it (the check chat makes)."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request(f"instructions must be a string, got {kind(instructions)}", param="instructions")
        messages.append({"role": "system", "content": instructions})
    given = body.get("input")
    if given is None:
        raise bad_request("input is required: a string or a list of input items", param="input")
    if isinstance(given, str):
        given = [{"type": "message", "role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise bad_request(f"input must be a string or a non-empty list of items, got {kind(given)}", param="input")
    id_fields: dict[int, str] = {}  # tool message -> where its call_id was sent
    thinking: dict[str, str] = {}  # a reasoning item's text, for the assistant turn that follows it
    for i, item in enumerate([*earlier, *given], start=-len(earlier)):
        where = f"input[{i}]" if i >= 0 else f"previous_response_id's item {i + len(earlier)}"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object, got {kind(item)}", param=where)
        _item_id_and_status(where, item)
        item_type = item.get("type", "message")
        if item_type == "message":
            message = _message(where, item)
            messages.append({**message, **thinking} if message["role"] == "assistant" else message)
            thinking = {} if message["role"] == "assistant" else thinking
        elif item_type == "function_call":
            call = _function_call(where, item)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                last.update(thinking)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call], **thinking})
            thinking = {}
        elif item_type == "function_call_output":
            id_fields[len(messages)] = f"{where}.call_id"
            messages.append(_function_output(where, item))
        elif item_type == "reasoning":
            # An earlier turn's reasoning: the template's `thinking` of the assistant turn that
            # follows (gpt-oss's renders it before a call not yet answered; the others, Qwen 3's
            # among them, leave it out of the prompt).
            _only_keys(where, item, {"type", "id", "summary", "content", "encrypted_content", "status"})
            parts = item.get("content") if isinstance(item.get("content"), list) else []
            texts = [p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]
            thinking = {"thinking": "".join(texts)} if texts else {}
        else:
            raise bad_request(
                f"{where}.type {item_type!r} is not supported; send message, function_call, function_call_output or "
                "reasoning "
                "items (item_reference is not supported; continue a stored response with previous_response_id)",
                param=f"{where}.type",
            )
    if not any(m["role"] in ("user", "tool") for m in messages):
        raise bad_request("input must hold at least one user message or function_call_output", param="input")
    check_tool_results(messages, id_fields.__getitem__)
    return messages


def _item_id_and_status(where: str, item: Mapping[str, Any]) -> None:
    """An item's `id` (a string) and `status` (one of ITEM_STATUSES), which the answer ignores."""
    item_id = item.get("id")
    if item_id is not None and not isinstance(item_id, str):
        raise bad_request(f"{where}.id must be a string, got {kind(item_id)}", param=f"{where}.id")
    status = item.get("status")
    if status is not None and status not in ITEM_STATUSES:
        shown = repr(status) if isinstance(status, str) else kind(status)
        raise bad_request(
            f"{where}.status must be one of {', '.join(ITEM_STATUSES)}, got {shown}", param=f"{where}.status"
        )


def _message(where: str, item: Mapping[str, Any]) -> dict[str, Any]:
    _only_keys(where, item, {"type", "role", "content", "id", "status"})
    role = item.get("role")
    if role not in _ROLES:
        raise bad_request(f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}", param=f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "".join(_part(f"{where}.content[{j}]", part) for j, part in enumerate(content))
    else:
        raise bad_request(
            f"{where}.content must be a string or a list of input_text parts, got {kind(content)}",
            param=f"{where}.content",
        )
    return {"role": "system" if role == "developer" else role, "content": text}


def _part(where: str, part: Any) -> str:
    if not isinstance(part, dict):
        raise bad_request(f"{where} must be an object, got {kind(part)}", param=where)
    part_type = part.get("type")
    if part_type not in ("input_text", "output_text", "text"):
        raise bad_request(
            f"{where}.type {part_type!r} is not supported by this text-only model; send input_text parts",
            param=f"{where}.type",
        )
    text = part.get("text")
    if not isinstance(text, str):
        raise bad_request(f"{where}.text must be a string, got {kind(text)}", param=f"{where}.text")
    return text


def _function_call(where: str, item: Mapping[str, Any]) -> dict[str, Any]:
    _only_keys(where, item, {"type", "call_id", "name", "arguments", "id", "status"})
    for field in ("call_id", "name", "arguments"):
        if not isinstance(item.get(field), str) or (field != "arguments" and not item[field]):
            raise bad_request(f"{where}.{field} must be a non-empty string", param=f"{where}.{field}")
    return {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}


def _function_output(where: str, item: Mapping[str, Any]) -> dict[str, Any]:
    _only_keys(where, item, {"type", "call_id", "output", "id", "status"})
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise bad_request(f"{where}.call_id must be a non-empty string", param=f"{where}.call_id")
    output = item.get("output")
    if isinstance(output, list):
        output = "".join(_part(f"{where}.output[{j}]", part) for j, part in enumerate(output))
    if not isinstance(output, str):
        raise bad_request(f"{where}.output must be a string, got {kind(output)}", param=f"{where}.output")
    return {"role": "tool", "content": output, "tool_call_id": call_id}


def _only_keys(where: str, item: Mapping[str, Any], known: set[str]) -> None:
    unknown = sorted(set(item) - known)
    if unknown:
        raise bad_request(f"{where} has an unrecognized field {unknown[0]!r}", param=f"{where}.{unknown[0]}")


def _tools(tools: Any) -> Any:
    """Responses' function tools ({"type", "name", "parameters", ...}) in chat's shape."""
    if not isinstance(tools, list):
        return tools  # parse_tools names what is wrong
    converted = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            shown = tool.get("type") if isinstance(tool, dict) else kind(tool)
            raise bad_request(
                f"tools[{i}]: only function tools are supported, got {shown!r}", param=f"tools[{i}].type"
            )
        function = {k: v for k, v in tool.items() if k != "type"}
        converted.append({"type": "function", "function": function})
    return converted


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _text_format(text: Any) -> GrammarSpec | None:
    """`text.format` through the chat path's response_format, its errors naming text.format."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request(f"text must be an object with a format, got {kind(text)}", param="text")
    unknown = sorted(set(text) - {"format", "verbosity"})
    if unknown:
        raise bad_request(f"text has an unrecognized field {unknown[0]!r}", param=f"text.{unknown[0]}")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request(f"text.format must be an object with a type, got {kind(fmt)}", param="text.format")
    if fmt.get("type") == "json_schema":
        inner = {k: v for k, v in fmt.items() if k != "type"}
        as_chat = {"type": "json_schema", "json_schema": inner}
    else:
        as_chat = dict(fmt)
    try:
        return response_format(as_chat)
    except ApiError as error:
        raise ApiError(
            error.status, _renamed(error.message), param=_renamed(error.param or "text.format"), code=error.code
        ) from None


def _renamed(text: str) -> str:
    return text.replace("response_format.json_schema", "text.format").replace("response_format", "text.format")
