"""The package sampling policy: defaults and allowed ranges, and clamping a request to them.

The policy is the only source of sampling defaults and ranges (docs/architecture.md). A request that asks
for a value the package does not allow is not rejected: the value is clamped and the client is
told what was applied and why (`Adjustment`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from flare.policy.params import SamplingParams
from flare.policy.validation import InvalidParameter, check_raw_range, integer, real_number

POLICY_PARAMS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "max_tokens",
)
INTEGER_PARAMS = frozenset({"top_k", "max_tokens"})
FILTER_PARAMS = ("top_k", "top_p", "min_p")
PASS_THROUGH_PARAMS = ("seed", "stop")

Number = int | float


class PolicyError(ValueError):
    """A policy that cannot be built or used as asked; the message names the parameter and the fix."""


@dataclass(frozen=True)
class Adjustment:
    """One requested value the policy changed. `reason` is a short sentence for the client."""

    param: str
    requested: Number
    applied: Number
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"param": self.param, "requested": self.requested, "applied": self.applied, "reason": self.reason}


@dataclass(frozen=True)
class ClampResult:
    params: SamplingParams
    adjusted: tuple[Adjustment, ...]


def filter_enabled(param: str, value: Number) -> bool:
    """True when `value` of a filter parameter truncates the distribution.

    top_k -1 and 0 both mean disabled, top_p 1 and min_p 0 likewise (as in SamplingParams).
    """
    if param == "top_k":
        return value not in (-1, 0)
    if param == "top_p":
        return value < 1
    if param == "min_p":
        return value > 0
    return False


def range_allows_filter(param: str, lo: Number, hi: Number) -> bool:
    """True when a range [lo, hi] of a filter parameter admits a value that enables the filter."""
    if param == "top_k":
        return hi >= 1
    if param == "top_p":
        return lo < 1
    if param == "min_p":
        return hi > 0
    return False


@dataclass(frozen=True)
class SamplingPolicy:
    """Defaults for every policy parameter, and an inclusive [lo, hi] range for some of them.

    A parameter without a range is fixed at its default. top_k 0 is read as -1 (both disable
    top-k), in defaults, ranges' effects and requests alike, so the effective top_k of a request
    with top-k disabled is always -1. For top_k, a range whose lower bound is -1 or 0 allows
    disabling it; a range [lo, hi] with lo >= 1 does not, and a request with top-k disabled
    gets hi, the least restrictive allowed value.
    """

    defaults: Mapping[str, Number]
    ranges: Mapping[str, tuple[Number, Number]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        defaults = {param: self._checked_value(param, value, "default") for param, value in self.defaults.items()}
        unknown = sorted(set(defaults) - set(POLICY_PARAMS))
        if unknown:
            raise PolicyError(
                f"unknown sampling parameter(s) in policy defaults: {', '.join(unknown)}; "
                f"the policy parameters are {', '.join(POLICY_PARAMS)}"
            )
        missing = [param for param in POLICY_PARAMS if param not in defaults]
        if missing:
            raise PolicyError(f"the policy gives no default for {', '.join(missing)}; every parameter needs one")
        ranges: dict[str, tuple[Number, Number]] = {}
        for param, bounds in self.ranges.items():
            if param not in POLICY_PARAMS:
                raise PolicyError(
                    f"unknown sampling parameter {param!r} in policy ranges; "
                    f"the policy parameters are {', '.join(POLICY_PARAMS)}"
                )
            if not isinstance(bounds, (tuple, list)) or len(bounds) != 2:
                raise PolicyError(f"the range of {param} must be a pair [lo, hi], got {bounds!r}")
            lo = self._checked_value(param, bounds[0], "range lower bound")
            hi = self._checked_value(param, bounds[1], "range upper bound")
            if param == "top_k":
                lo, hi = (-1 if lo == 0 else lo), (-1 if hi == 0 else hi)
            if lo > hi:
                raise PolicyError(f"the range of {param} is empty: lower bound {lo} is above upper bound {hi}")
            if not _in_range(param, defaults[param], lo, hi):
                raise PolicyError(
                    f"the default {param}={defaults[param]} lies outside its range [{lo}, {hi}]; "
                    "change the default or widen the range"
                )
            ranges[param] = (lo, hi)
        # Canonical order, read-only views: the policy is shared by every request of a package.
        object.__setattr__(self, "defaults", MappingProxyType({p: defaults[p] for p in POLICY_PARAMS}))
        object.__setattr__(self, "ranges", MappingProxyType({p: ranges[p] for p in POLICY_PARAMS if p in ranges}))

    @staticmethod
    def _checked_value(param: str, value: Any, what: str) -> Number:
        try:
            number: Number = integer(param, value) if param in INTEGER_PARAMS else real_number(param, value)
            check_raw_range(param, number)
        except InvalidParameter as error:
            raise PolicyError(f"policy {what} of {param}: {error.message}") from None
        if param == "top_k" and number == 0:
            return -1
        return number

    def clamp(self, requested: Mapping[str, Any], *, max_tokens_limit: int | None = None) -> ClampResult:
        """The effective parameters of a request, and every requested value that was changed.

        `requested` holds validated raw values (`validate_request_sampling`). `max_tokens_limit`
        is the number of tokens left in the context after the prompt; it caps max_tokens.
        """
        unknown = sorted(set(requested) - set(POLICY_PARAMS) - set(PASS_THROUGH_PARAMS))
        if unknown:
            raise PolicyError(f"not sampling parameters: {', '.join(unknown)}")
        effective: dict[str, Any] = {}
        adjusted: list[Adjustment] = []
        for param in POLICY_PARAMS:
            value = requested.get(param)
            if value is None:
                effective[param] = self.defaults[param]
                continue
            if param == "top_k" and value == 0:
                value = -1
            applied, reason = self._clamp_one(param, value)
            effective[param] = applied
            if applied != value:
                adjusted.append(Adjustment(param, requested[param], applied, reason))
        if max_tokens_limit is not None and effective["max_tokens"] > max_tokens_limit:
            if max_tokens_limit < 1:
                raise PolicyError(f"no tokens of context are left for the completion (limit {max_tokens_limit})")
            effective["max_tokens"] = max_tokens_limit
            if requested.get("max_tokens") is not None:
                # Replaces any policy adjustment of max_tokens: the context is the tighter bound.
                adjusted = [a for a in adjusted if a.param != "max_tokens"]
                reason = f"only {max_tokens_limit} tokens of the context are left after the prompt"
                adjusted.append(Adjustment("max_tokens", requested["max_tokens"], max_tokens_limit, reason))
        seed = requested.get("seed")
        stop = requested.get("stop")
        params = SamplingParams(
            temperature=float(effective["temperature"]),
            top_k=int(effective["top_k"]),
            top_p=float(effective["top_p"]),
            min_p=float(effective["min_p"]),
            repetition_penalty=float(effective["repetition_penalty"]),
            presence_penalty=float(effective["presence_penalty"]),
            frequency_penalty=float(effective["frequency_penalty"]),
            seed=seed,
            max_tokens=int(effective["max_tokens"]),
            stop=tuple(stop) if stop is not None else (),
        )
        return ClampResult(params=params, adjusted=tuple(adjusted))

    def _clamp_one(self, param: str, value: Number) -> tuple[Number, str]:
        if param not in self.ranges:
            default = self.defaults[param]
            return default, f"this package fixes {param} at {default}"
        lo, hi = self.ranges[param]
        if param == "top_k" and value == -1:
            if lo == -1:
                return value, ""
            return hi, f"this package requires top-k filtering; {hi} is the least restrictive top_k it allows"
        if param == "top_k" and lo == -1:
            # Disabling is allowed; the enabled values run from 1 to hi.
            lo = 1
        if value < lo:
            return lo, f"{param} is at least {lo} in this package"
        if value > hi:
            if param == "top_k" and hi == -1:
                return -1, "this package does not allow top-k filtering"
            return hi, f"{param} is at most {hi} in this package"
        return value, ""

    def filter_problems(self) -> list[str]:
        """What in this policy asks for a filtered distribution (empty for an unfiltered policy).

        One line per parameter: an enabled filter default, or a range that allows enabling one.
        """
        problems = []
        for param in FILTER_PARAMS:
            default = self.defaults[param]
            if filter_enabled(param, default):
                problems.append(f"the default {param}={default} enables a filter")
            if param in self.ranges and range_allows_filter(param, *self.ranges[param]):
                lo, hi = self.ranges[param]
                problems.append(f"the range of {param} [{lo}, {hi}] allows a filter")
        return problems

    def unfiltered(self) -> SamplingPolicy:
        """This policy without top-k, top-p and min-p ranges; the other ranges are kept.

        Raises PolicyError when a default enables one of those filters, since requests would
        then be filtered by default, which an unfiltered sampler cannot do.
        """
        enabled = [f"{p}={self.defaults[p]}" for p in FILTER_PARAMS if filter_enabled(p, self.defaults[p])]
        if enabled:
            raise PolicyError(
                f"the policy default {', '.join(enabled)} enables a filter, so it has no unfiltered form; "
                "set it to the disabled value (top_k -1, top_p 1, min_p 0)"
            )
        ranges = {p: r for p, r in self.ranges.items() if p not in FILTER_PARAMS}
        return SamplingPolicy(defaults=dict(self.defaults), ranges=ranges)

    def to_json(self) -> dict[str, Any]:
        return {
            "defaults": dict(self.defaults),
            "ranges": {param: [lo, hi] for param, (lo, hi) in self.ranges.items()},
        }

    @classmethod
    def from_json(cls, data: Any) -> SamplingPolicy:
        if not isinstance(data, Mapping):
            raise PolicyError(
                f"a sampling policy must be an object with defaults and ranges, got {type(data).__name__}"
            )
        keys = set(data)
        if keys != {"defaults", "ranges"}:
            parts = []
            if keys - {"defaults", "ranges"}:
                parts.append(f"unknown key(s) {', '.join(sorted(keys - {'defaults', 'ranges'}))}")
            if {"defaults", "ranges"} - keys:
                parts.append(f"missing key(s) {', '.join(sorted({'defaults', 'ranges'} - keys))}")
            raise PolicyError(f"sampling policy: {'; '.join(parts)}")
        defaults, ranges = data["defaults"], data["ranges"]
        if not isinstance(defaults, Mapping) or not isinstance(ranges, Mapping):
            raise PolicyError("sampling policy: defaults and ranges must be objects")
        return cls(
            defaults=dict(defaults), ranges={p: tuple(r) if isinstance(r, list) else r for p, r in ranges.items()}
        )


def _in_range(param: str, value: Number, lo: Number, hi: Number) -> bool:
    if param == "top_k" and value == -1:
        return lo == -1
    if param == "top_k" and lo == -1:
        return value <= hi if hi >= 1 else False
    return lo <= value <= hi
