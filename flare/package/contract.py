"""The contract between a package's sampling policy and the sampler it was prepared for.

The vocabulary-parallel sampler (kernels/, S vocabulary shards) merges per-shard maxima, sums of
exponentials and Gumbel-max candidates; that merge is exact for the full softmax only. Top-k,
top-p and min-p need a global sort or threshold across all shards, so a filtered request on that
path fails on the device (INVALID_SPECULATION) instead of being served. A package prepared for
it must therefore have a policy that never asks for a filter. `export` refuses to write a
package that breaks the contract, `run` refuses to serve one, and `inspect` lists the problem.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flare.package.manifest import ServingConfig
from flare.policy.policy import PolicyError, SamplingPolicy

FILTERED_POLICY_FOR_VOCABULARY_PARALLEL = "filtered_policy_for_vocabulary_parallel_sampling"


@dataclass(frozen=True)
class Problem:
    code: str
    message: str  # what is wrong and every fix, in one paragraph
    fixes: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "fixes": list(self.fixes)}


def check_contract(serving: ServingConfig, policy: SamplingPolicy, package: str = "DIR") -> list[Problem]:
    """Every way in which `policy` contradicts the sampler `serving` asks for (empty when none).

    `package` is the package's path, used in the fix commands.
    """
    if not serving.vocabulary_parallel_sampling:
        return []
    filters = policy.filter_problems()
    if not filters:
        return []
    fixes = [f"re-export it: flare export SOURCE -o {package} --overwrite --vocabulary-parallel-sampling"]
    try:
        policy.unfiltered()
    except PolicyError:
        override = "(flare run --sampling-policy unfiltered cannot help here: a default itself enables a filter)"
    else:
        fixes.append(f"serve it without re-export: flare run {package} --sampling-policy unfiltered")
        override = ""
    message = (
        "the package is prepared for vocabulary-parallel sampling (serving.vocabulary_parallel_sampling), "
        "which samples unfiltered distributions only, but its sampling policy asks for filters: "
        f"{'; '.join(filters)}. Fix: {', or '.join(fixes)}" + (f" {override}" if override else "")
    )
    return [Problem(FILTERED_POLICY_FOR_VOCABULARY_PARALLEL, message, tuple(fixes))]
