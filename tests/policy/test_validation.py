"""Raw validation of request sampling fields: type and range, naming the field."""

from __future__ import annotations

import math
from typing import Any

import pytest

from flare.policy.validation import InvalidParameter, validate_request_sampling


def test_only_present_fields_are_returned_and_null_is_absent() -> None:
    body = {"model": "m", "messages": [], "temperature": 0.7, "top_p": None, "top_k": 40, "seed": 7}
    assert validate_request_sampling(body) == {"temperature": 0.7, "top_k": 40, "seed": 7}
    assert validate_request_sampling({}) == {}


def test_valid_edge_values_pass() -> None:
    body = {
        "temperature": 0, "top_k": -1, "top_p": 1, "min_p": 1, "repetition_penalty": 1e-3,
        "presence_penalty": -2, "frequency_penalty": 2, "max_tokens": 1, "seed": -(2**63),
        "stop": ["a", "b", "c", "d"],
    }
    assert validate_request_sampling(body) == {
        "temperature": 0.0, "top_k": -1, "top_p": 1.0, "min_p": 1.0, "repetition_penalty": 1e-3,
        "presence_penalty": -2.0, "frequency_penalty": 2.0, "max_tokens": 1, "seed": -(2**63),
        "stop": ("a", "b", "c", "d"),
    }
    assert validate_request_sampling({"top_k": 0, "min_p": 0, "top_p": 1e-9})["top_k"] == 0


def test_integral_float_is_an_integer_for_top_k_and_max_tokens() -> None:
    assert validate_request_sampling({"top_k": 40.0, "max_tokens": 16.0}) == {"top_k": 40, "max_tokens": 16}


def test_stop_string_becomes_a_one_element_tuple() -> None:
    assert validate_request_sampling({"stop": "\n\n"}) == {"stop": ("\n\n",)}


@pytest.mark.parametrize(
    ("param", "value", "message"),
    [
        ("temperature", True, "temperature must be a number, got a boolean"),
        ("temperature", "0.5", "temperature must be a number, got a string"),
        ("temperature", math.nan, "temperature must be a finite number"),
        ("temperature", math.inf, "temperature must be a finite number"),
        ("temperature", 10**400, "temperature must be a finite number"),
        ("temperature", -0.1, "temperature must be >= 0"),
        ("top_p", 0, r"top_p must be in \(0, 1\]"),
        ("top_p", 1.01, r"top_p must be in \(0, 1\]"),
        ("top_p", -math.inf, "top_p must be a finite number"),
        ("top_k", -2, "top_k must be -1 or 0"),
        ("top_k", 2.5, "top_k must be an integer, got 2.5"),
        ("top_k", False, "top_k must be an integer, got a boolean"),
        ("top_k", math.nan, "top_k must be an integer"),
        ("min_p", -0.01, r"min_p must be in \[0, 1\]"),
        ("min_p", 1.5, r"min_p must be in \[0, 1\]"),
        ("repetition_penalty", 0, "repetition_penalty must be > 0"),
        ("repetition_penalty", -1, "repetition_penalty must be > 0"),
        ("presence_penalty", 2.01, r"presence_penalty must be in \[-2, 2\]"),
        ("frequency_penalty", -2.5, r"frequency_penalty must be in \[-2, 2\]"),
        ("frequency_penalty", [1], "frequency_penalty must be a number, got a list"),
        ("max_tokens", 0, "max_tokens must be at least 1"),
        ("max_tokens", True, "max_tokens must be an integer, got a boolean"),
        ("max_completion_tokens", -5, "max_completion_tokens must be at least 1"),
        ("seed", 1.0, "seed must be an integer"),
        ("seed", True, "seed must be an integer, got a boolean"),
        ("seed", 2**64, "seed must fit in a signed 64-bit integer"),
        ("stop", 5, "stop must be a string or a list of strings"),
        ("stop", ["a", 1], "stop must be a string or a list of strings"),
        ("stop", {"a": 1}, "stop must be a string or a list of strings, got an object"),
        ("stop", ["a", "b", "c", "d", "e"], "stop takes at most 4 sequences, got 5"),
        ("stop", [""], "stop sequences must not be empty"),
        ("stop", "", "stop sequences must not be empty"),
    ],
)
def test_invalid_value_is_refused_naming_the_field(param: str, value: Any, message: str) -> None:
    with pytest.raises(InvalidParameter, match=message) as error:
        validate_request_sampling({param: value})
    assert error.value.param == param
    assert isinstance(error.value, ValueError)


def test_max_completion_tokens_is_max_tokens() -> None:
    assert validate_request_sampling({"max_completion_tokens": 12}) == {"max_tokens": 12}
    assert validate_request_sampling({"max_completion_tokens": 12, "max_tokens": 12}) == {"max_tokens": 12}


def test_max_tokens_and_max_completion_tokens_must_agree() -> None:
    with pytest.raises(InvalidParameter, match=r"different values \(12 and 13\)") as error:
        validate_request_sampling({"max_tokens": 12, "max_completion_tokens": 13})
    assert error.value.param == "max_completion_tokens"
