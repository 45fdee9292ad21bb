"""Recipes: per-model declarations of the sampling policy and serving defaults a package gets.

A recipe is what the model's authors recommend (its model card), written down once so that every
package of the model serves under it. `flare export` picks the recipe by the model's architecture
fingerprint, whatever the source format, and `--sampling-default` / `--sampling-range` override it.

A model without a recipe of its own serves under the generic one, with the defaults its source
declares in place of the generic defaults (`DeclaredDefaults`: a Hugging Face directory's
generation_config.json, a GGUF file's `general.sampling.*` keys), each clamped to the generic
ranges.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from flare.package.model_config import ModelConfig

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


@dataclass(frozen=True)
class DeclaredDefaults:
    """The sampling defaults a source declares for its model, as policy parameters, and where."""

    origin: str  # "generation_config.json", "GGUF general.sampling"
    values: dict[str, Number]


# generation_config.json's keys (transformers' GenerationConfig) and the parameter each sets.
_HF_GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# llama.cpp's general.sampling.* keys (gguf-py's Keys.General.SAMPLING_*) and the parameter each
# sets; llama.cpp applies its repeat penalty to the last penalty_last_n tokens, flare to all of them.
_GGUF_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def hf_generation_defaults(generation: Mapping[str, Any]) -> DeclaredDefaults | None:
    """The sampling defaults of a generation_config.json, or None where it declares none. Its
    sampling values count only with `do_sample: true`: transformers decodes greedily otherwise
    and ignores them; `max_new_tokens` counts either way."""
    keys = _HF_GENERATION_KEYS if generation.get("do_sample") is True else {"max_new_tokens": "max_tokens"}
    values = _numbers({param: generation.get(key) for key, param in keys.items()})
    return DeclaredDefaults("generation_config.json", values) if values else None


def gguf_sampling_defaults(get: Callable[[str], Any]) -> DeclaredDefaults | None:
    """The sampling defaults of a GGUF file's general.sampling.* keys (`get` reads one key, None
    when absent), or None where it declares none."""
    values = _numbers({param: get(key) for key, param in _GGUF_SAMPLING_KEYS.items()})
    return DeclaredDefaults("GGUF general.sampling", values) if values else None


def _numbers(raw: Mapping[str, Any]) -> dict[str, Number]:
    values: dict[str, Number] = {}
    for param, value in raw.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue  # absent, or not a number: the generic default stands
        if param == "top_k":
            values[param] = int(value) if value > 0 else -1  # 0 turns top-k off in both, -1 in flare
        elif param == "max_tokens":
            values[param] = max(int(value), 1)
        else:
            values[param] = float(value)
    return values


def with_declared_defaults(recipe: Recipe, declared: DeclaredDefaults | None) -> Recipe:
    """The generic recipe with the defaults the source declares, each clamped to the generic
    ranges (max_tokens later, to the context, by export); any other recipe as it is: a model's
    own recipe is its authors' word already."""
    if recipe is not GENERIC_LLAMA or declared is None:
        return recipe
    defaults = dict(recipe.defaults)
    for param, value in declared.values.items():
        low, high = recipe.ranges.get(param, (value, value))
        defaults[param] = min(max(value, low), high)
    return dataclasses.replace(
        recipe,
        name=f"{recipe.name}+source-defaults",
        description=f"{recipe.description}, with the defaults of the source's {declared.origin}",
        defaults=defaults,
    )
