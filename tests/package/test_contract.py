"""The sampler/policy contract: a vocabulary-parallel package must never ask for a filter."""

from __future__ import annotations

from typing import Any

from flare.package.contract import (
    FILTERED_POLICY_FOR_VOCABULARY_PARALLEL,
    check_contract,
)
from flare.package.manifest import ServingConfig
from flare.policy.policy import SamplingPolicy

DEFAULTS: dict[str, Any] = {
    "temperature": 0.2, "top_k": -1, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "max_tokens": 64,
}
STANDARD = ServingConfig(max_context=512)
PARALLEL = ServingConfig(max_context=512, vocabulary_parallel_sampling=True)


def test_standard_sampler_accepts_any_policy() -> None:
    policy = SamplingPolicy({**DEFAULTS, "top_p": 0.9}, {"top_p": (0.05, 1.0)})
    assert check_contract(STANDARD, policy) == []


def test_vocabulary_parallel_sampler_accepts_an_unfiltered_policy() -> None:
    policy = SamplingPolicy(DEFAULTS, {"temperature": (0.0, 2.0), "repetition_penalty": (1.0, 1.5)})
    assert check_contract(PARALLEL, policy) == []


def test_filter_range_on_a_vocabulary_parallel_package_names_the_problem_and_both_fixes() -> None:
    policy = SamplingPolicy(DEFAULTS, {"top_p": (0.05, 1.0)})
    [problem] = check_contract(PARALLEL, policy, "/srv/pkg")
    assert problem.code == FILTERED_POLICY_FOR_VOCABULARY_PARALLEL
    assert "vocabulary-parallel sampling" in problem.message
    assert "the range of top_p [0.05, 1.0] allows a filter" in problem.message
    assert problem.fixes == (
        "re-export it: flare export SOURCE -o /srv/pkg --overwrite --vocabulary-parallel-sampling",
        "serve it without re-export: flare run /srv/pkg --sampling-policy unfiltered",
    )
    assert all(fix in problem.message for fix in problem.fixes)
    assert problem.to_json() == {"code": problem.code, "message": problem.message, "fixes": list(problem.fixes)}


def test_filtered_default_leaves_re_export_as_the_only_fix() -> None:
    policy = SamplingPolicy({**DEFAULTS, "top_p": 0.9}, {"top_p": (0.05, 1.0)})
    [problem] = check_contract(PARALLEL, policy)
    assert "the default top_p=0.9 enables a filter" in problem.message
    assert len(problem.fixes) == 1 and "--vocabulary-parallel-sampling" in problem.fixes[0]
    assert "--sampling-policy unfiltered cannot help here" in problem.message
