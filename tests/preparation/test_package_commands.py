"""The `flare export` and `flare inspect` commands: exit codes, one-line errors, output."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from tests.package_commands import flare

from flare.preparation.export import resolve_dtype


def test_export_then_inspect(tmp_path: Path, tiny_hf_directory: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = flare(
        "export", str(tiny_hf_directory), "-o", str(tmp_path / "pkg"), "--max-concurrency", "4",
        "--sampling-default", "temperature=0.5", "--sampling-range", "temperature=0:1", "--mtp-draft-tokens", "2",
    )
    out, err = capsys.readouterr()
    assert code == 0 and err == ""
    dtype = resolve_dtype("auto")
    assert out == f"exported {tiny_hf_directory} to {tmp_path / 'pkg'} (recipe generic-llama, dtype {dtype})\n"
    assert flare("inspect", str(tmp_path / "pkg"), "--json") == 0
    info = json.loads(capsys.readouterr().out)
    assert info["serving"]["max_concurrency"] == 4 and info["serving"]["draft_tokens"] == 2
    assert info["sampling"]["defaults"]["temperature"] == 0.5
    assert info["sampling"]["ranges"]["temperature"] == [0.0, 1.0]
    assert info["integrity"]["ok"] is True and info["problems"] == []
    assert flare("inspect", str(tmp_path / "pkg")) == 0
    assert "temperature         0.5         [0.0, 1.0]" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sampling-default", "top_p=2"], r"top_p must be in (0, 1]"),
        (["--sampling-range", "bogus=0:1"], "'bogus' is not a policy parameter"),
        (["--vocabulary-parallel-sampling", "--sampling-default", "top_p=0.9"],
         "--sampling-default top_p=0.9 enables a filter, but --vocabulary-parallel-sampling"),
        (["--max-context", "99999"], "--max-context 99999 exceeds the model's context length 512"),
        (["--mtp-draft-tokens", "-1"], "--mtp-draft-tokens must be from 0"),
    ],
)
def test_option_error_is_one_line_and_exit_2(
    tmp_path: Path, tiny_hf_directory: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code = flare("export", str(tiny_hf_directory), "-o", str(tmp_path / "pkg"), *argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith("flare export: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "pkg").exists()


def test_missing_source_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert flare("export", str(tmp_path / "missing.gguf"), "-o", str(tmp_path / "pkg")) == 1
    assert "does not exist; give a GGUF file" in capsys.readouterr().err


def test_a_package_as_source_is_named_a_package_with_the_command_that_serves_it(
    tmp_path: Path, tiny_hf_directory: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert flare("export", str(tiny_hf_directory), "-o", str(tmp_path / "pkg")) == 0
    capsys.readouterr()
    assert flare("export", str(tmp_path / "pkg"), "-o", str(tmp_path / "again")) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / 'pkg'} is a flare package, not a model" in err
    assert f"flare run {tmp_path / 'pkg'}" in err and err.count("\n") == 1
    assert not (tmp_path / "again").exists()


def test_existing_output_exits_1_and_overwrite_replaces_it(
    tmp_path: Path, tiny_hf_directory: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert flare("export", str(tiny_hf_directory), "-o", str(tmp_path / "pkg")) == 0
    assert flare("export", str(tiny_hf_directory), "-o", str(tmp_path / "pkg")) == 1
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert flare("export", str(tiny_hf_directory), "-o", str(tmp_path / "pkg"), "--overwrite", "--max-context", "128") == 0
    capsys.readouterr()
    assert flare("inspect", str(tmp_path / "pkg"), "--json") == 0
    assert json.loads(capsys.readouterr().out)["serving"]["max_context"] == 128


def test_inspect_exits_1_for_a_package_flare_run_would_refuse(
    make_package: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    package = make_package(serving={"vocabulary_parallel_sampling": True})
    assert flare("inspect", str(package)) == 1
    out = capsys.readouterr().out
    assert "problems              1" in out
    assert "re-export it: flare export SOURCE -o" in out


def test_export_quantize_says_the_block_types_and_a_conflicting_dtype_is_a_usage_error(
    tmp_path: Path, tiny_hf_directory: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert flare("export", str(tiny_hf_directory), "-o", str(tmp_path / "pkg"), "--quantize", "q4_k_m") == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out == (
        f"exported {tiny_hf_directory} to {tmp_path / 'pkg'} (recipe generic-llama, Q5_0 Q8_0 blocks, the rest dtype float32)\n"
    )
    code = flare("export", str(tiny_hf_directory), "-o", str(tmp_path / "other"), "--quantize", "q8_0", "--dtype", "float16")
    assert code == 2
    assert "cannot be combined with --dtype float16" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()
