"""The package sampling policy: defaults, clamping, unfiltered(), JSON."""

from __future__ import annotations

from typing import Any

import pytest

from flare.policy.params import SamplingParams
from flare.policy.policy import Adjustment, PolicyError, SamplingPolicy

DEFAULTS: dict[str, Any] = {
    "temperature": 0.2, "top_k": -1, "top_p": 0.9, "min_p": 0.0, "repetition_penalty": 1.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "max_tokens": 256,
}
RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0), "top_k": (-1, 200), "top_p": (0.05, 1.0), "min_p": (0.0, 0.5),
    "repetition_penalty": (1.0, 1.5), "presence_penalty": (-1.0, 1.0), "frequency_penalty": (-1.5, 1.5),
    "max_tokens": (1, 2048),
}
POLICY = SamplingPolicy(DEFAULTS, RANGES)


def test_absent_parameters_take_the_defaults() -> None:
    result = POLICY.clamp({})
    assert result.adjusted == ()
    assert result.params == SamplingParams(
        temperature=0.2, top_k=-1, top_p=0.9, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
        frequency_penalty=0.0, seed=None, max_tokens=256, stop=(),
    )


@pytest.mark.parametrize("param", [p for p in RANGES if p != "top_k"])
def test_values_at_each_bound_are_kept(param: str) -> None:
    lo, hi = RANGES[param]
    for value in (lo, hi):
        result = POLICY.clamp({param: value})
        assert getattr(result.params, param) == value
        assert result.adjusted == ()


BEYOND = {
    "temperature": (None, 2.5),
    "top_p": (0.01, None),
    "min_p": (None, 0.9),
    "repetition_penalty": (0.5, 2.0),
    "presence_penalty": (-1.5, 1.5),
    "frequency_penalty": (-2.0, 2.0),
    "max_tokens": (None, 5000),
}


@pytest.mark.parametrize("param", list(BEYOND))
def test_values_beyond_each_bound_are_clamped_and_reported(param: str) -> None:
    lo, hi = RANGES[param]
    below, above = BEYOND[param]
    if below is not None:
        result = POLICY.clamp({param: below})
        assert getattr(result.params, param) == lo
        assert result.adjusted == (Adjustment(param, below, lo, f"{param} is at least {lo} in this package"),)
    if above is not None:
        result = POLICY.clamp({param: above})
        assert getattr(result.params, param) == hi
        assert result.adjusted == (Adjustment(param, above, hi, f"{param} is at most {hi} in this package"),)


def test_parameter_without_range_is_clamped_to_its_default() -> None:
    policy = SamplingPolicy(DEFAULTS, {"temperature": (0.0, 2.0)})
    result = policy.clamp({"top_p": 0.5, "temperature": 0.7, "repetition_penalty": 1.2})
    assert result.params.top_p == 0.9
    assert result.params.temperature == 0.7
    assert result.params.repetition_penalty == 1.0
    assert [(a.param, a.requested, a.applied, a.reason) for a in result.adjusted] == [
        ("top_p", 0.5, 0.9, "this package fixes top_p at 0.9"),
        ("repetition_penalty", 1.2, 1.0, "this package fixes repetition_penalty at 1.0"),
    ]


def test_requesting_the_default_of_a_fixed_parameter_is_no_adjustment() -> None:
    policy = SamplingPolicy(DEFAULTS, {})
    assert policy.clamp({"top_p": 0.9, "max_tokens": 256}).adjusted == ()


def test_top_k_zero_and_minus_one_both_mean_disabled() -> None:
    for value in (0, -1):
        result = POLICY.clamp({"top_k": value})
        assert result.params.top_k == -1
        assert result.adjusted == ()
    assert SamplingPolicy({**DEFAULTS, "top_k": 0}).defaults["top_k"] == -1
    # With no top_k range, 0 is the default (disabled) and not an adjustment.
    assert SamplingPolicy(DEFAULTS, {}).clamp({"top_k": 0}).adjusted == ()


def test_top_k_bounds() -> None:
    assert POLICY.clamp({"top_k": 1}).params.top_k == 1
    assert POLICY.clamp({"top_k": 200}).params.top_k == 200
    result = POLICY.clamp({"top_k": 201})
    assert result.params.top_k == 200
    assert result.adjusted[0].reason == "top_k is at most 200 in this package"


def test_top_k_range_that_requires_filtering_turns_disabled_into_its_upper_bound() -> None:
    policy = SamplingPolicy({**DEFAULTS, "top_k": 20}, {"top_k": (5, 50)})
    result = policy.clamp({"top_k": -1})
    assert result.params.top_k == 50
    assert "requires top-k filtering" in result.adjusted[0].reason
    assert policy.clamp({"top_k": 2}).params.top_k == 5


def test_top_k_range_of_only_disabled_refuses_filtering() -> None:
    policy = SamplingPolicy(DEFAULTS, {"top_k": (-1, 0)})
    assert policy.ranges["top_k"] == (-1, -1)
    result = policy.clamp({"top_k": 10})
    assert result.params.top_k == -1
    assert result.adjusted == (Adjustment("top_k", 10, -1, "this package does not allow top-k filtering"),)


def test_context_limit_caps_max_tokens() -> None:
    result = POLICY.clamp({"max_tokens": 5000}, max_tokens_limit=100)
    assert result.params.max_tokens == 100
    assert result.adjusted == (
        Adjustment("max_tokens", 5000, 100, "only 100 tokens of the context are left after the prompt"),
    )
    # A default that does not fit is capped too, but the client asked for nothing: no adjustment.
    result = POLICY.clamp({}, max_tokens_limit=10)
    assert result.params.max_tokens == 10 and result.adjusted == ()
    assert POLICY.clamp({"max_tokens": 50}, max_tokens_limit=100).adjusted == ()


def test_no_context_left_is_a_policy_error() -> None:
    with pytest.raises(PolicyError, match="no tokens of context are left"):
        POLICY.clamp({}, max_tokens_limit=0)


def test_seed_and_stop_pass_through_unclamped() -> None:
    params = POLICY.clamp({"seed": 42, "stop": ("###",)}).params
    assert params.seed == 42 and params.stop == ("###",)


def test_unknown_request_parameter_is_refused() -> None:
    with pytest.raises(PolicyError, match="not sampling parameters: logprobs"):
        POLICY.clamp({"logprobs": True})


def test_unfiltered_drops_filter_ranges_and_keeps_the_others() -> None:
    policy = SamplingPolicy({**DEFAULTS, "top_p": 1.0}, RANGES)
    unfiltered = policy.unfiltered()
    assert set(unfiltered.ranges) == set(RANGES) - {"top_k", "top_p", "min_p"}
    assert unfiltered.ranges["repetition_penalty"] == (1.0, 1.5)
    assert unfiltered.defaults == policy.defaults
    assert unfiltered.filter_problems() == []
    result = unfiltered.clamp({"top_p": 0.95, "top_k": 40, "min_p": 0.1, "temperature": 0.8})
    assert (result.params.top_p, result.params.top_k, result.params.min_p) == (1.0, -1, 0.0)
    assert result.params.temperature == 0.8
    assert not result.params.filtered
    assert [a.param for a in result.adjusted] == ["top_k", "top_p", "min_p"]


@pytest.mark.parametrize("top_k", [-1, 0])
def test_unfiltered_accepts_both_disabled_top_k_defaults(top_k: int) -> None:
    policy = SamplingPolicy({**DEFAULTS, "top_p": 1.0, "top_k": top_k}, RANGES)
    assert policy.unfiltered().defaults["top_k"] == -1


@pytest.mark.parametrize(("param", "value"), [("top_k", 40), ("top_p", 0.95), ("min_p", 0.05)])
def test_unfiltered_rejects_a_filter_enabling_default(param: str, value: float) -> None:
    policy = SamplingPolicy({**DEFAULTS, "top_p": 1.0, param: value}, {})
    with pytest.raises(PolicyError, match=f"default {param}={value} enables a filter"):
        policy.unfiltered()


def test_filter_problems_name_defaults_and_ranges() -> None:
    assert POLICY.filter_problems() == [
        "the range of top_k [-1, 200] allows a filter",
        "the default top_p=0.9 enables a filter",
        "the range of top_p [0.05, 1.0] allows a filter",
        "the range of min_p [0.0, 0.5] allows a filter",
    ]
    harmless = SamplingPolicy({**DEFAULTS, "top_p": 1.0}, {"top_k": (-1, 0), "top_p": (1.0, 1.0), "min_p": (0.0, 0.0)})
    assert harmless.filter_problems() == []


def test_json_round_trip() -> None:
    data = POLICY.to_json()
    assert data["ranges"]["top_p"] == [0.05, 1.0]
    assert SamplingPolicy.from_json(data) == POLICY


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"defaults": DEFAULTS}, "missing key.*ranges"),
        ({"defaults": DEFAULTS, "ranges": {}, "x": 1}, "unknown key.*x"),
        ({"defaults": {**DEFAULTS, "mirostat": 1}, "ranges": {}}, "unknown sampling parameter.*mirostat"),
        ({"defaults": {k: v for k, v in DEFAULTS.items() if k != "min_p"}, "ranges": {}}, "no default for min_p"),
        ({"defaults": DEFAULTS, "ranges": {"top_p": [0.5]}}, r"range of top_p must be a pair"),
        ({"defaults": DEFAULTS, "ranges": {"temperature": [1.0, 0.5]}}, "range of temperature is empty"),
        ({"defaults": DEFAULTS, "ranges": {"temperature": [0.5, 1.0]}}, r"default temperature=0.2 lies outside its range \[0.5, 1.0\]"),
        ({"defaults": {**DEFAULTS, "top_p": 0}, "ranges": {}}, r"policy default of top_p: top_p must be in \(0, 1\]"),
        ({"defaults": {**DEFAULTS, "max_tokens": 1.5}, "ranges": {}}, "max_tokens must be an integer"),
        ({"defaults": DEFAULTS, "ranges": {"top_k": [-1, 2.5]}}, "range upper bound of top_k"),
        ([], "must be an object"),
    ],
)
def test_invalid_policy_is_refused_naming_the_parameter(data: Any, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        SamplingPolicy.from_json(data)


def test_disabled_top_k_default_outside_a_filtering_range_is_refused() -> None:
    with pytest.raises(PolicyError, match=r"default top_k=-1 lies outside its range \[5, 50\]"):
        SamplingPolicy(DEFAULTS, {"top_k": (5, 50)})
