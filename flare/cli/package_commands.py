"""The `flare export` and `flare inspect` commands (argparse wiring; the work is in preparation/)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Any

from flare.package.manifest import AUTO_DTYPE, DTYPES, QUANTIZE_TYPES

EXIT_FAILURE = 1
EXIT_USAGE = 2


def add_export_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "export",
        help="prepare a package from a GGUF file, a Hugging Face directory, or 'default'",
        description=(
            "Prepare a package: weights, tokenizer, chat template, serving settings and the sampling "
            "policy (the model's recipe, with the overrides given here). Every option is checked before "
            "the weights are read; the package appears at DIR whole, or not at all."
        ),
    )
    parser.add_argument("source", metavar="SOURCE", help="a GGUF file, a Hugging Face model directory, or 'default'")
    parser.add_argument(
        "-o", "--output", metavar="DIR", required=True, type=Path, help="the package directory to create"
    )
    parser.add_argument(
        "--name", metavar="NAME", help="the model name clients send (default: the model's own, e.g. SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--max-concurrency", type=int, metavar="N", help="requests served at once (default 32)")
    parser.add_argument(
        "--max-context", type=int, metavar="N", help="tokens per request, prompt included (default: the model's)"
    )
    parser.add_argument(
        "--dtype",
        choices=(AUTO_DTYPE, *DTYPES),
        default=AUTO_DTYPE,
        help="the dtype the weights are stored in; auto (the default) keeps a quantized GGUF's blocks "
        "(types without a kernel dequantized, the rest float32) and stores float weights as float16 "
        "(bfloat16 beyond float16's range); float32, float16 and bfloat16 dequantize everything",
    )
    parser.add_argument(
        "--quantize",
        choices=QUANTIZE_TYPES,
        metavar="TYPE",
        help=f"quantize to ggml blocks ({', '.join(QUANTIZE_TYPES)}) a Hugging Face directory's float weights, or "
        "what a GGUF's package would store as floats: tensors of types without a kernel (Q2_K, Q3_K, IQ*) and "
        "F16/F32 matrices, its other blocks kept as they are",
    )
    parser.add_argument(
        "--sampling-default",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a default of the recipe's sampling policy (repeatable)",
    )
    parser.add_argument(
        "--sampling-range",
        action="append",
        default=[],
        metavar="NAME=LO:HI",
        help="override an allowed range of the recipe's sampling policy (repeatable)",
    )
    parser.add_argument(
        "--vocabulary-parallel-sampling",
        action="store_true",
        help="prepare for the vocabulary-parallel sampler: packages the unfiltered policy (no top-k/top-p/min-p)",
    )
    parser.add_argument(
        "--mtp-draft-tokens",
        type=int,
        metavar="K",
        dest="draft_tokens",
        help="tokens drafted per speculative round (default 4; 0 disables speculation)",
    )
    parser.add_argument(
        "--drafter",
        choices=("ngram", "mtp"),
        default="ngram",
        help="the draft proposer: ngram (prompt lookup, the default) or mtp (distill a learned draft head "
        "on the target's own answers to a shipped prompt set, or keep the checkpoint's own MTP layer, and "
        "ship it in the package; the package then serves with --drafter auto by default)",
    )
    parser.add_argument("--distill-tokens", type=int, metavar="N",
                        help="mtp: training positions of the distillation (default 4800000)")
    parser.add_argument("--distill-seconds", type=float, metavar="S",
                        help="mtp: wall-clock bound of the whole distillation, generation included (default 1140)")
    parser.add_argument("--distill-seed", type=int, metavar="SEED", help="mtp: the distillation's seed (default 0)")
    parser.add_argument("--draft-head-dtype", choices=DTYPES, default=None,
                        help="mtp: the dtype the head is stored in (default bfloat16)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing package at DIR")
    parser.set_defaults(func=run_export)
    return parser


def add_inspect_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "inspect",
        help="show a package's model, serving settings and sampling policy, and verify its checksums",
        description="Show a package and verify every checksum. Exits 1 when the package would not be served.",
    )
    parser.add_argument("package", metavar="DIR", type=Path, help="the package directory")
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object: the manifest, integrity and problems"
    )
    parser.set_defaults(func=run_inspect)
    return parser


def run_export(args: argparse.Namespace) -> int:
    from flare.daemon.logging import configure_logging

    # Lines about the export itself (a partial directory of a killed export removed) go to stderr.
    configure_logging("info", stream=sys.stderr)
    # SIGTERM unwinds as Ctrl-C does, so the hidden staging directory is removed either way.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        return _export(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _export(args: argparse.Namespace) -> int:
    # Imported here, not at the top: they pull in torch, which other subcommands (ctl) do not need.
    from safetensors import SafetensorError

    from flare.daemon.logging import configure_logging
    from flare.preparation.export import (
        ExportError,
        ExportOptions,
        export_package,
        parse_sampling_default,
        parse_sampling_range,
    )

    try:
        options = ExportOptions(
            name=args.name,
            max_concurrency=args.max_concurrency,
            max_context=args.max_context,
            dtype=args.dtype,
            sampling_defaults=dict(parse_sampling_default(text) for text in args.sampling_default),
            sampling_ranges=dict(parse_sampling_range(text) for text in args.sampling_range),
            vocabulary_parallel_sampling=args.vocabulary_parallel_sampling,
            draft_tokens=args.draft_tokens,
            drafter=args.drafter,
            overwrite=args.overwrite,
            quantize=args.quantize,
        )
        if args.drafter == "mtp":
            from flare.distill.distill import DistillOptions

            from flare.distill.export import export_with_draft_head

            defaults = DistillOptions()
            distill = DistillOptions(
                tokens=args.distill_tokens if args.distill_tokens is not None else defaults.tokens,
                seconds=args.distill_seconds if args.distill_seconds is not None else defaults.seconds,
                seed=args.distill_seed if args.distill_seed is not None else defaults.seed,
                dtype=args.draft_head_dtype or defaults.dtype,
            )
            if distill.tokens < 1 or distill.seconds <= 0:
                raise ExportError("--distill-tokens and --distill-seconds must be positive", option="--distill-tokens")
            # Quiet: the distillation runs the scheduler, whose per-round events are for a daemon's logs.
            configure_logging("warning", stream=sys.stderr)
            manifest = export_with_draft_head(args.source, args.output, options, distill)
        else:
            for flag in ("distill_tokens", "distill_seconds", "distill_seed", "draft_head_dtype"):
                if getattr(args, flag) is not None:
                    raise ExportError(f"--{flag.replace('_', '-')} applies to --drafter mtp only", option=f"--{flag}")
            manifest = export_package(args.source, args.output, options)
    except ExportError as error:
        print(f"flare export: error: {error}", file=sys.stderr)
        return EXIT_USAGE if error.option is not None else EXIT_FAILURE
    except (OSError, SafetensorError) as error:
        # A full disk, among others (safetensors reports it as its own error): nothing is left behind.
        print(f"flare export: error: cannot write the package: {' '.join(str(error).split())}", file=sys.stderr)
        return EXIT_FAILURE
    head = manifest.draft_head
    # An operator who chose a small file should hear what dequantizing it cost before its memory does.
    from flare.package.blocks import kernelless_tensors

    as_floats = list(kernelless_tensors(manifest.dequantized, manifest.blocks).values())
    if as_floats:
        tensors = f"{len(as_floats)} {' and '.join(sorted(set(as_floats)))} tensor{'s' if len(as_floats) > 1 else ''}"
        source = Path(args.source)  # a path, or `default`
        growth = f" the package is {_size(Path(args.output)) / max(_size(source), 1):.1f}x the size of {source};" if source.exists() else ""
        print(
            f"flare export: note: {tensors} of a type flare has no kernel for, stored as float32:{growth} "
            "--quantize q8_0 stores them as 8-bit blocks close to their values, q4_k_m as 4-bit ones (smaller, further)",
            file=sys.stderr,
        )
    print(
        f"exported {args.source} to {args.output} "
        f"(recipe {manifest.provenance.recipe}, "
        + "".join(f"{kind} " for kind in sorted({entry.type for entry in manifest.blocks.values()}))
        + ("blocks, the rest " if manifest.blocks else "")
        + f"dtype {manifest.serving.dtype}"
        + (f", draft head K={head.draft_tokens}, {head.held_out.tokens_per_round:.2f} held-out tokens/round"
           if head is not None and head.held_out is not None else "")
        + ")"
    )
    return 0


def _size(path: Path) -> int:
    """Bytes of a file, or of the files in a directory."""
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file()) if path.is_dir() else path.stat().st_size


def run_inspect(args: argparse.Namespace) -> int:
    from flare.preparation.inspect import inspect_package, render_text, servable

    info = inspect_package(args.package)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        sys.stdout.write(render_text(info, args.package))
    return 0 if servable(info) else EXIT_FAILURE
