"""What a source says about ending and sampling reaches the package: the stop ids of every
family (a Hugging Face directory's config and generation_config, a GGUF's eos, eot and eom ids,
the end-of-turn tokens its chat template writes), and the generation defaults it declares
(generation_config.json, GGUF general.sampling.*) as the package policy's defaults, clamped to
the generic recipe's ranges."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from tests.preparation.test_gguf_source import tiny_vocabulary, write_tiny_gguf
from tokenizers import Tokenizer, models

from flare.preparation.export import ExportOptions, export_package, open_source
from flare.package.model_config import ModelConfig
from flare.preparation.recipes import (
    GENERIC_LLAMA,
    SMOLLM2_135M_INSTRUCT,
    gguf_sampling_defaults,
    hf_generation_defaults,
    with_declared_defaults,
)
from flare.preparation.stop_tokens import stop_token_ids

TEMPLATES = Path(__file__).parent.parent / "fixtures" / "templates"


def _tokenizer_json(specials: list[str]) -> str:
    """A vocabulary of `specials` (ids 0, 1, ...) as control tokens, then two ordinary words."""
    tokenizer = Tokenizer(models.WordLevel({"hello": 0, "world": 1}, unk_token="hello"))
    tokenizer.add_special_tokens(specials)
    return tokenizer.to_str()


# family: (its end-of-turn specials, its template, the ids its source declares, the stop ids)
FAMILIES = {
    # Llama 3.1's GGUF declares eos <|eot_id|> only; its template writes <|eom_id|> too.
    "llama3.1": (["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>"], "llama3.1", [4], (4, 5)),
    # Gemma declares <eos>; its turns end with <end_of_turn>.
    "gemma2": (["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "gemma2", [3], (3, 5)),
    "gemma3": (["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "gemma3", [3], (3, 5)),
    # Qwen's generation_config lists both <|im_end|> and <|endoftext|>: nothing to add.
    "qwen2.5": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "qwen2.5", [4, 2], (4, 2)),
    # A Qwen GGUF that declares only <|endoftext|> stops at <|im_end|> as well.
    "qwen3": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "qwen3", [2], (2, 4)),
    # Phi-3 declares <|endoftext|>; its turns end with <|end|>.
    "phi3": (["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"], "phi3", [2], (2, 5)),
    # Mistral's template writes eos_token itself (</s>), which is declared.
    "mistral": (["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]"], "mistral-v0.3", [3], (3,)),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_stops_at_its_declared_ids_and_its_templates_turn_end(family: str) -> None:
    specials, template, declared, expected = FAMILIES[family]
    ids = stop_token_ids(declared, _tokenizer_json(specials), (TEMPLATES / f"{template}.jinja").read_text())
    assert ids == expected


def test_an_end_of_turn_word_that_is_not_a_control_token_is_not_a_stop() -> None:
    tokenizer = Tokenizer(models.WordLevel({"<|end|>": 0, "x": 1}, unk_token="x")).to_str()
    assert stop_token_ids([1], tokenizer, "{{ '<|end|>' }}") == (1,)


def test_a_hugging_face_directory_stops_at_its_templates_turn_end(
    tmp_path: Path, make_hf_directory: Any, package_parts: dict[str, Any]
) -> None:
    # The default model's vocabulary: 0 <|endoftext|>, 2 <|im_end|>, which its template writes.
    directory = make_hf_directory(tmp_path / "hf", package_parts, config_changes={"eos_token_id": 0})
    assert open_source(str(directory)).config.eos_token_ids == (0, 2)


def test_a_gguf_stops_at_its_eos_and_eot_ids(tmp_path: Path, tiny_config: ModelConfig, make_state_dict: Any) -> None:
    config = replace(tiny_config, vocab_size=len(tiny_vocabulary()[0]))
    write_tiny_gguf(tmp_path / "m.gguf", config, make_state_dict(config), kv={"tokenizer.ggml.eot_token_id": 0})
    assert open_source(str(tmp_path / "m.gguf")).config.eos_token_ids == (2, 0)


QWEN_GENERATION = {
    "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
    "eos_token_id": [2, 0], "max_new_tokens": 200,
}


def test_generation_config_sets_the_generic_policys_defaults_at_export(
    tmp_path: Path, make_hf_directory: Any, package_parts: dict[str, Any]
) -> None:
    directory = make_hf_directory(tmp_path / "hf", package_parts)
    (directory / "generation_config.json").write_text(json.dumps(QWEN_GENERATION))
    manifest = export_package(str(directory), tmp_path / "pkg", ExportOptions())
    defaults = manifest.sampling.defaults
    assert (defaults["temperature"], defaults["top_p"], defaults["top_k"]) == (0.7, 0.8, 20)
    assert defaults["repetition_penalty"] == 1.05 and defaults["max_tokens"] == 200
    assert manifest.sampling.ranges == {**GENERIC_LLAMA.ranges, "max_tokens": (1, manifest.serving.max_context)}
    assert manifest.provenance.recipe == "generic-llama+source-defaults"
    # The command line still has the last word.
    shutil.rmtree(tmp_path / "pkg")
    options = ExportOptions(sampling_defaults={"temperature": 0.3})
    assert export_package(str(directory), tmp_path / "pkg", options).sampling.defaults["temperature"] == 0.3


def test_a_gguf_s_general_sampling_keys_set_the_defaults(
    tmp_path: Path, tiny_config: ModelConfig, make_state_dict: Any
) -> None:
    config = replace(tiny_config, vocab_size=len(tiny_vocabulary()[0]))
    kv = {"general.sampling.temp": 0.6, "general.sampling.top_k": 0, "general.sampling.min_p": 0.05}
    write_tiny_gguf(tmp_path / "m.gguf", config, make_state_dict(config), kv=kv)
    manifest = export_package(str(tmp_path / "m.gguf"), tmp_path / "pkg", ExportOptions())
    defaults = manifest.sampling.defaults
    assert defaults["temperature"] == pytest.approx(0.6) and defaults["top_k"] == -1
    assert defaults["min_p"] == pytest.approx(0.05) and defaults["top_p"] == 1.0


@pytest.mark.parametrize(
    ("generation", "expected"),
    [
        (QWEN_GENERATION, {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 200}),
        # Without do_sample transformers decodes greedily and ignores them: only the length counts.
        ({"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 64}, {"max_tokens": 64}),
        ({"do_sample": False, "temperature": 0.6}, None),
        ({"do_sample": True, "temperature": "hot", "top_k": 0}, {"top_k": -1}),
        ({}, None),
    ],
)
def test_generation_config_values_become_policy_parameters(generation: dict[str, Any], expected: Any) -> None:
    declared = hf_generation_defaults(generation)
    assert (declared.values if declared is not None else None) == expected


def test_declared_defaults_are_clamped_to_the_generic_ranges_and_leave_a_models_own_recipe_alone() -> None:
    declared = gguf_sampling_defaults({"general.sampling.temp": 9.0, "general.sampling.penalty_repeat": 0.1}.get)
    assert declared is not None
    recipe = with_declared_defaults(GENERIC_LLAMA, declared)
    assert recipe.defaults["temperature"] == 2.0 and recipe.defaults["repetition_penalty"] == 0.5
    assert recipe.ranges == GENERIC_LLAMA.ranges
    assert with_declared_defaults(SMOLLM2_135M_INSTRUCT, declared) is SMOLLM2_135M_INSTRUCT
    assert with_declared_defaults(GENERIC_LLAMA, None) is GENERIC_LLAMA
