"""`flare export` and `flare inspect` as the command line runs them, for tests."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import pytest

from flare.cli.package_commands import add_export_parser, add_inspect_parser


def flare(*argv: str) -> int:
    """The exit status of `flare ARGV...` (export or inspect), run in this process."""
    parser = argparse.ArgumentParser(prog="flare")
    subparsers = parser.add_subparsers(required=True)
    add_export_parser(subparsers)
    add_inspect_parser(subparsers)
    args = parser.parse_args(argv)
    return args.func(args)


def flare_printed(capsys: pytest.CaptureFixture[str], *argv: str) -> subprocess.CompletedProcess[str]:
    """`flare ARGV...` (export or inspect) in this process, as a finished command: its exit status
    and what it printed on stdout and stderr."""
    capsys.readouterr()
    code = flare(*argv)
    printed = capsys.readouterr()
    return subprocess.CompletedProcess(["flare", *argv], code, printed.out, printed.err)


def export_printed(capsys: pytest.CaptureFixture[str], source: Path, out: Path) -> subprocess.CompletedProcess[str]:
    """`flare export SOURCE -o OUT` in this process (`flare_printed`)."""
    return flare_printed(capsys, "export", str(source), "-o", str(out))
