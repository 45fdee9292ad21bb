"""What structured output costs per generated token, and what jump-forward drafting saves.

    .venv/bin/python benchmarks/structured_output.py                 # the published figures
    .venv/bin/python benchmarks/structured_output.py --repeats 1 --streams 1

In this process, on the default model's package as `flare run` serves it (the scheduler and the
engine, no HTTP), one measurement at a time, alternating the variants within each repeat so a
slow patch of the shared machine falls on all of them; medians over --repeats.

1. Free text against a JSON schema (nested object, strings, an enum, an array), greedy, at 1 and
   32 concurrent streams, without speculation and without jump-forward (so both produce one
   token per round and only the mask's cost differs): milliseconds of wall time per generated
   token, and the share of it the token masks took (llguidance's mask calls, timed around the
   runner's mask step).
2. Jump-forward on a schema with long key names (enums and booleans, so every answer completes):
   rounds for the level (all its streams together) and ms per token with forced tokens proposed
   as drafts and without (`SchedulerOptions.jump_forward`), n-gram speculation as the package
   serves it in both.
3. The mask alone: microseconds per position for 32 states of the schema of (1) inside a string
   value (most tokens allowed: the costly case), and the schema's compile time; with
   --compare-xgrammar also xgrammar's, when it is importable (it is not a dependency of flare:
   install it with `pip install --no-deps --target DIR xgrammar apache-tvm-ffi` and run with
   PYTHONPATH=DIR; it needs transformers, which the test extra has).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from flare.engine.precision import cpu_flags
from flare.preparation.default_package import default_package_path
from flare.package.directory import open_package
from flare.policy.params import SamplingParams
from flare.scheduler.round import model_runner
from flare.scheduler.request import Finished, GenerationRequest, TextDelta
from flare.scheduler.scheduler import Scheduler, SchedulerOptions
from flare.structured import GrammarSpec, GrammarState, fill_masks

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "favourite_colour": {"enum": ["red", "green", "blue"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}, "country": {"type": "string", "maxLength": 24}},
            "required": ["city", "country"],
            "additionalProperties": False,
        },
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "favourite_colour", "address", "hobbies"],
    "additionalProperties": False,
}
LONG_KEYS = {
    "type": "object",
    "properties": {
        f"the_{word}_setting_of_the_customer_account": {"type": "boolean"}
        for word in ("notification", "privacy", "marketing", "billing", "language", "security")
    }
    | {"preferred_contact_channel_for_the_customer": {"enum": ["email", "phone", "post"]}},
    "additionalProperties": False,
}
LONG_KEYS["required"] = list(LONG_KEYS["properties"])
PROMPT = "Invent a person who lives in Rome and describe them as JSON: name, age, colour, address, hobbies."


@dataclass
class Run:
    seconds: float
    tokens: int
    rounds: int
    answers: int
    mask_seconds: float

    @property
    def ms_per_token(self) -> float:
        return 1000 * self.seconds / max(1, self.tokens)


class MaskTimer:
    """Times the runner's mask step (the llguidance calls) from the model thread."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._original = model_runner.fill_masks

    def __enter__(self) -> MaskTimer:
        def timed(rows, out):  # type: ignore[no-untyped-def]
            started = time.perf_counter()
            self._original(rows, out)
            self.seconds += time.perf_counter() - started

        model_runner.fill_masks = timed
        return self

    def __exit__(self, *exc: object) -> None:
        model_runner.fill_masks = self._original


async def measure(scheduler: Scheduler, spec: GrammarSpec | None, streams: int, max_tokens: int) -> Run:
    grammar = scheduler.grammars.compile(spec) if spec is not None and scheduler.grammars is not None else None
    prompt = tuple(scheduler.tokenizer.encode_chat([{"role": "user", "content": PROMPT}]))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    rounds = scheduler.snapshot().rounds
    tokens = 0
    stamp = time.perf_counter_ns()

    async def one(i: int) -> int:
        count = 0
        request = GenerationRequest(f"b{stamp}-{i}", prompt, params, grammar=grammar)
        async for event in scheduler.submit(request):
            if isinstance(event, TextDelta):
                count += len(event.token_ids)
            elif isinstance(event, Finished):
                count = event.usage.completion_tokens
        return count

    with MaskTimer() as masks:
        started = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(streams)))
        seconds = time.perf_counter() - started
    tokens = sum(counts)
    return Run(seconds, tokens, scheduler.snapshot().rounds - rounds, streams, masks.seconds)


async def run_scheduler(package: Path, options: SchedulerOptions, work):  # type: ignore[no-untyped-def]
    scheduler = Scheduler.from_package(open_package(package), options)
    loop = asyncio.create_task(scheduler.run())
    try:
        await scheduler.warm_up()
        return await work(scheduler)
    finally:
        scheduler.stop()
        await loop


def mask_microbenchmark(scheduler: Scheduler, positions: int = 32, repeats: int = 50) -> float:
    import torch

    assert scheduler.grammars is not None
    grammar = scheduler.grammars.compile(GrammarSpec.json_schema(PERSON, "bench"))
    states = [GrammarState(grammar) for _ in range(positions)]
    tokenizer = grammar.tokenizer
    prefix = tokenizer.tokenize_str('{"name": "Giu')  # inside a string: most tokens allowed, the costly case
    for state in states:
        state.accept(prefix)
    out = torch.full((positions, -(-scheduler.vocab_size // 32)), -1, dtype=torch.int32)
    rows = [(state, i, ()) for i, state in enumerate(states)]
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fill_masks(rows, out)
        times.append(time.perf_counter() - started)
    return 1e6 * statistics.median(times) / positions


def compile_ms(scheduler: Scheduler) -> float:
    """A fresh compile of the person schema (a new key each time: the cache is bypassed)."""
    assert scheduler.grammars is not None
    times = []
    for i in range(10):
        schema = dict(PERSON, title=f"bench{i}-{time.perf_counter_ns()}")
        started = time.perf_counter()
        scheduler.grammars.compile(GrammarSpec.json_schema(schema, "bench"))
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def xgrammar_figures(package: Path, positions: int = 32, repeats: int = 50) -> tuple[float, float]:
    """(compile ms, mask us per position) of xgrammar on the same schema and state."""
    import torch
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    pkg = open_package(package)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(pkg.tokenizer_json_path))
    vocab = pkg.manifest.model.vocab_size
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    times = []
    for _ in range(10):
        started = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(PERSON), any_whitespace=False)
        times.append(time.perf_counter() - started)
    matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(positions)]
    prefix = hf.encode('{"name": "Giu', add_special_tokens=False)
    for matcher in matchers:
        for token in prefix:
            assert matcher.accept_token(token)
    bitmask = xgrammar.allocate_token_bitmask(positions, vocab)
    mask_times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for i, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, i)
        mask_times.append(time.perf_counter() - started)
    del torch
    return 1000 * statistics.median(times), 1e6 * statistics.median(mask_times) / positions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--package", type=Path, default=None, help="default: the default model's package")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", default="1,32")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    parser.add_argument("--compare-xgrammar", action="store_true", help="also time xgrammar's compile and mask")
    args = parser.parse_args()
    package = args.package or default_package_path()
    levels = [int(s) for s in args.streams.split(",")]
    results: dict[str, list[Run]] = {}

    async def structured_vs_free(scheduler: Scheduler) -> tuple[float, float]:
        for _ in range(args.repeats):
            for streams in levels:
                for name, spec in (("free", None), ("json_schema", GrammarSpec.json_schema(PERSON, "bench"))):
                    results.setdefault(f"{name}@{streams}", []).append(
                        await measure(scheduler, spec, streams, args.max_tokens)
                    )
        return mask_microbenchmark(scheduler), compile_ms(scheduler)

    options = SchedulerOptions(max_concurrency=32, draft_tokens=0, jump_forward=False)
    mask_us, compile_time = asyncio.run(run_scheduler(package, options, structured_vs_free))

    async def jump(scheduler: Scheduler) -> None:
        spec = GrammarSpec.json_schema(LONG_KEYS, "bench")
        for _ in range(args.repeats):
            for streams in levels:
                results.setdefault(f"jump_forward@{streams}", []).append(await measure(scheduler, spec, streams, 400))

    async def no_jump(scheduler: Scheduler) -> None:
        spec = GrammarSpec.json_schema(LONG_KEYS, "bench")
        for _ in range(args.repeats):
            for streams in levels:
                results.setdefault(f"no_jump_forward@{streams}", []).append(await measure(scheduler, spec, streams, 400))

    # Two schedulers cannot share the machine's cores fairly at once: one after the other.
    asyncio.run(run_scheduler(package, SchedulerOptions(max_concurrency=32), jump))
    asyncio.run(run_scheduler(package, SchedulerOptions(max_concurrency=32, jump_forward=False), no_jump))

    def med(name: str, field: str) -> float:
        return statistics.median(getattr(r, field) if field != "ms_per_token" else r.ms_per_token for r in results[name])

    print(f"cpu flags: {' '.join(cpu_flags())}")
    print(f"package: {package.name}; repeats: {args.repeats}; medians")
    print("\n| streams | free text ms/token | json_schema ms/token | ratio | mask share |")
    print("| --- | --- | --- | --- | --- |")
    for streams in levels:
        free, constrained = med(f"free@{streams}", "ms_per_token"), med(f"json_schema@{streams}", "ms_per_token")
        share = statistics.median(r.mask_seconds / r.seconds for r in results[f"json_schema@{streams}"])
        print(f"| {streams} | {free:.2f} | {constrained:.2f} | {constrained / free:.2f} | {100 * share:.1f}% |")
    print("\n| streams | tokens | rounds with jump-forward | without | ms/token with | without | speed-up |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for streams in levels:
        with_ms, without_ms = med(f"jump_forward@{streams}", "ms_per_token"), med(f"no_jump_forward@{streams}", "ms_per_token")
        print(
            f"| {streams} | {med(f'jump_forward@{streams}', 'tokens'):.0f} | {med(f'jump_forward@{streams}', 'rounds'):.0f} "
            f"| {med(f'no_jump_forward@{streams}', 'rounds'):.0f} | {with_ms:.2f} | {without_ms:.2f} | {without_ms / with_ms:.2f}x |"
        )
    print(f"\nllguidance: compile {compile_time:.1f} ms; mask {mask_us:.1f} us per position (32 states in a string)")
    if args.compare_xgrammar:
        x_compile, x_mask = xgrammar_figures(package)
        print(f"xgrammar:   compile {x_compile:.1f} ms; mask {x_mask:.1f} us per position (32 states in a string)")
    if args.out is not None:
        args.out.write_text(
            json.dumps({name: [r.__dict__ for r in runs] for name, runs in results.items()} | {"mask_us": mask_us}, indent=1)
        )


if __name__ == "__main__":
    main()
