"""The request fields every API shares, checked the same way wherever they arrive: unknown
fields refused by name, `model`, the sampling fields (with the name the API gives each), and
OpenAI's `response_format` (chat completions and Responses). Each check raises a 400 naming the
field."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flare.api.errors import ApiError, bad_request
from flare.api.generation import ThinkingSwitch
from flare.policy.validation import InvalidParameter, validate_request_sampling
from flare.structured.spec import GrammarSpec
from flare.structured.strict import StrictError, close_objects


def check_fields(body: Mapping[str, Any], known: frozenset[str]) -> None:
    for key in body:
        if key not in known:
            raise bad_request(f"unrecognized request field {key!r}", param=key, code="unknown_parameter")


# A label a client sends for the operator (safety_identifier) or as a cache hint
# (prompt_cache_key): longer than this is no label, and would bloat every log line.
MAX_LABEL_CHARS = 1024


def label_field(body: Mapping[str, Any], field: str) -> str | None:
    """A label field: a non-empty string of at most MAX_LABEL_CHARS characters, or None when it
    is absent or null; a 400 naming the field otherwise."""
    value = body.get(field)
    if value is None:
        return None
    if not isinstance(value, str):
        raise bad_request(f"{field} must be a string, got {kind(value)}", param=field, code="invalid_type")
    if not value or len(value) > MAX_LABEL_CHARS:
        raise bad_request(
            f"{field} must be 1 to {MAX_LABEL_CHARS} characters long, got {len(value)}", param=field, code="invalid_value"
        )
    return value


# OpenAI's bounds on metadata: at most 16 pairs, keys of at most 64 characters, string values of
# at most 512; every API that accepts metadata holds it to them, though flare keeps none of it.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


def metadata_field(body: Mapping[str, Any]) -> None:
    """`metadata`, when sent: an object of at most MAX_METADATA_PAIRS string pairs within
    their lengths (ignored once checked); a 400 naming the field otherwise."""
    metadata = body.get("metadata")
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise bad_request(f"metadata must be an object of string keys and values, got {kind(metadata)}", param="metadata")
    if len(metadata) > MAX_METADATA_PAIRS:
        raise bad_request(
            f"metadata has {len(metadata)} pairs; at most {MAX_METADATA_PAIRS} are allowed", param="metadata"
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise bad_request(
                f"metadata keys must be at most {MAX_METADATA_KEY_CHARS} characters; one has {len(key)}",
                param="metadata",
            )
        if value is None:
            continue  # Anthropic's user_id may be null
        if not isinstance(value, str):
            raise bad_request(f"metadata[{key!r}] must be a string, got {kind(value)}", param=f"metadata.{key}")
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise bad_request(
                f"metadata[{key!r}] must be at most {MAX_METADATA_VALUE_CHARS} characters, got {len(value)}",
                param=f"metadata.{key}",
            )


def model_field(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        raise bad_request("model is required; GET /v1/models lists the served model", param="model")
    if not isinstance(model, str) or not model:
        raise bad_request(f"model must be a non-empty string, got {kind(model)}", param="model")
    return model


@dataclass(frozen=True)
class ServedNames:
    """The names the one served model answers to (`--served-model-name`, several as vLLM takes
    them; the first is the one logs and the control socket use), and whether any other name is
    answered too (`--accept-any-model-name`, for tools that send "gpt-4o" or their own alias)."""

    names: tuple[str, ...]
    accept_any: bool = False

    @property
    def primary(self) -> str:
        return self.names[0]


def check_model(requested: str, served: ServedNames) -> bool:
    """Whether `requested` is answered by being mapped to the served model (a name not among
    its names, under accept_any); 404 model_not_found for such a name otherwise."""
    if requested in served.names:
        return False
    if served.accept_any:
        return True
    listed = ", ".join(repr(name) for name in served.names)
    raise ApiError(
        404,
        f"the model {requested!r} does not exist here; this server serves {listed}",
        param="model",
        code="model_not_found",
    )


_SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def response_format(value: Any) -> GrammarSpec | None:
    """OpenAI's response_format: text (no constraint), json_object, or json_schema."""
    where = "response_format"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request(f"{where} must be an object with a type, got {kind(value)}", param=where)
    format_type = value.get("type")
    if format_type == "text":
        no_other_keys(value, {"type"}, where)
        return None
    if format_type == "json_object":
        no_other_keys(value, {"type"}, where)
        return GrammarSpec.json_schema({"type": "object"}, where)
    if format_type != "json_schema":
        raise bad_request(
            f"{where}.type must be 'text', 'json_object' or 'json_schema', got {format_type!r}", param=f"{where}.type"
        )
    no_other_keys(value, {"type", "json_schema"}, where)
    spec = value.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise bad_request(f"{where} must be an object with name and schema, got {kind(spec)}", param=where)
    no_other_keys(spec, {"name", "schema", "strict", "description"}, where)
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.match(name):
        raise bad_request(
            f"{where}.name must be 1 to 64 letters, digits, underscores or dashes, got {name!r}", param=f"{where}.name"
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"{where}.strict must be true or false, got {kind(strict)}", param=f"{where}.strict")
    description = spec.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{where}.description must be a string", param=f"{where}.description")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise bad_request(f"{where}.schema must be a JSON schema object, got {kind(schema)}", param=f"{where}.schema")
    # strict or not, the answer is held to the schema: a grammar is never "best effort"; strict
    # also closes every object, as OpenAI means it (structured/strict.py).
    if not strict:
        return GrammarSpec.json_schema(schema, f"{where}.schema")
    try:
        closed_schema, closed = close_objects(schema)
    except StrictError as error:
        raise bad_request(f"{where}.schema: {error}", param=f"{where}.schema") from None
    return GrammarSpec.json_schema(closed_schema, f"{where}.schema", closed)


def no_other_keys(value: Mapping[str, Any], known: set[str], where: str) -> None:
    for key in value:
        if key not in known:
            raise bad_request(f"{where} has an unrecognized field {key!r}", param=f"{where}.{key}")


def sampling_fields(body: Mapping[str, Any], renamed: Mapping[str, str] | None = None) -> Mapping[str, Any]:
    """The sampling fields, checked; `renamed` maps a field to the name another API gives it
    (the Responses API's max_output_tokens is max_tokens here), for the error to name."""
    try:
        return validate_request_sampling(body)
    except InvalidParameter as error:
        param = (renamed or {}).get(error.param, error.param)
        raise bad_request(error.message.replace(error.param, param, 1), param=param) from None


def kind(value: Any) -> str:
    if value is None:
        return "null"
    names = {bool: "a boolean", str: "a string", int: "a number", float: "a number", list: "a list", dict: "an object"}
    return next((name for kind, name in names.items() if isinstance(value, kind)), type(value).__name__)


# OpenAI's reasoning efforts; flare's reasoning has no budget, so every one but "none" is on.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def effort_switch(value: Any, param: str) -> ThinkingSwitch | None:
    """OpenAI's reasoning effort as a switch: "none" is off, any other effort on."""
    if value is None:
        return None
    if value not in REASONING_EFFORTS:
        raise bad_request(f"{param} must be one of {', '.join(REASONING_EFFORTS)}, got {value!r}", param=param)
    return ThinkingSwitch(value != "none", param, value)


def template_switch(value: Any) -> ThinkingSwitch | None:
    """vLLM's `chat_template_kwargs`: flare's templates take `enable_thinking` from requests."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request(f"chat_template_kwargs must be an object, got {kind(value)}", param="chat_template_kwargs")
    no_other_keys(value, {"enable_thinking"}, "chat_template_kwargs")
    enabled = value.get("enable_thinking")
    if enabled is None:
        return None
    if not isinstance(enabled, bool):
        param = "chat_template_kwargs.enable_thinking"
        raise bad_request(f"{param} must be true or false, got {kind(enabled)}", param=param)
    return ThinkingSwitch(enabled, "chat_template_kwargs.enable_thinking")
