"""Validation of the raw sampling fields of a request body.

This checks type and raw range only (what no package policy could make valid, such as a NaN
temperature or top_p of 0). Whether a valid value is allowed by the package is the policy's
business (`policy.py`), which clamps rather than rejects.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

SAMPLING_FIELDS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "max_tokens",
    "max_completion_tokens",
    "stop",
)

MAX_STOP_SEQUENCES = 4
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1


class InvalidParameter(ValueError):
    """A request field that no policy can accept; the API answers 400 naming `param`."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def real_number(param: str, value: Any) -> float:
    """A finite JSON number as float; bools are not numbers here (JSON true is not 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParameter(param, f"{param} must be a number, got {_describe(value)}")
    try:
        number = float(value)
    except OverflowError:  # a JSON integer beyond float's range (about 1.8e308)
        raise InvalidParameter(param, f"{param} must be a finite number, got an integer too large for one") from None
    if not math.isfinite(number):
        raise InvalidParameter(param, f"{param} must be a finite number, got {value!r}")
    return number


def integer(param: str, value: Any) -> int:
    """A JSON integer; an integral float such as 40.0 is accepted since JSON does not distinguish."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParameter(param, f"{param} must be an integer, got {_describe(value)}")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise InvalidParameter(param, f"{param} must be an integer, got {value!r}")
    return int(value)


def check_raw_range(param: str, value: float | int) -> None:
    """Raise InvalidParameter when `value` is outside the raw range of `param`.

    Shared with the policy, whose defaults and ranges must lie in the same raw ranges.
    """
    if param == "temperature" and value < 0:
        raise InvalidParameter(param, f"temperature must be >= 0 (0 is greedy), got {value}")
    if param == "top_k" and value < -1:
        raise InvalidParameter(param, f"top_k must be -1 or 0 (disabled) or a positive integer, got {value}")
    if param == "top_p" and not 0 < value <= 1:
        raise InvalidParameter(param, f"top_p must be in (0, 1] (1 disables it), got {value}")
    if param == "min_p" and not 0 <= value <= 1:
        raise InvalidParameter(param, f"min_p must be in [0, 1] (0 disables it), got {value}")
    if param == "repetition_penalty" and value <= 0:
        raise InvalidParameter(param, f"repetition_penalty must be > 0 (1 disables it), got {value}")
    if param in ("presence_penalty", "frequency_penalty") and not -2 <= value <= 2:
        raise InvalidParameter(param, f"{param} must be in [-2, 2], got {value}")
    if param == "max_tokens" and value < 1:
        raise InvalidParameter(param, f"max_tokens must be at least 1, got {value}")


def validate_request_sampling(body: Mapping[str, Any]) -> dict[str, Any]:
    """Pick the sampling fields out of a request body, checked; only those present are returned.

    JSON null counts as absent. `max_completion_tokens` is OpenAI's newer name for
    `max_tokens` and is returned as `max_tokens`; giving both with different values is an error.
    `stop` is returned as a tuple of strings. Raises InvalidParameter naming the field.
    """
    picked: dict[str, Any] = {}
    for param in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = body.get(param)
        if value is not None:
            number = real_number(param, value)
            check_raw_range(param, number)
            picked[param] = number

    top_k = body.get("top_k")
    if top_k is not None:
        picked["top_k"] = integer("top_k", top_k)
        check_raw_range("top_k", picked["top_k"])

    max_tokens = _max_tokens(body)
    if max_tokens is not None:
        picked["max_tokens"] = max_tokens

    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise InvalidParameter("seed", f"seed must be an integer, got {_describe(seed)}")
        if not _INT64_MIN <= seed <= _INT64_MAX:
            raise InvalidParameter("seed", f"seed must fit in a signed 64-bit integer, got {seed}")
        picked["seed"] = seed

    stop = body.get("stop")
    if stop is not None:
        picked["stop"] = _stop(stop)
    return picked


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    values: dict[str, int] = {}
    for param in ("max_tokens", "max_completion_tokens"):
        value = body.get(param)
        if value is not None:
            number = integer(param, value)
            if number < 1:
                raise InvalidParameter(param, f"{param} must be at least 1, got {number}")
            values[param] = number
    if len(set(values.values())) > 1:
        raise InvalidParameter(
            "max_completion_tokens",
            "max_tokens and max_completion_tokens are the same setting and were given different values "
            f"({values['max_tokens']} and {values['max_completion_tokens']}); send only one of them",
        )
    return next(iter(values.values()), None)


def _stop(stop: Any) -> tuple[str, ...]:
    sequences = [stop] if isinstance(stop, str) else stop
    if not isinstance(sequences, list) or not all(isinstance(s, str) for s in sequences):
        raise InvalidParameter("stop", f"stop must be a string or a list of strings, got {_describe(stop)}")
    if len(sequences) > MAX_STOP_SEQUENCES:
        raise InvalidParameter("stop", f"stop takes at most {MAX_STOP_SEQUENCES} sequences, got {len(sequences)}")
    if any(s == "" for s in sequences):
        raise InvalidParameter("stop", "stop sequences must not be empty strings")
    return tuple(sequences)


def _describe(value: Any) -> str:
    names = {bool: "a boolean", str: "a string", list: "a list", dict: "an object", float: "a number"}
    for kind, name in names.items():
        if isinstance(value, kind):
            return f"{name} ({value!r})" if kind is not dict and kind is not list else name
    return type(value).__name__
