"""The parser of Ollama's `POST /api/chat` and `POST /api/generate`: a body into a `Generation`,
checked before anything touches the model.

Ollama's `options` are its sampling fields under its own names (`num_predict` is max_tokens,
`repeat_penalty` is repetition_penalty); they are validated and then clamped by the package
policy like every API's. The options Ollama takes for its own runner (num_ctx, num_thread, ...)
or for samplers flare does not have (mirostat, typical_p, ...) are accepted and ignored, as
Ollama itself ignores an option it does not know: docs/api.md, "Ollama API", has the table.
`format` ("json" or a JSON schema) is the structured-output constraint chat's response_format
is; `tools` are OpenAI's function tools (Ollama's shape is OpenAI's). Ollama's messages carry
tool calls with their arguments as an object and no ids: the ids the one request path needs
are made here, and a tool message answers the assistant's calls in order.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flare.api.errors import bad_request
from flare.api.fields import check_fields, kind, model_field, sampling_fields
from flare.api.generation import ChatPrompt, Generation, TextPrompts
from flare.api.tools.parse import check_tool_results, parse_tools
from flare.structured.spec import GrammarSpec

# Ollama's option names that are flare's sampling fields under another name or the same one.
SAMPLING_OPTIONS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "seed": "seed",
    "num_predict": "max_tokens",
    "stop": "stop",
}
# Ollama's options that change nothing here, each with why (docs/api.md shows the same table).
IGNORED_OPTIONS = {
    "num_ctx": "the package fixes the served context; the daemon serves every request within it",
    "num_batch": "the scheduler sizes its own rounds",
    "num_gpu": "the daemon places the model when it starts",
    "main_gpu": "the daemon places the model when it starts",
    "low_vram": "the daemon places the model when it starts",
    "numa": "the daemon's process placement is the operator's",
    "num_thread": "the daemon's threads are the operator's",
    "use_mmap": "the package is loaded once when the daemon starts",
    "use_mlock": "the package is loaded once when the daemon starts",
    "vocab_only": "the package is loaded once when the daemon starts",
    "embedding_only": "this server generates; it serves no embeddings",
    "logits_all": "log-probabilities are not served on this API",
    "num_keep": "flare never truncates a prompt: a prompt too long is refused",
    "repeat_last_n": "repetition_penalty applies to the whole context",
    "penalize_newline": "repetition_penalty applies to every token alike",
    "typical_p": "flare has no typical sampling",
    "tfs_z": "flare has no tail-free sampling (Ollama dropped it too)",
    "mirostat": "flare has no mirostat sampling",
    "mirostat_tau": "flare has no mirostat sampling",
    "mirostat_eta": "flare has no mirostat sampling",
}
# num_predict's values that mean "no limit" in Ollama (-1: until the end, -2: fill the context):
# the package policy's default max_tokens then applies.
UNLIMITED_PREDICT = (-1, -2)

_COMMON = frozenset({"model", "stream", "options", "format", "keep_alive", "think", "logprobs", "top_logprobs"})
_CHAT_FIELDS = _COMMON | {"messages", "tools"}
_GENERATE_FIELDS = _COMMON | {"prompt", "suffix", "system", "template", "context", "raw", "images"}
_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class OllamaRequest:
    """A parsed request, and the name its answer echoes (as the client sent it)."""

    generation: Generation
    requested_model: str


def served_name(requested: str, names: tuple[str, ...]) -> str:
    """The served name an Ollama client means: `smollm2:latest` is `smollm2` where that is
    served (Ollama's clients add the default tag), otherwise the name as sent."""
    if requested not in names and requested.endswith(":latest") and requested[: -len(":latest")] in names:
        return requested[: -len(":latest")]
    return requested


def parse_ollama_chat(body: Mapping[str, Any], names: tuple[str, ...]) -> OllamaRequest:
    check_fields(body, _CHAT_FIELDS)
    requested = model_field(body)
    _common(body)
    messages = _messages(body.get("messages"))
    tools = parse_tools({"tools": body.get("tools")})
    constraint = _format(body.get("format"))
    if tools is not None and constraint is not None:
        raise bad_request(
            "tools and format cannot be combined: the answer is either text, calls, or the format; leave one out",
            param="tools",
        )
    generation = Generation(
        served_name(requested, names), ChatPrompt(messages, tools), _options(body.get("options")),
        _stream(body), constraint=constraint,
    )
    return OllamaRequest(generation, requested)


def parse_ollama_generate(body: Mapping[str, Any], names: tuple[str, ...]) -> OllamaRequest | None:
    """The generation, or None for a request with no prompt: Ollama answers that by loading the
    model (done_reason "load"), which here is always loaded."""
    check_fields(body, _GENERATE_FIELDS)
    requested = model_field(body)
    _common(body)
    if body.get("template") not in (None, ""):
        raise bad_request(
            "template: this server renders prompts with its package's own chat template; leave template out, "
            "or send raw: true with the prompt already formatted",
            param="template",
        )
    if body.get("context") not in (None, []):
        raise bad_request(
            "context (the token context of an earlier answer, deprecated in Ollama) is not supported; "
            "send the conversation to /api/chat",
            param="context",
        )
    if body.get("suffix") not in (None, ""):
        raise bad_request("suffix (insertion) is not supported; leave suffix out", param="suffix")
    _no_images(body.get("images"), "images")
    prompt = _string(body, "prompt")
    system = _string(body, "system")
    raw = body.get("raw")
    if raw is not None and not isinstance(raw, bool):
        raise bad_request(f"raw must be true or false, got {kind(raw)}", param="raw")
    options = _options(body.get("options"))
    if not prompt:
        return None
    if raw:
        text_prompt: ChatPrompt | TextPrompts = TextPrompts((prompt,))
    else:
        turns = ({"role": "system", "content": system},) if system else ()
        text_prompt = ChatPrompt((*turns, {"role": "user", "content": prompt}), param="prompt")
    generation = Generation(
        served_name(requested, names), text_prompt, options, _stream(body), constraint=_format(body.get("format"))
    )
    return OllamaRequest(generation, requested)


def _common(body: Mapping[str, Any]) -> None:
    """What both endpoints accept and check: keep_alive (the model stays loaded whatever it
    says), think (this model does not think) and logprobs (not served on this API)."""
    keep_alive = body.get("keep_alive")
    if keep_alive is not None and (isinstance(keep_alive, bool) or not isinstance(keep_alive, (int, float, str))):
        raise bad_request(f'keep_alive must be a duration such as "5m" or a number of seconds, got {kind(keep_alive)}', param="keep_alive")
    if body.get("think") not in (None, False):
        raise bad_request("think: this model does not think; leave think out or send false", param="think")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") not in (None, 0):
        raise bad_request(
            "logprobs are not served on the Ollama API; use /v1/chat/completions with logprobs: true", param="logprobs"
        )


def _stream(body: Mapping[str, Any]) -> bool:
    """Ollama streams unless told not to."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request(f"stream must be true or false, got {kind(stream)}", param="stream")
    return stream is not False


def _string(body: Mapping[str, Any], field: str) -> str:
    value = body.get(field)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise bad_request(f"{field} must be a string, got {kind(value)}", param=field)
    return value


def _no_images(value: Any, where: str) -> None:
    if value not in (None, []):
        raise bad_request(f"{where}: this model reads text only; leave images out", param=where)


def _options(options: Any) -> Mapping[str, Any]:
    """`options` as the sampling fields (validated; the policy clamps them in prepare), the
    ignored ones dropped."""
    if options is None:
        return sampling_fields({})
    if not isinstance(options, dict):
        raise bad_request(f"options must be an object, got {kind(options)}", param="options")
    fields: dict[str, Any] = {}
    for name, value in options.items():
        field = SAMPLING_OPTIONS.get(name)
        if field is None or value is None:
            continue  # IGNORED_OPTIONS, or a name Ollama would ignore too
        if name == "num_predict" and value in UNLIMITED_PREDICT and not isinstance(value, bool):
            continue
        if name == "stop" and isinstance(value, str):
            value = [value]
        fields[field] = value
    renamed = {field: f"options.{name}" for name, field in SAMPLING_OPTIONS.items()}
    return sampling_fields(fields, renamed)


def _format(value: Any) -> GrammarSpec | None:
    """Ollama's `format`: "json" (any JSON object) or a JSON schema the answer is held to."""
    if value is None or value == "":
        return None
    if value == "json":
        return GrammarSpec.json_schema({"type": "object"}, "format")
    if isinstance(value, dict):
        return GrammarSpec.json_schema(value, "format")
    raise bad_request(f'format must be "json" or a JSON schema object, got {kind(value)}', param="format")


def _messages(messages: Any) -> tuple[Mapping[str, Any], ...]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages is required: a non-empty list of {role, content} objects", param="messages")
    parsed: list[Mapping[str, Any]] = []
    calls: list[str] = []  # the ids of the calls of the last assistant turn not yet answered
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object with role and content, got {kind(message)}", param=where)
        role = message.get("role")
        if role not in _ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}", param=f"{where}.role")
        _no_images(message.get("images"), f"{where}.images")
        content = message.get("content")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise bad_request(f"{where}.content must be a string, got {kind(content)}", param=f"{where}.content")
        if role == "tool":
            if not calls:
                raise bad_request(
                    f"{where}: a tool message answers a tool call of the assistant message before it, and none is "
                    "left unanswered",
                    param=where,
                )
            parsed.append({"role": "tool", "content": content, "tool_call_id": calls.pop(0)})
            continue
        tool_calls = message.get("tool_calls")
        if tool_calls:
            if role != "assistant":
                raise bad_request(f"{where}: only assistant messages carry tool_calls", param=f"{where}.tool_calls")
            converted = _tool_calls(index, tool_calls)
            calls = [call["id"] for call in converted]
            parsed.append({"role": "assistant", "content": content, "tool_calls": converted})
            continue
        calls = []
        parsed.append({"role": role, "content": content})
    check_tool_results(parsed)
    return tuple(parsed)


def _tool_calls(index: int, calls: Any) -> list[dict[str, Any]]:
    """Ollama's calls ({"function": {"name", "arguments": {...}}}) as chat's, with made ids."""
    where = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise bad_request(f"{where} must be a list of tool calls", param=where)
    converted = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise bad_request(f'{at} must be {{"function": {{"name", "arguments"}}}}', param=at)
        arguments = function.get("arguments") or {}
        if not isinstance(arguments, dict):
            raise bad_request(f"{at}.function.arguments must be an object, got {kind(arguments)}", param=f"{at}.function.arguments")
        converted.append(
            {
                "id": f"call_{index}_{j}",
                "type": "function",
                "function": {"name": function["name"], "arguments": json.dumps(arguments)},
            }
        )
    return converted
