"""The result of a run: one JSON document (the machine, versions, every setting, each level's
figures and requests) and the table printed at the end.

The JSON's top-level keys: `format` (RESULT_FORMAT), `label`, `started`, `finished` (UTC,
ISO 8601), `settings`, `machine`, `versions`, `server` (URL, model, whether it is flare, its
`Server` header) and `levels` (in the order run; each `LevelRun.to_json()`).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
from pathlib import Path
from typing import Any

RESULT_FORMAT = "flare-bench/1"
CPU_FLAGS = re.compile(r"^(avx2|avx512\w*|amx\w*|fma|f16c|avx_vnni|neon|asimd\w*|sve\w*)$")


def machine() -> dict[str, Any]:
    """What produced the figures: CPU model and the SIMD flags that matter, cores, memory, OS."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_model": None,
        "cpu_flags": [],
        "memory_bytes": None,
    }
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and info["cpu_model"] is None:
            info["cpu_model"] = value.strip()
        elif key in ("flags", "Features") and not info["cpu_flags"]:
            info["cpu_flags"] = sorted({f for f in value.split() if CPU_FLAGS.match(f)})
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["memory_bytes"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return info


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version()}
    for package in ("flare", "aiohttp"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found


def _ms(distribution: dict[str, Any], key: str) -> str:
    value = distribution.get(key)
    return "-" if value is None else f"{value * 1000:.0f}"


def _s(distribution: dict[str, Any], key: str) -> str:
    value = distribution.get(key)
    return "-" if value is None else f"{value:.2f}"


def level_name(level: dict[str, Any]) -> str:
    if level["mode"] == "concurrency":
        return f"c={level['concurrency']}"
    return f"rate={level['rate']:g}/s"


def format_table(result: dict[str, Any]) -> str:
    """The closing table: one line per level (latencies in ms, end-to-end in s)."""
    header = (
        f"{'level':>12} {'ok':>5} {'failed':>6} {'out tok/s':>9} {'req/s':>6} "
        f"{'TTFT p50':>8} {'p99':>6} {'ITL p50':>7} {'p99':>6} {'TPOT p50':>8} {'p99':>6} "
        f"{'E2E p50':>7} {'p99':>6} {'acc/round':>9}"
    )
    lines = [f"{result['label']}: {result['server']['model']} at {result['server']['url']}, {result['settings']['dataset']}", header]
    for level in result["levels"]:
        metrics = level.get("server_metrics") or {}
        accepted = metrics.get("accepted_per_round")
        lines.append(
            f"{level_name(level):>12} {level['completed']:>5} {level['failed']:>6} {level['output_tok_s']:>9.1f} "
            f"{level['req_s']:>6.2f} {_ms(level['ttft_s'], 'p50'):>8} {_ms(level['ttft_s'], 'p99'):>6} "
            f"{_ms(level['itl_s'], 'p50'):>7} {_ms(level['itl_s'], 'p99'):>6} {_ms(level['tpot_s'], 'p50'):>8} "
            f"{_ms(level['tpot_s'], 'p99'):>6} {_s(level['e2e_s'], 'p50'):>7} {_s(level['e2e_s'], 'p99'):>6} "
            f"{'-' if accepted is None else f'{accepted:.2f}':>9}"
        )
        for failure in level["failures"]:
            lines.append(
                f"{'':>12} failed: {failure['count']} x HTTP {failure['http_status'] or '-'} {failure['error_code']}"
            )
    return "\n".join(lines)
