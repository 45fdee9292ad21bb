"""Recipes: per-model declarations of the sampling policy and serving defaults a package gets.

A recipe is what the model's authors recommend (its model card), written down once so that every
package of the model serves under it. `flare export` picks the recipe by the model's architecture
fingerprint, whatever the source format, and `--sampling-default` / `--sampling-range` override it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from flare.preparation.manifest import ModelConfig

Number = int | float

DEFAULT_MAX_TOKENS = 512


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    defaults: dict[str, Number]
    # max_tokens is not listed: its range is always [1, max_context], which only export knows.
    ranges: dict[str, tuple[Number, Number]]
    # ModelConfig fields that identify the model, whatever the source format.
    fingerprint: dict[str, Any]
    max_concurrency: int = 32
    draft_tokens: int = 4

    def matches(self, config: ModelConfig) -> bool:
        return all(getattr(config, field) == value for field, value in self.fingerprint.items())

    def digest(self) -> str:
        """A short hash of everything the recipe declares: a package exported under another
        version of the recipe is another package (the default model's cache key has it)."""
        declared = json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(declared.encode("utf-8")).hexdigest()[:8]


# SmolLM2-135M-Instruct, model card (huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct):
# generate(..., temperature=0.2, top_p=0.9, do_sample=True), with a repetition penalty of 1.1 and
# a frequency penalty of 0.3, without which a 135M model loops: of 50 seeded answers to the
# README's question, 20 looped until max_tokens without penalties and none with them; of 50 short
# poems, 46 looped without penalties, 23 with the repetition penalty alone and none with both
# (docs/sampling.md, "The default package's first answer"; benchmarks/first_answer.py).
# The ranges keep requests where a 135M model still writes sense:
# repetition_penalty below 1 makes it loop at once, min_p above 0.5 and top_p below 0.05
# collapse it to greedy anyway.
SMOLLM2_135M_INSTRUCT = Recipe(
    name="smollm2-135m-instruct",
    description="SmolLM2-135M-Instruct, with the model card's sampling settings and penalties against loops",
    defaults={
        "temperature": 0.2,
        "top_k": -1,
        "top_p": 0.9,
        "min_p": 0.0,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.3,
        "max_tokens": DEFAULT_MAX_TOKENS,
    },
    ranges={
        "temperature": (0.0, 2.0),
        "top_k": (-1, 200),
        "top_p": (0.05, 1.0),
        "min_p": (0.0, 0.5),
        "repetition_penalty": (1.0, 1.5),
        "presence_penalty": (-2.0, 2.0),
        "frequency_penalty": (-2.0, 2.0),
    },
    fingerprint={
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_layers": 30,
        "num_heads": 9,
        "num_kv_heads": 3,
    },
)

# Any other Llama-family model: the plain softmax by default, and every value allowed that the
# raw validation allows (top_p has to stay above 0, and top_k within reason).
GENERIC_LLAMA = Recipe(
    name="generic-llama",
    description="a Llama-family model without a recipe of its own: unfiltered sampling at temperature 1",
    defaults={
        "temperature": 1.0,
        "top_k": -1,
        "top_p": 1.0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "max_tokens": DEFAULT_MAX_TOKENS,
    },
    ranges={
        "temperature": (0.0, 2.0),
        "top_k": (-1, 1000),
        "top_p": (0.01, 1.0),
        "min_p": (0.0, 1.0),
        "repetition_penalty": (0.5, 2.0),
        "presence_penalty": (-2.0, 2.0),
        "frequency_penalty": (-2.0, 2.0),
    },
    fingerprint={},
)

RECIPES = (SMOLLM2_135M_INSTRUCT,)


def recipe_for(config: ModelConfig) -> Recipe:
    """The recipe of the model `config` describes, or the generic Llama recipe."""
    return next((recipe for recipe in RECIPES if recipe.matches(config)), GENERIC_LLAMA)
