"""The `flare` command: `run` (this file), `export` and `inspect` (package_commands.py), `ctl` (ctl.py),
`bench` (flare/bench/cli.py, a client of any OpenAI-compatible server).

Each subcommand is registered by an `add_*_parser(subparsers)` function in COMMANDS, which
sets `func` (namespace -> exit code) on its parser. Bad usage prints one line on stderr, naming
the option and the fix, and exits 2; never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from flare.bench.cli import add_bench_parser
from flare.cli.ctl import add_ctl_parser
from flare.cli.package_commands import add_export_parser, add_inspect_parser
from flare.daemon.config import CONFIG_ENV, ConfigError, load_config
from flare.engine.openmp import set_wait_policy
from flare.package.manifest import ACTIVATION_CHOICES, KV_CACHE_DTYPES, WEIGHT_FORMATS

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `flare run: error: ... (see flare run --help)`."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_run_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "run",
        help="serve a package over the OpenAI-compatible HTTP API",
        description=(
            "Serve a prepared package (or, without PACKAGE, the default model, exported once into the cache). "
            "Settings come from these flags, then FLARE_* environment variables (FLARE_PORT, FLARE_KV_CACHE_MEMORY, "
            "FLARE_API_KEYS=k1,k2, ...), then the TOML file of --config (keys named like the flags, with "
            "underscores), then the defaults."
        ),
    )
    # Every default is None, so load_config can tell a flag that was given from one that was not.
    parser.set_defaults(func=run_command)
    add = parser.add_argument
    add("package", nargs="?", metavar="PACKAGE", help="the package directory (default: the default model)")
    add("--config", metavar="PATH", help=f"a TOML file of settings (default: ${CONFIG_ENV})")
    add("--host", help="the address to listen on (default 127.0.0.1)")
    add("--port", metavar="N", help="the TCP port (default 8000; 0 picks a free one, logged in the 'listening' event)")
    add("--served-model-name", metavar="NAME", nargs="+",
        help="the model names clients send, all listed by /v1/models (default: the name recorded in the package)")
    add("--accept-any-model-name", action="store_const", const=True,
        help="answer a request naming any model with this package; the answer echoes the name asked for and "
        "its flare object says it was mapped (off by default: another name is a 404)")
    add("--kv-cache-memory", metavar="SIZE",
        help='memory for the KV cache, e.g. "2GiB" or "512MiB" (default: sized for max_concurrency full contexts)')
    add("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
        help="what the KV cache stores keys and values as: float32 (default, exact), or float16 / bfloat16 "
        "(twice the tokens in the same memory; attention still computes in float32)")
    add("--max-concurrency", metavar="N",
        help="requests run at once (default and maximum: the package's serving.max_concurrency)")
    add("--max-waiting", metavar="N", help="requests queued beyond those; past it, 429 (default 256)")
    add("--max-batched-tokens", metavar="N",
        help="tokens fed per round: one per decoding stream, the rest prompt chunks (default 256)")
    add("--oldest-prefill-share", metavar="N",
        help="of those, what the oldest prompt still prefilling keeps each round while shorter prompts go "
        "first (default 64; max-batched-tokens: the oldest takes every round it can)")
    add("--prefix-cache", choices=("on", "off"),
        help="keep computed KV blocks for later prompts that start the same way (default on)")
    add("--prefix-cache-across-keys", choices=("on", "off"),
        help="let requests of different API keys share cached prompt blocks (default off: a key could "
        "learn another's prompts from cache hits; docs/operations.md)")
    add("--draft-tokens", metavar="N",
        help="speculative draft tokens per round; may only lower the package's (0 turns speculation off)")
    add("--drafter", choices=("ngram", "mtp", "auto"),
        help="the draft proposer: ngram (prompt lookup), mtp (the package's learned draft head) or auto "
        "(the head where the package ships one, else ngram); default: the package's serving.drafter")
    add("--draft-length", choices=("adaptive", "fixed"),
        help="adaptive (default): shorten or pause a row's drafts where the measured round costs say a "
        "draft costs about what it saves; fixed: every decoding stream verifies all the drafter proposes, "
        "up to --draft-tokens")
    add("--vocabulary-shards", metavar="S", help="shards of the vocabulary-parallel sampler (default 1)")
    add("--tensor-parallel", metavar="N",
        help="split the model over N processes on this host (heads, MLP, LM head by vocabulary); "
        "N must divide the heads and KV heads (default 1)")
    add("--nnodes", metavar="M", help="hosts the --tensor-parallel ranks are spread over (default 1)")
    add("--node-rank", metavar="K", help="this host among them: 0 serves the API, K > 0 runs headless (default 0)")
    add("--master-addr", metavar="HOST", help="rank 0's host, reached over a private network (default 127.0.0.1)")
    add("--master-port", metavar="P", help="the rendezvous port on rank 0's host (default 0: a free one, one host only)")
    add("--tensor-parallel-cpus", metavar="LISTS",
        help='CPU lists of this host\'s ranks, e.g. "0-15|16-31" (one per rank, as VLLM_CPU_OMP_THREADS_BIND); '
        "default: this process's CPUs cut into equal runs")
    add("--collective-timeout-s", metavar="SECONDS",
        help="a collective inside a round waits this long for a peer before the group fails (default 60)")
    add("--sampling-policy", choices=("package", "unfiltered"),
        help="serve the package's policy, or its unfiltered() form (default package)")
    add("--on-invalid-speculation", choices=("fallback", "fail"),
        help="retry a row without drafts, or fail the request (default fallback)")
    add("--fault-injection", action="store_const", const=True,
        help="honour the X-Flare-Fault test header (off by default)")
    add("--device", metavar="DEVICE", help="auto, cpu, cuda or cuda:N (default auto)")
    add("--weight-format", choices=WEIGHT_FORMATS,
        help="what the linear layers multiply in: auto (default) picks the fastest this CPU runs for the "
        "package's weights (float16 on x86 with AVX2, AMX CPUs included, float32 elsewhere); bfloat16 runs "
        "where the CPU has AVX512-BF16 or AMX (AMX computes long prompts faster, decodes slower)")
    add("--activations", choices=ACTIVATION_CHOICES,
        help="what ggml block weights multiply: float32 (exact) or 8-bit activation blocks with integer dot "
        "products, int8x2 (two a 32 activations, about 15 bits) or int8 (one, llama.cpp's Q8_0, coarser); "
        "auto (default): int8x2 for K-quant blocks (Q4_K, Q5_K, Q6_K) and for 32-value blocks of 512 MiB or "
        "more (a 1B model's Q8_0 or Q4_0), float32 otherwise")
    add("--log-level", choices=("debug", "info", "warning", "error"), help="default info")
    add("--log-format", choices=("auto", "json", "console"),
        help="default auto: console on a terminal, JSON lines otherwise")
    add("--api-key", action="append", metavar="KEY", help="require 'Authorization: Bearer KEY' (repeatable)")
    add("--api-key-file", metavar="PATH", help="a file with one API key a line")
    add("--metrics-require-key", action="store_const", const=True, help="require an API key for /metrics too")
    add("--control-socket", metavar="PATH", help="the UNIX socket of `flare ctl`")
    add("--drain-grace-s", metavar="SECONDS", help="on SIGTERM, how long requests in flight may finish (default 30)")
    add("--max-body-bytes", metavar="SIZE", help="the largest request body; larger ones get 413 (default 1MiB)")
    add("--request-timeout-s", metavar="SECONDS",
        help='a request running longer ends with a 504 error (default 600; "none": no limit)')
    add("--stream-keepalive-s", metavar="SECONDS",
        help="a stream with no output for this long gets a keep-alive event (default 15)")
    add("--max-connections", metavar="N",
        help="open HTTP connections at most; more are refused with 503 (default 1024)")
    add("--header-timeout-s", metavar="SECONDS",
        help="a request head must arrive whole within this, else 408 and close (default 10)")
    add("--keepalive-timeout-s", metavar="SECONDS", help="an idle connection is closed after this (default 75)")
    add("--write-timeout-s", metavar="SECONDS",
        help="a client that reads nothing for this long has its request cancelled (default 30)")
    add("--max-header-bytes", metavar="SIZE", help="the largest request head; larger ones get 431 (default 32KiB)")
    add("--allowed-origins", metavar="ORIGINS",
        help='browser origins allowed to call the API, comma-separated ("https://app.example,http://localhost:*", '
        '"*" for any; default none)')
    add("--allowed-hosts", metavar="NAMES",
        help="Host names accepted besides loopback's own while listening on loopback, comma-separated (default none)")
    add("--allow-special-tokens-in-messages", action="store_const", const=True,
        help="read special-token text in chat messages as control tokens (default: it stays text)")
    add("--cache-dir", metavar="PATH",
        help="where the default model's package is exported (default $FLARE_CACHE_DIR or ~/.cache/flare)")
    add("--state-dir", metavar="PATH",
        help="what the daemon keeps across restarts, the stored Responses (default $STATE_DIRECTORY, "
        "else $XDG_STATE_HOME/flare or ~/.local/state/flare)")
    add("--responses-store", choices=("on", "off"),
        help="keep Responses of store: true (OpenAI's default) for previous_response_id and GET "
        "/v1/responses/{id} (default on)")
    add("--responses-store-max-age-s", metavar="SECONDS",
        help="stored responses older than this are deleted (default 2592000, 30 days)")
    add("--responses-store-max-bytes", metavar="SIZE",
        help='past this size the oldest stored responses are deleted (default "1GiB")')
    return parser


# The subcommands, in the order `flare --help` lists them.
COMMANDS: tuple[Callable[[Any], argparse.ArgumentParser], ...] = (
    add_run_parser,
    add_export_parser,
    add_inspect_parser,
    add_ctl_parser,
    add_bench_parser,
)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="flare", description="Serve prepared LLM packages over an OpenAI-compatible API.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    for add_parser in COMMANDS:
        add_parser(subparsers)
    return parser


def _is_directory(path: Path) -> bool:
    """Whether `path` names a directory; a name the filesystem cannot even look up (too long, a
    NUL byte) names none, rather than raising."""
    try:
        return path.is_dir()
    except (OSError, ValueError):
        return False


def run_command(args: argparse.Namespace) -> int:
    try:
        config = load_config(args, os.environ)
    except ConfigError as error:
        return _usage_error(f"flare run: error: {error}")
    if config.package is not None and not _is_directory(config.package):
        return _usage_error(
            f"flare run: error: PACKAGE {config.package} is not a directory; "
            "pass a package made by `flare export`, or no PACKAGE for the default model"
        )
    # --served-model-name takes every name after it (as vLLM's does), so a PACKAGE written after
    # it would be taken for a name and the default model served under it.
    misplaced = [name for name in args.served_model_name or () if _is_directory(Path(name))]
    if args.package is None and misplaced:
        return _usage_error(
            f"flare run: error: --served-model-name {misplaced[0]!r} is a directory; put PACKAGE before "
            "--served-model-name, which takes every name after it"
        )
    # Read once, when torch loads OpenMP, so set before the import; see flare/engine/openmp.py.
    set_wait_policy(os.environ)
    # Imported only now: the server pulls in torch and the engine, which a usage error, export,
    # inspect and ctl do not need.
    from flare.daemon.lifecycle import StartupError, serve
    from flare.parallel.failstop import EngineDead

    if config.node_rank > 0:
        return _run_headless(config)
    try:
        serve(config, reload_config=lambda: load_config(args, os.environ))
    except StartupError as error:
        return _usage_error(f"flare run: error: {error}")
    except EngineDead as error:
        # A tensor-parallel rank was lost: non-zero, so that Restart=on-failure restarts the group.
        print(f"flare run: error: {error}", file=sys.stderr)
        return 1
    return 0


def _run_headless(config: Any) -> int:
    """`flare run --node-rank K` with K > 0: this host's tensor-parallel ranks, no API."""
    from flare.daemon.logging import configure_logging
    from flare.parallel.launch import WorkerStartError
    from flare.parallel.layout import ParallelLayout
    from flare.parallel.serving import serve_headless
    from flare.preparation.default_package import default_package_path

    configure_logging(config.log_level, config.log_format, environ=os.environ)
    try:
        layout = ParallelLayout(
            config.tensor_parallel, config.nnodes, config.node_rank, config.master_addr, config.master_port
        )
    except ValueError as error:
        return _usage_error(f"flare run: error: {error}")
    package = config.package if config.package is not None else default_package_path(config.cache_dir)
    try:
        return serve_headless(
            str(package), layout, config.weight_format, config.activations, config.tensor_parallel_cpus,
            config.collective_timeout_s,
        )
    except WorkerStartError as error:
        print(f"flare run: error: {error}", file=sys.stderr)
        return 1


def _usage_error(line: str) -> int:
    print(line, file=sys.stderr)
    return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`flare ctl status | head`): not an error of ours. Point stdout at
        # /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
