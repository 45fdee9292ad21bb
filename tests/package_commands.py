"""`flare export` and `flare inspect` as the command line runs them, for tests."""

from __future__ import annotations

import argparse

from flare.cli.package_commands import add_export_parser, add_inspect_parser


def flare(*argv: str) -> int:
    """The exit status of `flare ARGV...` (export or inspect), run in this process."""
    parser = argparse.ArgumentParser(prog="flare")
    subparsers = parser.add_subparsers(required=True)
    add_export_parser(subparsers)
    add_inspect_parser(subparsers)
    args = parser.parse_args(argv)
    return args.func(args)
