"""The `flare` command line: subcommands, and usage errors as one line on stderr with exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flare.cli.main import build_parser, main


def test_flare_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert all(command in out for command in ("run", "export", "inspect", "ctl"))


def test_run_flags_are_none_unless_given() -> None:
    args = build_parser().parse_args(["run"])
    assert args.port is None and args.fault_injection is None and args.api_key is None
    args = build_parser().parse_args(["run", "pkg", "--port", "0", "--fault-injection", "--api-key", "a", "--api-key", "b"])
    assert (args.package, args.port, args.fault_injection, args.api_key) == ("pkg", "0", True, ["a", "b"])
    assert build_parser().parse_args(["run", "--draft-length", "fixed"]).draft_length == "fixed"


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["run", "--port", "eighty"], ("--port", "integer")),
        (["run", "--kv-cache-memory", "lots"], ("--kv-cache-memory", "GiB")),
        (["run", "--log-level", "loud"], ("--log-level", "debug")),
        (["run", "--sampling-policy", "loose"], ("--sampling-policy", "unfiltered")),
        (["run", "--draft-length", "short"], ("--draft-length", "adaptive", "fixed")),
        (["run", "--no-such-flag"], ("--no-such-flag",)),
        (["nothing"], ("nothing", "run")),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(
    argv: list[str], names: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(argv)
    except SystemExit as exited:
        code = exited.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert all(name in err for name in names), err


def test_missing_package_directory_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err
    assert "is not a directory" in err and "flare export" in err


def test_served_model_names_take_every_name_after_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["run", "pkg", "--served-model-name", "smol", "gpt-4o", "--accept-any-model-name"])
    assert (args.package, args.served_model_name, args.accept_any_model_name) == ("pkg", ["smol", "gpt-4o"], True)
    # A package written after the names would be served as the default model's name: refused.
    assert main(["run", "--served-model-name", "smol", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "put PACKAGE before --served-model-name" in err and err.count("\n") == 1


def test_a_package_path_too_long_for_the_filesystem_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    # The filesystem refuses to look such a name up (ENAMETOOLONG): it names no directory.
    assert main(["run", "m" * 5000]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_config_file_errors_reach_the_user_without_traceback(tmp_path: Path) -> None:
    config = tmp_path / "flare.toml"
    config.write_text("prot = 80\n")
    done = subprocess.run(
        [sys.executable, "-m", "flare.cli.main", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "unknown key(s) prot" in done.stderr and "Traceback" not in done.stderr
