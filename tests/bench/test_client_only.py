"""The benchmark is a client: it imports nothing of flare outside flare/bench, so it measures any
server as users see it and never loads torch, the scheduler or the engine."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import flare.bench

BENCH = Path(flare.bench.__file__).parent


def test_bench_modules_import_only_the_bench_folder_of_flare() -> None:
    outside = []
    for path in sorted(BENCH.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            )
            outside += [f"{path.name}: {n}" for n in names if n.startswith("flare") and not n.startswith("flare.bench")]
    assert outside == []


def test_flare_bench_starts_without_torch() -> None:
    code = "import sys, flare.cli.main as c; c.build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=BENCH.parents[1], check=True)
    assert out.stdout.strip() == "False"
