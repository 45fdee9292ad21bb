"""What `flare bench` and `flare bench plot` run (their options: cli.py): measure a server, and
draw saved results together.

Nothing here imports the daemon, the scheduler or the engine: the benchmark is a client of any
OpenAI-compatible server.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import anyio

from flare.bench.client import Endpoint
from flare.bench.datasets import DatasetError, load_dataset
from flare.bench.load import Level, LoadGenerator, LoadSettings
from flare.bench.plot import PlotError, load_result, write_plots
from flare.bench.report import RESULT_FORMAT, format_table, machine, versions
from flare.bench.server_metrics import read_snapshot

EXIT_USAGE = 2
EXIT_FAILED = 1


class BenchError(Exception):
    """A run that cannot start or finish: the message is the one line the operator sees."""


def _usage(message: str) -> int:
    print(f"flare bench: error: {message} (see flare bench --help)", file=sys.stderr)
    return EXIT_USAGE


def _positive_list(text: str, option: str, kind: Callable[[str], float]) -> list[Any]:
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise BenchError(f"{option} takes a comma-separated list of positive numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise BenchError(f"{option} takes a comma-separated list of positive numbers, got {text!r}")
    return values


def _levels(args: argparse.Namespace) -> list[Level]:
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise BenchError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    if args.rate is not None:
        return [Level(rate=r, max_concurrency=args.max_concurrency) for r in _positive_list(args.rate, "--rate", float)]
    if args.max_concurrency is not None:
        raise BenchError("--max-concurrency applies to --rate; with --concurrency the level is the concurrency")
    return [Level(concurrency=c) for c in _positive_list(args.concurrency or "1", "--concurrency", int)]


def _extra_body(text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError as error:
        raise BenchError(f"--extra-body is not JSON: {error}") from None
    if not isinstance(value, dict):
        raise BenchError("--extra-body must be a JSON object of request fields")
    reserved = sorted(set(value) & {"messages", "model", "stream", "stream_options"})
    if reserved:
        raise BenchError(f"--extra-body may not set {reserved[0]!r}: the benchmark sends it")
    return value


def _token_counter(path: str | None) -> Callable[[str], int] | None:
    if path is None:
        return None
    from tokenizers import Tokenizer

    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as error:  # tokenizers raises its own exception types for a bad file
        raise BenchError(f"--tokenizer {path}: cannot load a tokenizer.json ({error})") from None
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


def _check_numbers(args: argparse.Namespace) -> None:
    for option, value, least in (("--requests", args.requests, 0), ("--warmup", args.warmup, 0), ("--max-tokens", args.max_tokens, 1)):
        if value < least:
            raise BenchError(f"{option} must be at least {least}, got {value}")
    for option, value in (("--duration", args.duration), ("--timeout", args.timeout)):
        if value is not None and value <= 0:
            raise BenchError(f"{option} must be positive, got {value}")
    if args.requests == 0 and args.duration is None:
        raise BenchError("--requests 0 leaves a level unbounded: give --duration too")


def bench_command(args: argparse.Namespace) -> int:
    if args.url is None:
        return _usage("--url is required (the server's base URL, e.g. http://127.0.0.1:8000)")
    try:
        _check_numbers(args)
        levels = _levels(args)
        conversations = load_dataset(args.dataset)
        extra_body = _extra_body(args.extra_body)
        count_tokens = _token_counter(args.tokenizer)
    except (BenchError, DatasetError) as error:
        return _usage(str(error))
    try:
        result = anyio.run(_run, args, levels, conversations, extra_body, count_tokens)
    except BenchError as error:
        print(f"flare bench: error: {error}", file=sys.stderr)
        return EXIT_FAILED
    print(format_table(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"result written to {args.out}")
    if args.plot:
        try:
            for path in write_plots([result], Path(args.plot)):
                print(f"plot written to {path}")
        except PlotError as error:
            print(f"flare bench: error: {error}", file=sys.stderr)
            return EXIT_FAILED
    if not any(level["completed"] for level in result["levels"]):
        print("flare bench: error: no request completed; see the failures above", file=sys.stderr)
        return EXIT_FAILED
    return 0


async def _server_models(session: aiohttp.ClientSession, endpoint: Endpoint) -> tuple[list[str], str | None]:
    """The model ids /v1/models lists and the `Server` header (empty and None when unreadable)."""
    try:
        async with session.get(
            f"{endpoint.url}/v1/models", headers=endpoint.headers(), timeout=aiohttp.ClientTimeout(total=30)
        ) as response:
            server = response.headers.get("Server")
            if response.status != 200:
                return [], server
            body = await response.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ConnectionError, ValueError):
        return [], None
    data = body.get("data") if isinstance(body, dict) else None
    ids = [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)] if isinstance(data, list) else []
    return ids, server


async def _run(
    args: argparse.Namespace,
    levels: list[Level],
    conversations: tuple[Any, ...],
    extra_body: dict[str, Any],
    count_tokens: Callable[[str], int] | None,
) -> dict[str, Any]:
    started = datetime.now(UTC)
    url = args.url.rstrip("/").removesuffix("/v1")
    # No pool limit: the load decides how many connections are open, not the client library.
    # A connection per request (as vLLM's benchmark makes them): a server that closes idle
    # keep-alive connections (llama.cpp's does) would otherwise fail the next request sent on
    # one, a client-side artefact counted against the server. Loopback connects in microseconds.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        models, server_header = await _server_models(session, Endpoint(url, "", args.api_key))
        model = args.model or (models[0] if models else None)
        if model is None:
            raise BenchError(f"{url}/v1/models listed no model (is the server up?); pass --model")
        endpoint = Endpoint(url, model, args.api_key)
        is_flare = await read_snapshot(session, endpoint) is not None
        settings = LoadSettings(
            endpoint=endpoint,
            conversations=conversations,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=args.seed,
            extra_body=extra_body,
            requests=args.requests or None,
            duration_s=args.duration,
            warmup=args.warmup,
            timeout_s=args.timeout,
            count_tokens=count_tokens,
        )
        generator = LoadGenerator(session, settings)
        await generator.warm_up(min(args.warmup, max(level.concurrency or 1 for level in levels)))
        runs = [await generator.run_level(level) for level in levels]
    return {
        "format": RESULT_FORMAT,
        "label": args.label or model,
        "started": started.isoformat(timespec="seconds"),
        "finished": datetime.now(UTC).isoformat(timespec="seconds"),
        "settings": _settings(args),
        "machine": machine(),
        "versions": versions(),
        "server": {"url": url, "model": model, "models": models, "is_flare": is_flare, "server_header": server_header},
        "levels": [run.to_json() for run in runs],
    }


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """Every option as given or defaulted, the API key left out."""
    skip = {"func", "bench_command", "api_key", "command"}
    settings = {key: value for key, value in vars(args).items() if key not in skip}
    settings["api_key_given"] = args.api_key is not None
    return settings


def plot_command(args: argparse.Namespace) -> int:
    try:
        results = [load_result(Path(path)) for path in args.results]
        written = write_plots(results, Path(args.out), title=args.title)
    except PlotError as error:
        print(f"flare bench plot: error: {error}", file=sys.stderr)
        return EXIT_FAILED
    for path in written:
        print(f"plot written to {path}")
    return 0
