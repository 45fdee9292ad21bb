"""flare export: options checked before any weight is read, the recipe adapter, the written package."""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from flare.engine import precision
from flare.preparation import export as export_module
from flare.package.contract import check_contract
from flare.preparation.export import (
    ExportError,
    ExportOptions,
    build_policy,
    export_package,
    parse_sampling_default,
    parse_sampling_range,
)
from flare.package.directory import open_package
from flare.preparation.recipes import GENERIC_LLAMA, SMOLLM2_135M_INSTRUCT, recipe_for
from flare.preparation.source import ModelSource


def test_export_from_a_hugging_face_directory_writes_a_servable_package(
    tmp_path: Path, tiny_hf_directory: Path, package_parts: dict[str, Any]
) -> None:
    manifest = export_package(str(tiny_hf_directory), tmp_path / "pkg", ExportOptions())
    package = open_package(tmp_path / "pkg")
    assert package.manifest == manifest
    assert manifest.model == package_parts["config"]
    assert manifest.provenance.recipe == GENERIC_LLAMA.name
    assert manifest.provenance.source == str(tiny_hf_directory)
    assert manifest.provenance.source_format == "huggingface"
    assert manifest.serving.max_context == 512 and manifest.serving.max_concurrency == 32
    assert manifest.serving.draft_tokens == 4 and manifest.serving.drafter == "ngram"
    assert manifest.sampling.ranges["max_tokens"] == (1, 512)
    assert manifest.sampling.defaults["max_tokens"] == 512
    weights = package.load_state_dict()
    for name, tensor in package_parts["state_dict"].items():
        assert torch.equal(weights[name], tensor.to(torch.bfloat16).to(torch.float16))  # auto: float16
    assert package.chat_template == package_parts["chat_template"]


@pytest.mark.parametrize("native_bf16", [True, False], ids=["native-bf16-cpu", "other-cpu"])
def test_dtype_auto_writes_float16_whatever_the_cpu(
    tmp_path: Path, tiny_hf_directory: Path, monkeypatch: pytest.MonkeyPatch, native_bf16: bool
) -> None:
    # One package serves fast on every CPU kind: the engine picks the format at load.
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native_bf16)
    manifest = export_package(str(tiny_hf_directory), tmp_path / "pkg", ExportOptions(dtype="auto"))
    # The manifest names the stored dtype, never "auto".
    assert manifest.serving.dtype == "float16"
    weights = open_package(tmp_path / "pkg").load_state_dict()
    assert {tensor.dtype for tensor in weights.values()} == {torch.float16}


def test_weights_beyond_float16_range_are_stored_in_bfloat16_under_auto_and_refused_under_float16(
    tmp_path: Path, make_hf_directory, package_parts
) -> None:
    state = dict(package_parts["state_dict"])
    state["model.layers.0.mlp.down_proj.weight"] = state["model.layers.0.mlp.down_proj.weight"].clone()
    state["model.layers.0.mlp.down_proj.weight"][0, 0] = 1e5
    source = make_hf_directory(tmp_path / "wide", {**package_parts, "state_dict": state})
    manifest = export_package(str(source), tmp_path / "auto", ExportOptions(dtype="auto"))
    assert manifest.serving.dtype == "bfloat16"
    stored = open_package(tmp_path / "auto").load_state_dict()["model.layers.0.mlp.down_proj.weight"][0, 0]
    assert stored == torch.tensor(1e5).bfloat16()
    with pytest.raises(ExportError, match=r"--dtype float16: a weight of this model lies beyond float16's range") as error:
        export_package(str(source), tmp_path / "f16", ExportOptions(dtype="float16"))
    assert error.value.option == "--dtype"
    assert not (tmp_path / "f16").exists()


def test_serving_and_sampling_options_reach_the_manifest(tmp_path: Path, tiny_hf_directory: Path) -> None:
    options = ExportOptions(
        max_concurrency=8, max_context=256, sampling_defaults={"temperature": 0.7, "max_tokens": 100},
        sampling_ranges={"temperature": (0.0, 1.0)}, draft_tokens=0, dtype="bfloat16",
    )
    manifest = export_package(str(tiny_hf_directory), tmp_path / "pkg", options)
    assert manifest.provenance.name == tiny_hf_directory.name  # the model's own name by default
    assert (manifest.serving.max_concurrency, manifest.serving.max_context) == (8, 256)
    assert manifest.serving.draft_tokens == 0 and manifest.serving.dtype == "bfloat16"
    assert manifest.sampling.defaults["temperature"] == 0.7
    assert manifest.sampling.ranges["temperature"] == (0.0, 1.0)
    assert manifest.sampling.ranges["max_tokens"] == (1, 256)
    weights = open_package(tmp_path / "pkg").load_state_dict()
    assert weights["model.norm.weight"].dtype == torch.bfloat16


@pytest.fixture
def smollm2_recipe_for_tiny_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Export the tiny model under the SmolLM2 recipe (its filters are what matter here)."""
    monkeypatch.setattr(export_module, "recipe_for", lambda config: SMOLLM2_135M_INSTRUCT)


@pytest.mark.usefixtures("smollm2_recipe_for_tiny_model")
def test_export_without_vocabulary_parallel_sampling_keeps_the_recipe_filters(tmp_path: Path, tiny_hf_directory: Path) -> None:
    manifest = export_package(str(tiny_hf_directory), tmp_path / "pkg", ExportOptions())
    assert manifest.serving.vocabulary_parallel_sampling is False
    assert manifest.sampling.defaults["top_p"] == 0.9 and manifest.sampling.defaults["temperature"] == 0.2
    assert manifest.sampling.ranges["top_p"] == (0.05, 1.0)
    assert manifest.sampling.ranges["top_k"] == (-1, 200)
    assert manifest.sampling.ranges["min_p"] == (0.0, 0.5)


@pytest.mark.usefixtures("smollm2_recipe_for_tiny_model")
def test_export_with_vocabulary_parallel_sampling_packages_the_unfiltered_policy(
    tmp_path: Path, tiny_hf_directory: Path
) -> None:
    options = ExportOptions(vocabulary_parallel_sampling=True)
    manifest = export_package(str(tiny_hf_directory), tmp_path / "pkg", options)
    assert manifest.serving.vocabulary_parallel_sampling is True
    policy = manifest.sampling
    assert (policy.defaults["top_k"], policy.defaults["top_p"], policy.defaults["min_p"]) == (-1, 1.0, 0.0)
    assert not {"top_k", "top_p", "min_p"} & set(policy.ranges)
    assert policy.ranges["repetition_penalty"] == (1.0, 1.5)
    assert policy.ranges["temperature"] == (0.0, 2.0)
    assert policy.defaults["temperature"] == 0.2
    assert check_contract(manifest.serving, policy) == []
    assert policy.clamp({"top_p": 0.95}).params.top_p == 1.0


def test_recipe_adapter_without_and_with_vocabulary_parallel_sampling() -> None:
    plain = build_policy(ExportOptions(), SMOLLM2_135M_INSTRUCT, 8192)
    assert plain.filter_problems()  # top_p 0.9 by default, filter ranges
    parallel = build_policy(ExportOptions(vocabulary_parallel_sampling=True), SMOLLM2_135M_INSTRUCT, 8192)
    assert parallel.filter_problems() == []
    assert parallel == plain_without_filters(plain)


def plain_without_filters(policy: Any) -> Any:
    from flare.policy.policy import SamplingPolicy

    defaults = {**policy.defaults, "top_k": -1, "top_p": 1.0, "min_p": 0.0}
    return SamplingPolicy(defaults, {p: r for p, r in policy.ranges.items() if p not in ("top_k", "top_p", "min_p")})


@pytest.mark.parametrize(
    ("options", "option", "message"),
    [
        (ExportOptions(vocabulary_parallel_sampling=True, sampling_defaults={"top_p": 0.9}),
         "--sampling-default", r"--sampling-default top_p=0.9 enables a filter, but --vocabulary-parallel-sampling"),
        (ExportOptions(vocabulary_parallel_sampling=True, sampling_defaults={"top_k": 40}),
         "--sampling-default", r"top_k=40 enables a filter.*disabled value is top_k=-1"),
        (ExportOptions(vocabulary_parallel_sampling=True, sampling_defaults={"min_p": 0.05}),
         "--sampling-default", "min_p=0.05 enables a filter"),
        (ExportOptions(vocabulary_parallel_sampling=True, sampling_ranges={"top_p": (0.5, 1.0)}),
         "--sampling-range", r"--sampling-range top_p=0.5:1.0 allows filtering, but --vocabulary-parallel-sampling"),
        (ExportOptions(vocabulary_parallel_sampling=True, sampling_ranges={"top_k": (-1, 50)}),
         "--sampling-range", "top_k=-1:50 allows filtering"),
        (ExportOptions(max_context=0), "--max-context", "--max-context must be at least 1"),
        (ExportOptions(name="my model"), "--name", "--name 'my model': use 1 to 128 letters"),
        (ExportOptions(max_context=100_000), "--max-context", "--max-context 100000 exceeds the model's context length 512"),
        (ExportOptions(max_concurrency=0), "--max-concurrency", "--max-concurrency must be at least 1"),
        (ExportOptions(dtype="int8"), "--dtype", "--dtype must be one of auto, float32, bfloat16, float16"),
        (ExportOptions(draft_tokens=17), "--mtp-draft-tokens", "--mtp-draft-tokens must be from 0"),
        (ExportOptions(drafter="eagle"), "--drafter", "--drafter must be one of ngram"),
        (ExportOptions(sampling_defaults={"temperature": 3.0}), "--sampling-default",
         r"default temperature=3.0 lies outside its range \[0.0, 2.0\]"),
        (ExportOptions(sampling_ranges={"temperature": (1.0, 0.5)}), "--sampling-range", "range of temperature is empty"),
        (ExportOptions(sampling_defaults={"max_tokens": 1000}), "--sampling-default", "max_tokens cannot exceed the context"),
        (ExportOptions(sampling_ranges={"max_tokens": (1, 1000)}), "--sampling-range", "max_tokens cannot exceed the context"),
    ],
)
def test_bad_option_is_refused_before_any_weight_is_read(
    tmp_path: Path, unreadable_weights: None, options: ExportOptions, option: str, message: str
) -> None:
    with pytest.raises(ExportError, match=message) as error:
        export_package("tiny", tmp_path / "pkg", options)
    assert error.value.option == option
    assert not (tmp_path / "pkg").exists()


@pytest.fixture
def unreadable_weights(monkeypatch: pytest.MonkeyPatch, package_parts: dict[str, Any]) -> None:
    """Every source opens as the tiny model, whose weights fail the test if anything reads them."""

    def read_weights(progress: Any) -> dict[str, torch.Tensor]:
        raise AssertionError("weights were read before every option was checked")

    source = ModelSource(
        name="tiny", source="tiny", source_format="huggingface", source_sha256=None, config=package_parts["config"],
        tokenizer_json=package_parts["tokenizer_json"], chat_template=package_parts["chat_template"],
        read_weights=read_weights,
    )
    monkeypatch.setattr(export_module, "open_source", lambda name: source)


def test_name_option_sets_the_served_model_name(tmp_path: Path, tiny_hf_directory: Path) -> None:
    manifest = export_package(str(tiny_hf_directory), tmp_path / "pkg", ExportOptions(name="acme/tiny-v2"))
    assert open_package(tmp_path / "pkg").manifest.provenance.name == manifest.provenance.name == "acme/tiny-v2"


def test_existing_destination_is_refused_before_the_source_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "pkg").mkdir()
    monkeypatch.setattr(export_module, "open_source", lambda name: pytest.fail("source opened"))
    with pytest.raises(ExportError, match="already exists; pass --overwrite") as error:
        export_package("default", tmp_path / "pkg", ExportOptions())
    assert error.value.option is None


def test_missing_source_is_named(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="source 'nowhere.gguf' does not exist; give a GGUF file"):
        export_package("nowhere.gguf", tmp_path / "pkg", ExportOptions())


def test_harmless_filter_options_are_accepted_with_vocabulary_parallel_sampling() -> None:
    options = ExportOptions(
        vocabulary_parallel_sampling=True, sampling_defaults={"top_p": 1.0, "top_k": 0},
        sampling_ranges={"top_p": (1.0, 1.0)},
    )
    policy = build_policy(options, SMOLLM2_135M_INSTRUCT, 8192)
    assert policy.filter_problems() == [] and "top_p" not in policy.ranges


@pytest.mark.parametrize(
    ("text", "parsed"),
    [("temperature=0.7", ("temperature", 0.7)), ("top_k=40", ("top_k", 40)), (" max_tokens = 64 ", ("max_tokens", 64))],
)
def test_sampling_default_parses(text: str, parsed: tuple) -> None:
    assert parse_sampling_default(text) == parsed


def test_sampling_range_parses() -> None:
    assert parse_sampling_range("top_p=0.1:1") == ("top_p", (0.1, 1.0))
    assert parse_sampling_range("top_k=-1:50") == ("top_k", (-1, 50))


@pytest.mark.parametrize(
    ("parse", "text", "message"),
    [
        (parse_sampling_default, "top_p", "expected NAME=VALUE"),
        (parse_sampling_default, "mirostat=1", "'mirostat' is not a policy parameter; choose one of temperature"),
        (parse_sampling_default, "seed=1", "'seed' is not a policy parameter"),
        (parse_sampling_default, "top_p=high", "top_p takes a number, got 'high'"),
        (parse_sampling_default, "top_p=0", r"top_p must be in \(0, 1\]"),
        (parse_sampling_default, "top_k=1.5", "top_k must be an integer"),
        (parse_sampling_default, "temperature=nan", "temperature must be a finite number"),
        (parse_sampling_range, "top_p=0.5", "expected NAME=LO:HI"),
        (parse_sampling_range, "min_p=0:2", r"min_p must be in \[0, 1\]"),
    ],
)
def test_malformed_sampling_option_is_named(parse: Any, text: str, message: str) -> None:
    with pytest.raises(ExportError, match=message) as error:
        parse(text)
    assert error.value.option == ("--sampling-default" if parse is parse_sampling_default else "--sampling-range")


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_shows_on_a_terminal_only(tmp_path: Path, tiny_hf_directory: Path) -> None:
    terminal, log = FakeTerminal(), io.StringIO()
    export_package(str(tiny_hf_directory), tmp_path / "a", ExportOptions(), stderr=terminal)
    export_package(str(tiny_hf_directory), tmp_path / "b", ExportOptions(), stderr=log)
    assert "reading weights: 20/20 tensors" in terminal.getvalue()
    assert f"wrote {tmp_path / 'a'}" in terminal.getvalue()
    assert log.getvalue() == ""


def test_recipe_is_chosen_by_the_model_fingerprint(smollm2_source: ModelSource, tiny_config: Any) -> None:
    assert recipe_for(smollm2_source.config) is SMOLLM2_135M_INSTRUCT
    assert recipe_for(tiny_config) is GENERIC_LLAMA
    assert recipe_for(replace(smollm2_source.config, num_layers=31)) is GENERIC_LLAMA


def test_a_tokenizer_with_ids_beyond_the_models_vocabulary_is_refused(
    tmp_path: Path, package_parts: dict[str, Any], make_hf_directory: Any
) -> None:
    # An added token past the embedding's rows: text holding it would become an id the model
    # cannot read, so the package is not written.
    from tokenizers import AddedToken, Tokenizer

    directory = make_hf_directory(tmp_path / "model", package_parts)
    tokenizer = Tokenizer.from_str(package_parts["tokenizer_json"])
    vocab_size = package_parts["config"].vocab_size
    while tokenizer.get_vocab_size(with_added_tokens=True) <= vocab_size:
        tokenizer.add_special_tokens([AddedToken(f"<|extra_{tokenizer.get_vocab_size(with_added_tokens=True)}|>", special=True)])
    (directory / "tokenizer.json").write_text(tokenizer.to_str())
    with pytest.raises(ExportError, match=rf"token ids reach {vocab_size}, but the model's vocabulary .* holds {vocab_size} tokens"):
        export_package(str(directory), tmp_path / "package", ExportOptions())
    assert not (tmp_path / "package").exists()
