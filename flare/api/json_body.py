"""The request body as a JSON object: strict UTF-8 JSON, no duplicate keys, no NaN, no lone
surrogates; a 400 saying what is wrong otherwise. Every API's body and the control socket's are
read here."""

from __future__ import annotations

import json
import re
from typing import Any

from flare.api.errors import bad_request
from flare.api.fields import kind


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 saying what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise bad_request(f"the request body is not valid UTF-8 (byte {error.start})", param=None) from None
    if not text.strip():
        raise bad_request("the request body is empty; send a JSON object", param=None)
    try:
        body = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_object_without_duplicates)
    except DuplicateKey as error:
        raise bad_request(
            f"the request body names {error.key!r} twice in one object; send each field once", param=error.key
        ) from None
    except ValueError as error:
        raise bad_request(f"the request body is not valid JSON: {error}", param=None) from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply", param=None) from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {kind(body)}", param=None)
    if _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(body):
        raise bad_request(
            "the request body has an unpaired UTF-16 surrogate escape (such as \\ud800), which is not text; "
            "escape characters beyond U+FFFF as a surrogate pair or send them as UTF-8",
            param=None,
        )
    return body


class DuplicateKey(ValueError):
    """An object names a key twice: readers disagree on which value counts (Python's json takes
    the last, many proxies and validators the first), so the body is refused."""

    def __init__(self, key: str) -> None:
        super().__init__(f"duplicate key {key!r}")
        self.key = key


def _object_without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    body = dict(pairs)
    if len(body) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKey(key)
            seen.add(key)
    return body


# JSON may escape a lone UTF-16 surrogate; Python's json decodes it into a str that no tokenizer
# (nor UTF-8) accepts, so it must be refused here rather than fail deep in the request's path.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _has_lone_surrogate(body: dict[str, Any]) -> bool:
    # Walked with a stack, not recursion: json.loads accepts nesting deeper than a recursive
    # walk of it may go.
    pending: list[Any] = [body]
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            pending.extend(value.keys())
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return True
    return False


def _reject_constant(name: str) -> Any:
    # Python's json accepts NaN and Infinity, which are not JSON.
    raise ValueError(f"{name} is not a JSON value")
