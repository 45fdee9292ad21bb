"""PNG figures of one or several `flare bench` results, drawn on the same axes, one colour per label.

- `throughput.png`: output tokens/s and requests/s against concurrency (or rate)
- `latency.png`: TTFT, ITL, TPOT and end-to-end latency, p50 / p90 / p99, against the same
- `latency_cdf.png`: the distribution of TTFT, TPOT and end-to-end latency at each level

matplotlib is an optional dependency (`pip install 'flare[bench]'`); without it the command
says so instead of failing on an import.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flare.bench.report import RESULT_FORMAT, level_name

LATENCIES = (("ttft_s", "time to first token"), ("itl_s", "inter-token latency"),
             ("tpot_s", "time per output token"), ("e2e_s", "end-to-end latency"))
CDF_LATENCIES = (("ttft_s", "time to first token"), ("tpot_s", "time per output token"), ("e2e_s", "end-to-end latency"))
PERCENTILE_STYLES = (("p50", "-"), ("p90", "--"), ("p99", ":"))


class PlotError(Exception):
    """matplotlib missing, or result files that cannot be drawn together."""


def load_result(path: Path) -> dict[str, Any]:
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise PlotError(f"cannot read {path}: {error}") from None
    if not isinstance(result, dict) or result.get("format") != RESULT_FORMAT:
        raise PlotError(f"{path} is not a flare bench result ({RESULT_FORMAT})")
    return result


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise PlotError(
            "plots need matplotlib, which is not installed: pip install 'flare[bench]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _x(level: dict[str, Any]) -> float:
    return float(level["concurrency"] if level["mode"] == "concurrency" else level["rate"])


def _axis_label(results: list[dict[str, Any]]) -> str:
    modes = {level["mode"] for result in results for level in result["levels"]}
    if len(modes) > 1:
        raise PlotError("results at fixed concurrency and at a request rate cannot share an axis; plot them apart")
    return "concurrent requests" if modes == {"concurrency"} else "requests per second (Poisson arrivals)"


def write_plots(results: list[dict[str, Any]], out_dir: Path, *, title: str | None = None) -> list[Path]:
    """Draws the figures into `out_dir` (created) and returns their paths."""
    if not results or not any(result["levels"] for result in results):
        raise PlotError("nothing to plot: the results have no levels")
    plt = _pyplot()
    xlabel = _axis_label(results)
    ticks = sorted({_x(level) for result in results for level in result["levels"]})
    log_x = xlabel.startswith("concurrent") and ticks[-1] / ticks[0] >= 4  # 1, 8, 32 spread evenly
    out_dir.mkdir(parents=True, exist_ok=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    written = []

    def finish(figure: Any, name: str) -> None:
        if title:
            figure.suptitle(title)
        figure.tight_layout()
        path = out_dir / name
        figure.savefig(path, dpi=80)
        plt.close(figure)
        written.append(path)

    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for i, result in enumerate(results):
        levels = sorted(result["levels"], key=_x)
        xs = [_x(level) for level in levels]
        colour = colours[i % len(colours)]
        axes[0].plot(xs, [level["output_tok_s"] for level in levels], "o-", color=colour, label=result["label"])
        axes[1].plot(xs, [level["req_s"] for level in levels], "o-", color=colour, label=result["label"])
    for ax, ylabel in zip(axes, ("output tokens/s", "requests/s")):
        _style(ax, xlabel, ylabel, ticks if log_x else None)
    finish(figure, "throughput.png")

    figure, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, name) in zip(axes.flat, LATENCIES):
        for i, result in enumerate(results):
            levels = sorted(result["levels"], key=_x)
            for percentile, style in PERCENTILE_STYLES:
                points = [(_x(level), level[key][percentile]) for level in levels if level[key][percentile] is not None]
                if points:
                    ax.plot(*zip(*points), style, marker="o", markersize=3, color=colours[i % len(colours)],
                            label=f"{result['label']} {percentile}")
        _style(ax, xlabel, f"{name} (s)", ticks if log_x else None)
    finish(figure, "latency.png")

    figure, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, (key, name) in zip(axes, CDF_LATENCIES):
        for i, result in enumerate(results):
            levels = sorted(result["levels"], key=_x)
            for j, level in enumerate(levels):
                values = sorted(r[key] for r in level["records"] if r["ok"] and r[key] is not None)
                if values:
                    shares = [(k + 1) / len(values) for k in range(len(values))]
                    ax.step(values, shares, where="post", color=colours[i % len(colours)],
                            alpha=0.35 + 0.65 * (j + 1) / len(levels), label=f"{result['label']} {level_name(level)}")
        ax.set_xlabel(f"{name} (s)")
        ax.set_ylabel("share of requests")
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=6)
    finish(figure, "latency_cdf.png")
    return written


def _style(ax: Any, xlabel: str, ylabel: str, log_ticks: list[float] | None) -> None:
    if log_ticks:
        ax.set_xscale("log", base=2)
        ax.set_xticks(log_ticks, [f"{t:g}" for t in log_ticks])
        ax.minorticks_off()
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.has_data():
        ax.legend(fontsize=7)
