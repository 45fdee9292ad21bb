"""Prefix caching and parallel choices: two daemons, `--prefix-cache on` and `off`, side by side.

    .venv/bin/python benchmarks/prefix_cache.py                  # every workload
    .venv/bin/python benchmarks/prefix_cache.py --workloads chat agent
    .venv/bin/python benchmarks/prefix_cache.py --json out.json

Both daemons serve the same package (default: the default model's) and run at once; every
request goes to one side, then the same request to the other, the side that goes first
alternating, so machine noise falls on both alike. Workloads:

- chat: multi-turn conversations where each turn resends the whole history (long user turns,
  the model's own greedy answers), growing to about --chat-tokens prompt tokens. Time to first
  token per turn on each side; the figure is the median ratio over the later turns (prompt past
  half of --chat-tokens).
- agent: one long shared system prompt (a tool catalogue of about --agent-tokens tokens) and a
  different short task per call. Time to first token per call; the figure is the median ratio
  over every call after the first.
- distinct: no shared prefixes at all (completions of prompts that differ from their first
  token), --streams at once: aggregate generated tokens/s on each side, median of --repeats;
  this is what the cache's bookkeeping costs.
- bookkeeping: the distinct workload in-process (the scheduler without HTTP, cache on, under
  cProfile): seconds spent in the prefix cache's code (flare/engine/prefix_cache.py and the
  scheduler's publishing and lookup) against the run's wall time. On a shared machine an A/B
  of throughput cannot resolve a cost under a few percent; this measures it directly.
- choices: one prompt with n = 4 against four separate requests sent at once (cache off, so
  each computes its prompt): wall time, and the prompt tokens computed by each from the
  daemon's flare_prompt_tokens_total.
- burst: --streams requests sent at once, each a different short task after one system prompt
  of about --agent-tokens tokens that neither side has seen (a new one each repeat): the
  burst's wall time and the prompt tokens each side computed (flare_prompt_tokens_total), median
  of --repeats. All are admitted before any of the system prompt is cached; with the cache on,
  the prompts waiting for their prefill take its blocks as the first prompt computes them.

Every answer is greedy (choices: temperature 0.8 with a seed), and the script checks that the
two sides' greedy answers are identical.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# The checkout this script is in, not whichever flare is installed (the daemons run from the
# working directory, which must be the same checkout), and benchmarks/compare.py's helpers.
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from compare import free_port, server_process  # noqa: E402  (a server subprocess, healthy on entry)


@contextlib.contextmanager
def flare_daemon(package: Path, threads: int, extra: list[str]) -> Iterator[str]:
    """`flare run PACKAGE` on a free port with `extra` flags; yields its base URL."""
    url = f"http://127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "flare.cli.main", "run", str(package), "--port", url.rsplit(":", 1)[1],
               "--log-level", "warning", *extra]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    with tempfile.TemporaryDirectory() as logs, server_process(command, env, "flare run", url, Path(logs) / "flare.log"):
        yield url


def metric(base_url: str, name: str) -> float:
    """One unlabelled sample of a daemon's /metrics (NaN when it cannot be read, 0 when absent)."""
    try:
        with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
            lines = response.read().decode().splitlines()
    except OSError:
        return float("nan")
    return next((float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + " ")), 0.0)

WORDS = (
    "harbour lantern copper meadow granite orchard velvet compass thunder willow amber canyon "
    "ember falcon glacier hollow ivory jasmine kettle lagoon marble nectar oasis pepper quartz "
    "raven saffron tundra umber violet walnut yarrow zephyr anchor bramble cedar dune fjord"
).split()


def paragraph(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


async def first_token(client: Any, model: str, max_tokens: int, **request: Any) -> tuple[float, str, int]:
    """Time to the first content token, the whole answer, and its cached prompt tokens."""
    started = time.perf_counter()
    ttft = None
    text = []
    cached = 0
    stream = await client.chat.completions.create(
        model=model, max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True}, **request
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - started
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
    return (ttft if ttft is not None else time.perf_counter() - started), "".join(text), cached


async def alternated(clients: dict[str, Any], model: str, turn: int, max_tokens: int, **request: Any) -> dict[str, tuple]:
    """The request on both sides, the one that goes first alternating with `turn`."""
    order = ["on", "off"] if turn % 2 == 0 else ["off", "on"]
    return {side: await first_token(clients[side], model, max_tokens, **request) for side in order}


def prompt_tokens(clients_tokenizer: Any, messages: list[dict[str, str]]) -> int:
    return len(clients_tokenizer.encode_chat(messages))


async def chat_workload(clients: dict[str, Any], model: str, tokenizer: Any, args: argparse.Namespace) -> dict[str, Any]:
    turns: list[dict[str, Any]] = []
    for conversation in range(args.conversations):
        rng = random.Random(conversation)
        messages = [{"role": "system", "content": "You are a helpful assistant. Answer in a few sentences."}]
        turn = 0
        while True:
            messages.append({"role": "user", "content": f"Here are my notes: {paragraph(rng, 60)} What do they describe?"})
            length = prompt_tokens(tokenizer, messages)
            if length > args.chat_tokens:
                break
            result = await alternated(clients, model, conversation + turn, args.answer_tokens, messages=messages)
            (on_ttft, on_text, cached), (off_ttft, off_text, _) = result["on"], result["off"]
            turns.append({"conversation": conversation, "turn": turn, "prompt_tokens": length, "cached_tokens": cached,
                          "ttft_on_s": on_ttft, "ttft_off_s": off_ttft, "same_answer": on_text == off_text})
            print(f"  chat {conversation} turn {turn}: {length} prompt tokens ({cached} cached), "
                  f"TTFT on {on_ttft:.3f} s, off {off_ttft:.3f} s, {off_ttft / on_ttft:.1f}x", flush=True)
            messages.append({"role": "assistant", "content": on_text})
            turn += 1
    later = [t for t in turns if t["prompt_tokens"] > args.chat_tokens / 2]
    cold = [t for t in turns if t["turn"] == 0]
    return {
        "turns": turns,
        "first_turn_ratio": statistics.median(t["ttft_off_s"] / t["ttft_on_s"] for t in cold),
        "later_turns": len(later),
        "median_ttft_on_s": statistics.median(t["ttft_on_s"] for t in later),
        "median_ttft_off_s": statistics.median(t["ttft_off_s"] for t in later),
        "median_ratio": statistics.median(t["ttft_off_s"] / t["ttft_on_s"] for t in later),
        "answers_identical": all(t["same_answer"] for t in turns),
    }


async def agent_workload(clients: dict[str, Any], model: str, tokenizer: Any, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(7)
    tools = []
    while prompt_tokens(tokenizer, [{"role": "system", "content": "\n".join(tools)}]) < args.agent_tokens:
        name = f"{rng.choice(WORDS)}_{rng.choice(WORDS)}"
        tools.append(f"Tool {name}(query: string, limit: integer): {paragraph(rng, 25)} Returns a JSON list.")
    system = "You are an agent. Call one tool per step. Tools:\n" + "\n".join(tools)
    calls = []
    for call in range(args.agent_calls):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": f"Task {call}: {paragraph(rng, 12)}"}]
        result = await alternated(clients, model, call, args.answer_tokens, messages=messages)
        (on_ttft, on_text, cached), (off_ttft, off_text, _) = result["on"], result["off"]
        calls.append({"call": call, "prompt_tokens": prompt_tokens(tokenizer, messages), "cached_tokens": cached,
                      "ttft_on_s": on_ttft, "ttft_off_s": off_ttft, "same_answer": on_text == off_text})
        print(f"  agent call {call}: {calls[-1]['prompt_tokens']} prompt tokens ({cached} cached), "
              f"TTFT on {on_ttft:.3f} s, off {off_ttft:.3f} s, {off_ttft / on_ttft:.1f}x", flush=True)
    later = calls[1:]
    return {
        "calls": calls,
        "median_ttft_on_s": statistics.median(c["ttft_on_s"] for c in later),
        "median_ttft_off_s": statistics.median(c["ttft_off_s"] for c in later),
        "median_ratio": statistics.median(c["ttft_off_s"] / c["ttft_on_s"] for c in later),
        "answers_identical": all(c["same_answer"] for c in calls),
    }


async def distinct_once(client: Any, model: str, streams: int, max_tokens: int, seed: int) -> float:
    rng = random.Random(seed)
    prompts = [f"{rng.choice(WORDS)} {i} {paragraph(rng, 40)}" for i in range(streams)]
    started = time.perf_counter()
    answers = await asyncio.gather(
        *(client.completions.create(model=model, prompt=p, max_tokens=max_tokens, temperature=0) for p in prompts)
    )
    return sum(a.usage.completion_tokens for a in answers) / (time.perf_counter() - started)


async def distinct_workload(clients: dict[str, Any], model: str, args: argparse.Namespace) -> dict[str, Any]:
    rates: dict[str, list[float]] = {"on": [], "off": []}
    for repeat in range(args.repeats):
        for side in (["on", "off"] if repeat % 2 == 0 else ["off", "on"]):
            # Each repeat's prompts are new to both sides: nothing to hit but the chat-free start.
            rates[side].append(await distinct_once(clients[side], model, args.streams, args.distinct_tokens, 1000 + repeat))
        print(f"  distinct repeat {repeat}: on {rates['on'][-1]:.1f} tok/s, off {rates['off'][-1]:.1f} tok/s", flush=True)
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    return {"tok_s_on": rates["on"], "tok_s_off": rates["off"], "median_on": on, "median_off": off, "ratio": on / off}


def bookkeeping_workload(package_path: Path, args: argparse.Namespace) -> dict[str, Any]:
    import cProfile
    import pstats

    from flare.package.directory import open_package
    from flare.policy.params import SamplingParams
    from flare.scheduler.request import GenerationRequest
    from flare.scheduler.scheduler import Scheduler, SchedulerOptions

    async def serve() -> float:
        scheduler = Scheduler.from_package(open_package(package_path), SchedulerOptions(prefix_cache=True))
        loop = asyncio.create_task(scheduler.run())
        started = time.perf_counter()
        for repeat in range(args.repeats):
            rng = random.Random(1000 + repeat)
            streams = [
                scheduler.submit(GenerationRequest(
                    f"r{repeat}-{i}",
                    tuple(scheduler.tokenizer.encode(f"{rng.choice(WORDS)} {i} {paragraph(rng, 40)}")),
                    SamplingParams(temperature=0.0, max_tokens=args.distinct_tokens),
                ))
                for i in range(args.streams)
            ]
            for stream in streams:
                async for _ in stream:
                    pass
        wall = time.perf_counter() - started
        scheduler.stop()
        await loop
        return wall

    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    profile = cProfile.Profile()
    profile.enable()
    wall = asyncio.run(serve())
    profile.disable()
    mine = {"publish", "map_cached_prefix", "_count_cached_prompt"}
    seconds = sum(
        own
        for (file, _, name), (_, _, own, _, _) in pstats.Stats(profile).stats.items()  # type: ignore[attr-defined]
        if file.endswith("prefix_cache.py") or (file.endswith(("scheduler.py", "blocks.py")) and name in mine)
    )
    print(f"  bookkeeping: {seconds * 1000:.1f} ms of {wall:.1f} s", flush=True)
    return {"bookkeeping_s": seconds, "wall_s": wall, "share": seconds / wall}


async def choices_workload(clients: dict[str, Any], urls: dict[str, str], model: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(11)
    messages = [{"role": "user", "content": f"Continue this story: {paragraph(rng, 300)}"}]
    client, url = clients["off"], urls["off"]
    figures: dict[str, list[dict[str, float]]] = {"n4": [], "separate": []}
    for repeat in range(args.repeats):
        for kind in (["n4", "separate"] if repeat % 2 == 0 else ["separate", "n4"]):
            before = metric(url, "flare_prompt_tokens_total")
            started = time.perf_counter()
            if kind == "n4":
                answer = await client.chat.completions.create(
                    model=model, messages=messages, max_tokens=args.answer_tokens, temperature=0.8, seed=repeat, n=4
                )
                assert len(answer.choices) == 4
            else:
                await asyncio.gather(*(
                    client.chat.completions.create(
                        model=model, messages=messages, max_tokens=args.answer_tokens, temperature=0.8, seed=repeat * 10 + i
                    )
                    for i in range(4)
                ))
            figures[kind].append({"seconds": time.perf_counter() - started,
                                  "prompt_tokens_computed": metric(url, "flare_prompt_tokens_total") - before})
            print(f"  choices {kind} repeat {repeat}: {figures[kind][-1]['seconds']:.2f} s, "
                  f"{figures[kind][-1]['prompt_tokens_computed']:.0f} prompt tokens computed", flush=True)
    n4 = statistics.median(f["seconds"] for f in figures["n4"])
    separate = statistics.median(f["seconds"] for f in figures["separate"])
    return {
        "runs": figures,
        "median_n4_s": n4,
        "median_separate_s": separate,
        "ratio": separate / n4,
        "prompt_tokens_computed_n4": statistics.median(f["prompt_tokens_computed"] for f in figures["n4"]),
        "prompt_tokens_computed_separate": statistics.median(f["prompt_tokens_computed"] for f in figures["separate"]),
    }


async def burst_workload(clients: dict[str, Any], urls: dict[str, str], model: str, tokenizer: Any,
                         args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(13)
    figures: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
    identical = True
    for repeat in range(args.repeats):
        # This repeat's own system prompt, from its first words: nothing of it is cached anywhere.
        lines = [f"Session {rng.getrandbits(48):012x}. You are a support agent. Follow these policies:"]
        while prompt_tokens(tokenizer, [{"role": "system", "content": "\n".join(lines)}]) < args.agent_tokens:
            lines.append(f"Policy {len(lines)}: {paragraph(rng, 25)}")
        system = "\n".join(lines)
        tasks = [f"Customer {i}: {paragraph(rng, 12)}" for i in range(args.streams)]
        answers: dict[str, list[str]] = {}
        for side in (["on", "off"] if repeat % 2 == 0 else ["off", "on"]):
            before = metric(urls[side], "flare_prompt_tokens_total")
            started = time.perf_counter()
            replies = await asyncio.gather(*(
                clients[side].chat.completions.create(
                    model=model, messages=[{"role": "system", "content": system}, {"role": "user", "content": task}],
                    max_tokens=args.answer_tokens, temperature=0,
                )
                for task in tasks
            ))
            figures[side].append({"seconds": time.perf_counter() - started,
                                  "prompt_tokens_computed": metric(urls[side], "flare_prompt_tokens_total") - before,
                                  "cached_tokens": sum((r.usage.prompt_tokens_details.cached_tokens or 0) for r in replies)})
            answers[side] = [r.choices[0].message.content for r in replies]
            print(f"  burst {side} repeat {repeat}: {figures[side][-1]['seconds']:.2f} s, "
                  f"{figures[side][-1]['prompt_tokens_computed']:.0f} prompt tokens computed, "
                  f"{figures[side][-1]['cached_tokens']} cached", flush=True)
        identical = identical and answers["on"] == answers["off"]
    on = {k: statistics.median(f[k] for f in figures["on"]) for k in ("seconds", "prompt_tokens_computed")}
    off = {k: statistics.median(f[k] for f in figures["off"]) for k in ("seconds", "prompt_tokens_computed")}
    return {"runs": figures, "median_on": on, "median_off": off, "ratio": off["seconds"] / on["seconds"],
            "answers_identical": identical}


async def run(urls: dict[str, str], tokenizer: Any, args: argparse.Namespace) -> dict[str, Any]:
    from openai import AsyncOpenAI

    report: dict[str, Any] = {}
    async with contextlib.AsyncExitStack() as stack:
        clients = {
            side: await stack.enter_async_context(AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600))
            for side, url in urls.items()
        }
        model = (await clients["on"].models.list()).data[0].id
        if "chat" in args.workloads:
            print("chat: each turn resends the history", flush=True)
            report["chat"] = await chat_workload(clients, model, tokenizer, args)
        if "agent" in args.workloads:
            print("agent: one long shared system prompt", flush=True)
            report["agent"] = await agent_workload(clients, model, tokenizer, args)
        if "distinct" in args.workloads:
            print(f"distinct: no shared prefixes, {args.streams} streams", flush=True)
            report["distinct"] = await distinct_workload(clients, model, args)
        if "choices" in args.workloads:
            print("choices: n = 4 against four separate requests (cache off)", flush=True)
            report["choices"] = await choices_workload(clients, urls, model, args)
        if "burst" in args.workloads:
            print(f"burst: {args.streams} requests at once after one new system prompt", flush=True)
            report["burst"] = await burst_workload(clients, urls, model, tokenizer, args)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--package", type=Path, help="package to serve (default: the default model's package)")
    workloads = ["chat", "agent", "distinct", "bookkeeping", "choices", "burst"]
    parser.add_argument("--workloads", nargs="+", default=workloads, choices=workloads)
    parser.add_argument("--chat-tokens", type=int, default=2000, help="the history a chat grows to")
    parser.add_argument("--conversations", type=int, default=2)
    parser.add_argument("--agent-tokens", type=int, default=1500, help="the shared system prompt's length")
    parser.add_argument("--agent-calls", type=int, default=6)
    parser.add_argument("--answer-tokens", type=int, default=32, help="max_tokens of chat, agent and choices answers")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--distinct-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()

    if args.package is None:
        from flare.preparation.default_package import default_package_path

        args.package = default_package_path()
    from flare.engine.tokenizer import Tokenizer
    from flare.package.directory import open_package

    package = open_package(args.package)
    tokenizer = Tokenizer.from_package(package)
    print(f"package {args.package} ({package.manifest.serving.dtype}), {args.threads} threads each", flush=True)
    report: dict[str, Any] = {}
    if set(args.workloads) - {"bookkeeping"}:
        with flare_daemon(args.package, args.threads, ["--prefix-cache", "on"]) as on, flare_daemon(
            args.package, args.threads, ["--prefix-cache", "off"]
        ) as off:
            report = asyncio.run(run({"on": on, "off": off}, tokenizer, args))
    if "bookkeeping" in args.workloads:
        import torch

        torch.set_num_threads(args.threads)
        print("bookkeeping: the distinct workload in-process, cache on, under cProfile", flush=True)
        report["bookkeeping"] = bookkeeping_workload(args.package, args)
    report["command"] = " ".join(sys.argv)
    print()
    if "chat" in report:
        c = report["chat"]
        print(f"chat, later turns ({c['later_turns']}): TTFT on {c['median_ttft_on_s']:.3f} s, off {c['median_ttft_off_s']:.3f} s, "
              f"{c['median_ratio']:.1f}x lower; first turns (nothing cached) off/on {c['first_turn_ratio']:.2f}; "
              f"answers identical: {c['answers_identical']}")
    if "agent" in report:
        a = report["agent"]
        print(f"agent, calls after the first: TTFT on {a['median_ttft_on_s']:.3f} s, off {a['median_ttft_off_s']:.3f} s, "
              f"{a['median_ratio']:.1f}x lower; answers identical: {a['answers_identical']}")
    if "distinct" in report:
        d = report["distinct"]
        print(f"distinct prompts, {args.streams} streams: on {d['median_on']:.1f} tok/s, off {d['median_off']:.1f} tok/s, "
              f"on/off {d['ratio']:.3f}")
    if "bookkeeping" in report:
        b = report["bookkeeping"]
        print(f"bookkeeping: {b['bookkeeping_s'] * 1000:.1f} ms in the prefix cache's code of {b['wall_s']:.1f} s "
              f"({b['share']:.3%})")
    if "choices" in report:
        n = report["choices"]
        print(f"n = 4: {n['median_n4_s']:.2f} s against {n['median_separate_s']:.2f} s for four separate requests "
              f"({n['ratio']:.2f}x); prompt tokens computed {n['prompt_tokens_computed_n4']:.0f} against "
              f"{n['prompt_tokens_computed_separate']:.0f}")
    if "burst" in report:
        u = report["burst"]
        print(f"burst of {args.streams}: on {u['median_on']['seconds']:.2f} s, {u['median_on']['prompt_tokens_computed']:.0f} "
              f"prompt tokens computed; off {u['median_off']['seconds']:.2f} s, {u['median_off']['prompt_tokens_computed']:.0f}; "
              f"off/on {u['ratio']:.2f}x; answers identical: {u['answers_identical']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
