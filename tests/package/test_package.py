"""Writing packages atomically, opening them, and detecting tampering."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from flare.package.manifest import FORMAT_VERSION, MAX_CONTEXT
from flare.package.problems import MAX_LISTED
from flare.package import directory as package_module
from flare.package.directory import (
    PackageError,
    open_package,
    verify_package,
    write_package,
)


def test_written_package_opens_and_returns_the_same_weights(tmp_path: Path, package_parts: dict[str, Any]) -> None:
    manifest = write_package(tmp_path / "pkg", **package_parts)
    package = open_package(tmp_path / "pkg")
    assert package.manifest == manifest
    assert sorted(p.name for p in (tmp_path / "pkg").iterdir()) == [
        "chat_template.jinja", "manifest.json", "model.safetensors", "tokenizer.json",
    ]
    weights = package.load_state_dict()
    assert weights.keys() == package_parts["state_dict"].keys()
    for name, tensor in package_parts["state_dict"].items():
        assert torch.equal(weights[name], tensor)
    assert "lm_head.weight" not in weights  # tied embeddings
    assert package.chat_template == package_parts["chat_template"]
    assert json.loads(package.tokenizer_json_path.read_text()) == json.loads(package_parts["tokenizer_json"])
    assert verify_package(tmp_path / "pkg").ok
    assert list(tmp_path.iterdir()) == [tmp_path / "pkg"]  # no temporary directory left behind


def test_existing_directory_is_refused_without_overwrite(tmp_path: Path, package_parts: dict[str, Any]) -> None:
    write_package(tmp_path / "pkg", **package_parts)
    with pytest.raises(PackageError, match="already exists; pass --overwrite"):
        write_package(tmp_path / "pkg", **package_parts)


def test_overwrite_replaces_a_package(tmp_path: Path, package_parts: dict[str, Any]) -> None:
    write_package(tmp_path / "pkg", **package_parts)
    write_package(tmp_path / "pkg", **{**package_parts, "chat_template": "new"}, overwrite=True)
    assert open_package(tmp_path / "pkg").chat_template == "new"
    assert list(tmp_path.iterdir()) == [tmp_path / "pkg"]


def test_overwrite_never_replaces_a_directory_that_is_not_a_package(tmp_path: Path, package_parts: dict[str, Any]) -> None:
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("precious")
    with pytest.raises(PackageError, match="holds no package"):
        write_package(tmp_path / "home", **package_parts, overwrite=True)
    assert (tmp_path / "home" / "notes.txt").read_text() == "precious"


def test_failure_mid_write_leaves_nothing_at_the_destination(
    tmp_path: Path, package_parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(package_module, "sha256_of", interrupted)  # after the weights are written
    with pytest.raises(KeyboardInterrupt):
        write_package(tmp_path / "pkg", **package_parts)
    assert list(tmp_path.iterdir()) == []


def test_failed_overwrite_keeps_the_old_package(
    tmp_path: Path, package_parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    write_package(tmp_path / "pkg", **package_parts)

    def disk_full(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(package_module, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_package(tmp_path / "pkg", **package_parts, overwrite=True)
    assert open_package(tmp_path / "pkg").manifest.files
    assert list(tmp_path.iterdir()) == [tmp_path / "pkg"]


def test_weights_that_do_not_match_the_config_are_refused(tmp_path: Path, package_parts: dict[str, Any]) -> None:
    state = dict(package_parts["state_dict"])
    del state["model.norm.weight"]
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(PackageError) as error:
        write_package(tmp_path / "pkg", **{**package_parts, "state_dict": state})
    assert "weight model.norm.weight is missing" in str(error.value)
    assert "weight model.layers.0.mlp.up_proj.weight has shape [3, 3], expected [128, 64]" in str(error.value)
    assert not (tmp_path / "pkg").exists()


@pytest.fixture
def package_copy(tiny_package: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_package, tmp_path / "pkg"))


def test_tampered_file_is_detected_and_refused(package_copy: Path) -> None:
    (package_copy / "chat_template.jinja").write_text("{{ evil }}")
    report = verify_package(package_copy)
    assert not report.ok
    assert report.files["chat_template.jinja"] == "checksum mismatch"
    assert report.files["model.safetensors"] == "ok"
    with pytest.raises(PackageError, match="chat_template.jinja does not match its checksum") as error:
        open_package(package_copy)
    assert "flare export SOURCE -o" in str(error.value)


def test_every_problem_is_listed(package_copy: Path) -> None:
    weights = package_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    (package_copy / "tokenizer.json").unlink()
    (package_copy / "stray.bin").write_bytes(b"x")
    with pytest.raises(PackageError) as error:
        open_package(package_copy)
    problems = error.value.problems
    assert "model.safetensors does not match its checksum (changed or truncated after export)" in problems
    assert "tokenizer.json is missing" in problems
    assert "stray.bin is not part of the package (not in manifest.json)" in problems
    assert all(problem in str(error.value) for problem in problems)


def test_broken_manifest_is_reported(package_copy: Path) -> None:
    (package_copy / "manifest.json").write_text(f'{{"format": {FORMAT_VERSION}}}')
    report = verify_package(package_copy)
    assert not report.ok and "missing key(s)" in report.problems[0]
    (package_copy / "manifest.json").unlink()
    assert verify_package(package_copy).problems == ("manifest.json is missing",)


def test_missing_directory_is_reported(tmp_path: Path) -> None:
    with pytest.raises(PackageError, match="is not a directory"):
        open_package(tmp_path / "nowhere")


def edit_manifest(package: Path, **sections: dict[str, Any]) -> None:
    """Change keys of the manifest's sections (the manifest lists no checksum of its own)."""
    manifest = json.loads((package / "manifest.json").read_text())
    for path, values in sections.items():
        section = manifest
        for key in path.split("__"):
            section = section[key]
        section.update(values)
    (package / "manifest.json").write_text(json.dumps(manifest))


def test_a_manifest_claiming_millions_of_layers_is_refused_in_one_line_at_once(package_copy: Path) -> None:
    edit_manifest(package_copy, model__config={"num_layers": 10**7})
    started = time.perf_counter()
    with pytest.raises(PackageError) as error:
        open_package(package_copy)
    assert time.perf_counter() - started < 5
    assert error.value.problems == ("the config claims 10000000 layers but the weights hold tensors for 2",)
    assert len(str(error.value).splitlines()) == 1


@pytest.mark.parametrize("context", [1 << 40, 1 << 28])
def test_a_manifest_serving_an_implausible_context_is_refused_in_one_line(package_copy: Path, context: int) -> None:
    edit_manifest(package_copy, serving={"max_context": context}, model__config={"max_position_embeddings": context})
    with pytest.raises(PackageError) as error:
        open_package(package_copy)
    (line,) = str(error.value).splitlines()
    assert f"serving: max_context {context} is beyond the longest context flare serves, {MAX_CONTEXT} tokens" in line
    assert f"re-export it: flare export SOURCE -o {package_copy} --overwrite" in line


def test_a_problem_list_shows_twenty_and_how_many_more(package_copy: Path) -> None:
    for i in range(30):
        (package_copy / f"stray-{i:02d}.bin").write_bytes(b"x")
    with pytest.raises(PackageError) as error:
        open_package(package_copy)
    lines = str(error.value).splitlines()
    assert len(lines) == 1 + MAX_LISTED + 1
    assert lines[1] == "  - stray-00.bin is not part of the package (not in manifest.json)"
    assert lines[-1] == f"  - and {30 - MAX_LISTED} more"
