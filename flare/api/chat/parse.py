"""The parser of `POST /v1/chat/completions` and `POST /v1/completions`: a body into a
`Generation`, checked before anything touches the model.

What is accepted: the fields of OpenAI's chat completions and (legacy) completions requests
that a text-only server can honour, plus the sampling extensions top_k, min_p and
repetition_penalty (as vLLM accepts them), `n` choices (`best_of` equal to `n`), `logit_bias`,
`logprobs`/`top_logprobs` (chat) and `logprobs`/`echo` (completions), `response_format` (chat)
and flare's `structured_outputs` extension (both), and tools (chat: `tools`, `tool_choice`,
`parallel_tool_calls`, tool messages; api/tools/). Fields that ask for something flare does
not do (the deprecated functions API, picking the best of more choices than are returned, audio,
predicted outputs, reasoning, web search, moderation) get a 400 naming the field and why. Fields
that change nothing about the answer are accepted and ignored: `user`, `metadata` (within
OpenAI's bounds, api/fields.py), `store`, `service_tier`, `verbosity`, the prompt cache's options;
`safety_identifier` and `prompt_cache_key` are logged with the request. vLLM's
`continue_final_message` continues a final assistant message instead of answering after it. Any
other field is rejected as unrecognized, as OpenAI does, so a misspelt parameter never silently
does nothing. docs/api.md, "Every request field", holds the table of every field of OpenAI's
request types and what flare does with it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from flare.api.cache_scope import cache_salt
from flare.api.errors import bad_request
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
    template_switch,
)
from flare.api.generation import ChatPrompt, Generation, TextOrTokens, TextPrompts, TokenOptions
from flare.api.tools.parse import check_tool_results, parse_tools
from flare.policy.validation import SAMPLING_FIELDS
from flare.structured.compiler import MAX_CHOICES as MAX_GRAMMAR_CHOICES
from flare.structured.spec import GrammarSpec

CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

_IGNORED = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls"})
# Chat's fields that ask for what a text model without reasoning, tools of its own or a
# moderation service cannot do: refused by name with why (_unsupported_chat_features).
_REFUSED = frozenset({"audio", "web_search_options", "moderation"})
_CHAT_ONLY_IGNORED = frozenset({"verbosity", "prompt_cache_options", "prompt_cache_retention"})
_COMMON = frozenset(
    {
        "model", "stream", "stream_options", "structured_outputs", "logprobs_mode", "cache_salt",
        *SAMPLING_FIELDS, *_IGNORED,
    }
)
_CHAT_FIELDS = _COMMON | _REFUSED | _CHAT_ONLY_IGNORED | {
    "messages", "n", "logprobs", "top_logprobs", "logit_bias", "tools", "tool_choice",
    "functions", "function_call", "response_format", "modalities", "prompt_cache_key", "safety_identifier",
    "continue_final_message", "prediction", "reasoning_effort", "chat_template_kwargs",
}
_COMPLETION_FIELDS = _COMMON | {"prompt", "n", "best_of", "logprobs", "logit_bias", "echo", "suffix"}


# OpenAI's own bound on n; the server's max_concurrency usually bounds it further.
MAX_CHOICES = 128
# Completions' prompts in one request; max_concurrency bounds them (times n) further.
MAX_PROMPTS = 128
# OpenAI's bounds: top_logprobs 0-20 (chat); logit_bias values -100..100, at most 300 entries.
# Completions' logprobs is 0-5 at OpenAI; flare allows the chat bound there too.
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300
LOGIT_BIAS_RANGE = 100.0


def parse_chat_completion(body: Mapping[str, Any]) -> Generation:
    check_fields(body, _CHAT_FIELDS)
    model = model_field(body)
    metadata_field(body)
    _unsupported_chat_features(body)
    messages = chat_messages(body.get("messages"))
    continues = _continue_final_message(body, messages)
    stream, include_usage = _streaming(body)
    tokens = TokenOptions(logprobs=_chat_logprobs(body), logit_bias=_logit_bias(body), raw_logprobs=_raw(body))
    constraint = response_format(body.get("response_format"))
    extension = _structured_outputs(body.get("structured_outputs"))
    if constraint is not None and extension is not None:
        raise bad_request(
            "send either response_format or structured_outputs, not both", param="structured_outputs"
        )
    tools = parse_tools(body)
    if tools is not None and tools.calls_possible and (constraint or extension) is not None:
        raise bad_request(
            "tools and a response constraint cannot be combined: the answer is either text, calls, or the constraint; "
            'send tool_choice "none" or leave the constraint out',
            param="tools",
        )
    return Generation(
        model,
        ChatPrompt(messages, tools, continues=continues),
        sampling_fields(body),
        stream,
        _choices(body),
        tokens,
        constraint or extension,
        include_usage,
        cache_salt(body),
        label_field(body, "safety_identifier"),
        label_field(body, "prompt_cache_key"),
        prediction=_prediction(body.get("prediction")),
        thinking=effort_switch(body.get("reasoning_effort"), "reasoning_effort")
        or template_switch(body.get("chat_template_kwargs")),
    )


def parse_completion(body: Mapping[str, Any]) -> Generation:
    check_fields(body, _COMPLETION_FIELDS)
    model = model_field(body)
    metadata_field(body)
    n = _choices(body)
    _best_of(body, n)
    _only(body, "suffix", (None, ""), "suffix (insertion) is not supported; leave suffix out")
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise bad_request(f"echo must be true or false, got {kind(echo)}", param="echo")
    logprobs = body.get("logprobs")
    if logprobs is not None:
        logprobs = _count("logprobs", logprobs, MAX_TOP_LOGPROBS)
    tokens = TokenOptions(logprobs=logprobs, echo=bool(echo), logit_bias=_logit_bias(body), raw_logprobs=_raw(body))
    stream, include_usage = _streaming(body)
    constraint = _structured_outputs(body.get("structured_outputs"))
    prompts = TextPrompts(_prompts(body.get("prompt")))
    return Generation(model, prompts, sampling_fields(body), stream, n, tokens, constraint, include_usage, cache_salt(body))


def _prediction(value: Any) -> str | None:
    """OpenAI's predicted outputs: {"type": "content", "content": text or [{"type": "text",
    "text": ...}]}, the text the answer is expected to repeat much of; its tokens become drafts
    that speculative decoding verifies, so it changes the speed of an answer, never its text."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request(
            f'prediction must be an object such as {{"type": "content", "content": "..."}}, got {kind(value)}',
            param="prediction",
        )
    no_other_keys(value, {"type", "content"}, "prediction")
    if value.get("type") != "content":
        raise bad_request(f'prediction.type must be "content", got {value.get("type")!r}', param="prediction.type")
    content = value.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        shown = "an empty list" if content == [] else kind(content)
        raise bad_request(
            f'prediction.content must be a string or a list of {{"type": "text", "text": ...}} parts, got {shown}',
            param="prediction.content",
        )
    texts = []
    for k, part in enumerate(content):
        where = f"prediction.content[{k}]"
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f'{where} must be a {{"type": "text", "text": "..."}} part', param="prediction.content")
        no_other_keys(part, {"type", "text"}, where)
        texts.append(part["text"])
    return "".join(texts)


def _continue_final_message(body: Mapping[str, Any], messages: tuple[Mapping[str, Any], ...]) -> str | None:
    """vLLM's `continue_final_message`: true continues the final message, an assistant's
    text (the prompt ends inside it); false or absent answers in a new assistant turn, as
    OpenAI does whatever the final message."""
    field = "continue_final_message"
    value = body.get(field)
    if value is None or value is False:
        return None
    if value is not True:
        raise bad_request(f"{field} must be true or false, got {kind(value)}", param=field)
    final = messages[-1]
    if final["role"] != "assistant" or final.get("tool_calls"):
        raise bad_request(
            f"{field}: the final message must be an assistant message with text content (no tool_calls) to continue",
            param=field,
        )
    return field


def _choices(body: Mapping[str, Any]) -> int:
    n = body.get("n")
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int):
        raise bad_request(f"n must be an integer, got {kind(n)}", param="n")
    if not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"n must be between 1 and {MAX_CHOICES}, got {n}", param="n")
    return n


def _best_of(body: Mapping[str, Any], n: int) -> None:
    best_of = body.get("best_of")
    if best_of is None:
        return
    if isinstance(best_of, bool) or not isinstance(best_of, int):
        raise bad_request(f"best_of must be an integer, got {kind(best_of)}", param="best_of")
    if best_of < n:
        raise bad_request(f"best_of ({best_of}) must be at least n ({n})", param="best_of")
    if best_of > n:
        raise bad_request(
            f"best_of {best_of} > n {n} is not supported; send best_of equal to n (or leave it out) "
            "with logprobs, and pick among the n choices by their log probabilities yourself",
            param="best_of",
        )


def _count(param: str, value: Any, most: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{param} must be an integer between 0 and {most}, got {kind(value)}", param=param)
    if not 0 <= value <= most:
        raise bad_request(f"{param} must be between 0 and {most}, got {value}", param=param)
    return value


def _raw(body: Mapping[str, Any]) -> bool:
    """flare's logprobs_mode: "processed" (default: the distribution sampled from) or "raw"."""
    mode = body.get("logprobs_mode")
    if mode not in (None, "processed", "raw"):
        raise bad_request(f'logprobs_mode must be "processed" or "raw", got {mode!r}', param="logprobs_mode")
    return mode == "raw"


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """Chat's logprobs (true/false) and top_logprobs (0-20, only with logprobs: true, as OpenAI)."""
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise bad_request(f"logprobs must be true or false, got {kind(logprobs)}", param="logprobs")
    top = body.get("top_logprobs")
    if top is not None:
        top = _count("top_logprobs", top, MAX_TOP_LOGPROBS)
        if not logprobs:
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    return (top or 0) if logprobs else None


def _logit_bias(body: Mapping[str, Any]) -> tuple[tuple[int, float], ...]:
    """logit_bias: {"token id": bias}, ids as decimal strings, biases in [-100, 100], at most 300
    entries. Ids are checked against the vocabulary once the model is known (prepare.py)."""
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise bad_request(
            f'logit_bias must be an object of token ids to biases, such as {{"50256": -100}}, got {kind(bias)}',
            param="logit_bias",
        )
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are allowed", param="logit_bias")
    pairs: dict[int, float] = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 12:
            raise bad_request(f"logit_bias keys must be token ids (decimal integers), got {key!r}", param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE:
            shown = kind(value) if isinstance(value, (bool, str, list, dict)) or value is None else value
            raise bad_request(
                f"logit_bias[{key!r}] must be a number between -100 and 100, got {shown}", param="logit_bias"
            )
        if int(key) in pairs:
            raise bad_request(f"logit_bias names token {int(key)} twice", param="logit_bias")
        pairs[int(key)] = float(value)
    return tuple(sorted(pairs.items()))


def _unsupported_chat_features(body: Mapping[str, Any]) -> None:
    _only(body, "functions", (None, []), "functions (the deprecated functions API) are not supported; use tools")
    _only(body, "function_call", (None, "none", "auto"), "function_call is not supported; use tools and tool_choice")
    _modalities(body.get("modalities"))
    _only(body, "audio", (None,), "audio output is not supported: this model answers in text; leave audio out")
    _only(body, "web_search_options", (None,), "web search is not supported: this server has no tools of its own")
    _only(
        body, "moderation", (None,), "moderation is not supported: this server runs no moderation of input or output"
    )


def _modalities(value: Any) -> None:
    """Chat's output modalities: text is what this model answers in; audio is refused."""
    if value is None:
        return
    if not isinstance(value, list) or not all(isinstance(m, str) for m in value):
        raise bad_request(f'modalities must be a list such as ["text"], got {kind(value)}', param="modalities")
    other = [m for m in value if m != "text"]
    if other or not value:
        shown = repr(other[0]) if other else "an empty list"
        raise bad_request(
            f'modalities: this model answers in text only, got {shown}; send ["text"] or leave modalities out',
            param="modalities",
        )


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _structured_outputs(value: Any) -> GrammarSpec | None:
    """flare's extension, named as vLLM's `structured_outputs`: exactly one of json (a JSON
    schema), regex, choice (a list of strings), grammar (Lark) or json_object (true)."""
    where = "structured_outputs"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request(f"{where} must be an object, got {kind(value)}", param=where)
    no_other_keys(value, set(STRUCTURED_KINDS), where)
    given = [key for key in STRUCTURED_KINDS if value.get(key) not in (None, False)]
    if len(given) != 1:
        raise bad_request(
            f"{where} must set exactly one of {', '.join(STRUCTURED_KINDS)}; it sets {len(given)}", param=where
        )
    constraint = given[0]
    item = value[constraint]
    param = f"{where}.{constraint}"
    if constraint == "json_object":
        if item is not True:
            raise bad_request(f"{param} must be true", param=param)
        return GrammarSpec.json_schema({"type": "object"}, param)
    if constraint == "json":
        if isinstance(item, str):
            try:
                item = json.loads(item)
            except ValueError:
                raise bad_request(f"{param} must be a JSON schema (an object, or its JSON text)", param=param) from None
        if not isinstance(item, dict):
            raise bad_request(f"{param} must be a JSON schema object, got {kind(item)}", param=param)
        return GrammarSpec.json_schema(item, param)
    if constraint == "choice":
        if not isinstance(item, list) or not item or not all(isinstance(c, str) and c for c in item):
            raise bad_request(f"{param} must be a non-empty list of non-empty strings", param=param)
        if len(item) > MAX_GRAMMAR_CHOICES:
            raise bad_request(f"{param} has {len(item)} choices; at most {MAX_GRAMMAR_CHOICES} are allowed", param=param)
        return GrammarSpec("choice", json.dumps(item), param)
    if not isinstance(item, str) or not item:
        raise bad_request(f"{param} must be a non-empty string, got {kind(item)}", param=param)
    return GrammarSpec("regex" if constraint == "regex" else "lark", item, param)


def _only(body: Mapping[str, Any], field: str, allowed: tuple[Any, ...], message: str) -> None:
    value = body.get(field)
    # Compared with their types: JSON true must not pass as n: 1, nor 0 as false.
    if not any(type(value) is type(a) and value == a for a in allowed):
        raise bad_request(message, param=field)


def chat_messages(messages: Any) -> tuple[Mapping[str, Any], ...]:
    if messages is None:
        raise bad_request("messages is required: a list of {role, content} objects", param="messages")
    if not isinstance(messages, list):
        raise bad_request(
            f"messages must be a list of {{role, content}} objects, got {kind(messages)}", param="messages"
        )
    if not messages:
        raise bad_request("messages must hold at least one message", param="messages")
    parsed = tuple(_message(i, message) for i, message in enumerate(messages))
    check_tool_results(parsed)
    return parsed


def _message(index: int, message: Any) -> Mapping[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise bad_request(f"{where} must be an object with role and content, got {kind(message)}", param=where)
    role = message.get("role")
    if role == "function" or message.get("function_call"):
        raise bad_request(
            f"{where}: function messages (the deprecated functions API) are not supported; use tools", param=where
        )
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise bad_request(f"{where}.tool_call_id is required on a tool message", param=f"{where}.tool_call_id")
        return {"role": "tool", "content": _content(f"{where}.content", message.get("content", ...)), "tool_call_id": call_id}
    if not isinstance(role, str) or role not in CHAT_ROLES:
        raise bad_request(
            f"{where}.role must be one of {', '.join([*CHAT_ROLES, 'tool'])}, got {role!r}", param=f"{where}.role"
        )
    calls = message.get("tool_calls")
    if calls is not None and calls != []:
        if role != "assistant":
            raise bad_request(f"{where}: only assistant messages carry tool_calls", param=f"{where}.tool_calls")
        content = message.get("content")
        text = "" if content is None else _content(f"{where}.content", content)
        parsed = {"role": "assistant", "content": text, "tool_calls": _tool_calls(f"{where}.tool_calls", calls)}
        return {**parsed, **_thinking(where, message)}
    parsed = {"role": CHAT_ROLES[role], "content": _content(f"{where}.content", message.get("content", ...))}
    return {**parsed, **_thinking(where, message)} if role == "assistant" else parsed


def _thinking(where: str, message: Mapping[str, Any]) -> dict[str, str]:
    """An assistant message's earlier reasoning (`reasoning_content`, flare's and vLLM's field, or
    `reasoning`) as the template's `thinking` (Hugging Face's name, which gpt-oss's template
    renders before a call not yet answered; a template that does not read it leaves it out)."""
    for name in ("reasoning_content", "reasoning"):
        value = message.get(name)
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise bad_request(f"{where}.{name} must be a string, got {kind(value)}", param=f"{where}.{name}")
        return {"thinking": value}
    return {}


def _tool_calls(where: str, calls: Any) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise bad_request(f"{where} must be a list of tool calls", param=where)
    parsed = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(function, dict):
            raise bad_request(f'{at} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}', param=at)
        if not isinstance(call.get("id"), str):
            raise bad_request(f"{at}.id must be a string", param=f"{at}.id")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise bad_request(f"{at}.function.name must be a non-empty string", param=f"{at}.function.name")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            raise bad_request(f"{at}.function.arguments must be a string of JSON", param=f"{at}.function.arguments")
        parsed.append({"id": call["id"], "type": "function", "function": {"name": function["name"], "arguments": arguments}})
    return parsed


def _content(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if content is ... or content is None:
        raise bad_request(f"{where} is required: a string or a list of text parts", param=where)
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text parts, got {kind(content)}", param=where)
    texts = []
    for j, part in enumerate(content):
        part_where = f"{where}[{j}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            part_type = part.get("type") if isinstance(part, dict) else kind(part)
            raise bad_request(
                f'{part_where} must be a text part {{"type": "text", "text": ...}}; '
                f"{part_type!r} parts are not supported by this text-only model",
                param=part_where,
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_request(f"{part_where}.text must be a string, got {kind(text)}", param=f"{part_where}.text")
        texts.append(text)
    return "".join(texts)


def _prompts(prompt: Any) -> tuple[TextOrTokens, ...]:
    """OpenAI's completions prompt: a string, a list of strings, a list of token ids, or a list
    of token-id lists."""
    if isinstance(prompt, str):
        return (prompt,)
    if prompt is None:
        raise bad_request("prompt is required: a string, a list of strings, or token ids", param="prompt")
    if not isinstance(prompt, list) or not prompt:
        raise bad_request(
            f"prompt must be a string, a non-empty list of strings, a list of token ids or a list of token-id lists, "
            f"got {'an empty list' if prompt == [] else kind(prompt)}",
            param="prompt",
        )
    if all(_is_token_id(t) for t in prompt):
        return (tuple(prompt),)
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        negative = next(t for t in prompt if t < 0)
        raise bad_request(f"prompt holds token id {negative}; token ids are integers from 0", param="prompt")
    if len(prompt) > MAX_PROMPTS:
        raise bad_request(f"prompt holds {len(prompt)} prompts; at most {MAX_PROMPTS} are allowed", param="prompt")
    prompts: list[TextOrTokens] = []
    for k, item in enumerate(prompt):
        if isinstance(item, str):
            prompts.append(item)
        elif isinstance(item, list) and item and all(_is_token_id(t) for t in item):
            prompts.append(tuple(item))
        else:
            raise bad_request(
                f"prompt[{k}] must be a string or a non-empty list of token ids (integers from 0), "
                f"got {kind(item)}",
                param="prompt",
            )
    return tuple(prompts)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _streaming(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request(f"stream must be true or false, got {kind(stream)}", param="stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request(f"stream_options must be an object, got {kind(options)}", param="stream_options")
        unknown = sorted(set(options) - {"include_usage", "include_obfuscation"})
        if unknown:
            raise bad_request(f"unrecognized stream option {unknown[0]!r}", param=f"stream_options.{unknown[0]}")
        value = options.get("include_usage")
        if value is not None and not isinstance(value, bool):
            raise bad_request(
                f"stream_options.include_usage must be true or false, got {kind(value)}",
                param="stream_options.include_usage",
            )
        include_usage = bool(value)
    return bool(stream), include_usage


