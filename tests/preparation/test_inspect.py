"""flare inspect: the manifest, integrity and problems, as JSON and as text."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from flare.package.manifest import FORMAT_VERSION
from flare.preparation.inspect import inspect_package, render_text, servable


def test_json_is_the_manifest_plus_weight_types_integrity_and_problems(tiny_package: Path) -> None:
    info = inspect_package(tiny_package)
    assert set(info) == {"format", "model", "serving", "sampling", "files", "weight_types", "integer_activation_types", "kv_cache", "integrity", "problems"}
    # Two layers of 2 KV heads of 16, a key and a value each.
    assert info["kv_cache"] == {
        "layout": "per kv head",
        "elements_per_token_per_layer": 2 * 2 * 16,
        "bytes_per_token": {"float32": 2 * 64 * 4, "float16": 2 * 64 * 2, "bfloat16": 2 * 64 * 2},
        "per_tensor_parallel_rank": "its share of the kv heads",
    }
    assert info["format"] == FORMAT_VERSION
    # The tiny model: a 49152 x 64 tied embedding, two layers (2 norms, q and o 64 x 64, k and v
    # 32 x 64, three 64 x 128 MLP matrices), the final norm; all float32.
    parameters = 49152 * 64 + 2 * (2 * 64 + 2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 128) + 64
    assert info["weight_types"] == {"F32": {"tensors": 20, "bytes": 4 * parameters}}
    assert info["integrity"] == {
        "ok": True,
        "files": {"chat_template.jinja": "ok", "model.safetensors": "ok", "tokenizer.json": "ok"},
        "problems": [],
    }
    assert info["problems"] == []
    assert info["sampling"]["defaults"]["top_p"] == 0.9
    assert servable(info)


def test_text_shows_model_serving_sampling_and_integrity(tiny_package: Path) -> None:
    text = render_text(inspect_package(tiny_package), tiny_package)
    for expected in (
        f"package {tiny_package}", "llama, 2 layers, hidden 64", "4 heads, 2 kv heads, head dim 16",
        "max_concurrency     32", "max_context         512", "sampler             standard",
        "ngram drafter, 4 draft tokens per round", "top_p               0.9         [0.05, 1.0]",
        "min_p               0.0         fixed at the default", "integrity             ok", "problems              none",
    ):
        assert expected in text


def test_tampered_file_is_reported(tiny_package: Path, tmp_path: Path) -> None:
    package = Path(shutil.copytree(tiny_package, tmp_path / "pkg"))
    with open(package / "model.safetensors", "r+b") as weights:
        weights.seek(-4, 2)
        weights.write(b"\0\0\0\0")
    info = inspect_package(package)
    assert info["integrity"]["ok"] is False
    assert info["integrity"]["files"]["model.safetensors"] == "checksum mismatch"
    assert not servable(info)
    text = render_text(info, package)
    assert "integrity             FAILED" in text
    assert "! model.safetensors does not match its checksum" in text


def test_unreadable_manifest_still_gives_integrity(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    info = inspect_package(tmp_path / "pkg")
    assert info == {"integrity": {"ok": False, "files": {}, "problems": ["manifest.json is missing"]}, "problems": []}
    assert "manifest.json is missing" in render_text(info, tmp_path / "pkg")


def test_contract_problem_is_listed(make_package: Callable[..., Path]) -> None:
    # An older export: vocabulary-parallel sampling with the filtered test policy.
    package = make_package(serving={"vocabulary_parallel_sampling": True})
    info = inspect_package(package)
    assert info["integrity"]["ok"] is True
    [problem] = info["problems"]
    assert problem["code"] == "filtered_policy_for_vocabulary_parallel_sampling"
    assert not servable(info)
    text = render_text(info, package)
    assert "problems              1" in text and "vocabulary-parallel" in text
    assert "sampler             vocabulary-parallel (unfiltered only)" in text


def test_shared_vocabulary_parallel_fixtures_are_what_they_claim(
    vocabulary_parallel_package: Path, contradicting_package: Path
) -> None:
    assert servable(inspect_package(vocabulary_parallel_package))
    info = inspect_package(contradicting_package)
    [problem] = info["problems"]
    assert any("--sampling-policy unfiltered" in fix for fix in problem["fixes"])
