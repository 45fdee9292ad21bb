"""`flare bench` (measure a server) and `flare bench plot` (draw saved results together): their
options. The daemon's command line registers them (`add_bench_parser`); what they run is in
command.py, imported only when they run: its HTTP client, load generator and statistics take
0.3 s to import, which every `flare run` and `flare ctl` would otherwise pay at start.
"""

from __future__ import annotations

import argparse
from typing import Any

from flare.bench.datasets import SHIPPED


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "bench",
        help="benchmark flare or any OpenAI-compatible server (throughput, latency percentiles, plots)",
        description=(
            "Drive an OpenAI-compatible /v1/chat/completions endpoint with streaming requests at fixed "
            "concurrency levels (--concurrency 1,8,32) or Poisson arrivals (--rate 0.5,1,2), after a warm-up; "
            "each level is bounded by --requests and --duration. Prints a table, writes the whole result as "
            "JSON (--out) and figures (--plot DIR). `flare bench plot A.json B.json ...` draws saved results "
            "together, one line per --label."
        ),
    )
    parser.set_defaults(func=_bench_command)
    add = parser.add_argument
    add("--url", help="the server's base URL, without /v1 (e.g. http://127.0.0.1:8000)")
    add("--model", help="the model name to send (default: the first one /v1/models lists)")
    add("--api-key", metavar="KEY", help="sent as 'Authorization: Bearer KEY' (also to /metrics)")
    add("--dataset", default="chat", metavar="NAME|FILE.jsonl",
        help=f"one of {', '.join(SHIPPED)}, or a JSONL file (default chat; see flare/bench/datasets.py)")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", metavar="N[,N...]", help="fixed numbers of clients, one level each (default 1)")
    load.add_argument("--rate", metavar="R[,R...]", help="Poisson arrival rates in requests/s, one level each")
    add("--max-concurrency", type=int, metavar="N", help="with --rate: at most N requests in flight (default unlimited)")
    add("--requests", type=int, default=64, metavar="N",
        help="requests started per level (default 64; 0: no count bound, --duration must be given)")
    add("--duration", type=float, metavar="S", help="seconds per level after which no request starts (default: no time bound)")
    add("--warmup", type=int, default=2, metavar="N", help="requests sent before the first level, not measured (default 2)")
    add("--max-tokens", type=int, default=128, metavar="N", help="max_tokens of each request (default 128)")
    add("--temperature", type=float, metavar="T", help="the requests' temperature (default: the server's)")
    add("--seed", type=int, default=0, metavar="S",
        help="seeds the prompt order and the arrivals; request seeds are derived from it (default 0)")
    add("--extra-body", metavar="JSON", help='more request fields, e.g. \'{"top_p": 0.9}\'')
    add("--timeout", type=float, default=600.0, metavar="S", help="a request not answered in full by then fails (default 600)")
    add("--tokenizer", metavar="PATH",
        help="a tokenizer.json (or a flare package) to count output tokens when the server reports no usage")
    add("--out", metavar="FILE", help="write the whole result as JSON here")
    add("--plot", metavar="DIR", help="write PNG figures here (needs matplotlib: pip install 'flare[bench]')")
    add("--label", metavar="NAME", help="this run's name in tables and plots (default: the model name)")

    commands = parser.add_subparsers(dest="bench_command", metavar="plot")
    plot = commands.add_parser(
        "plot",
        help="draw saved `flare bench` results on the same axes",
        description="Draw one or several `flare bench --out` results on the same axes, one line per label.",
    )
    plot.set_defaults(func=_plot_command)
    plot.add_argument("results", nargs="+", metavar="RESULT.json")
    plot.add_argument("--out", default="bench-plots", metavar="DIR", help="where the PNG files go (default bench-plots)")
    plot.add_argument("--title", help="a title over every figure")
    return parser


def _bench_command(args: argparse.Namespace) -> int:
    from flare.bench.command import bench_command

    return bench_command(args)


def _plot_command(args: argparse.Namespace) -> int:
    from flare.bench.command import plot_command

    return plot_command(args)
