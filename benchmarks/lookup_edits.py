"""N-gram lookup on text copied with edits, without a model: what an answer that rewrites a file
with a few changes leaves to the daemon's drafter.

Each FILE's first --tokens tokens (the package's tokenizer) are a prompt, and its "answer" is
the same text with an edit every 15-45 tokens: 1-3 random tokens inserted, 1-3 dropped, or one
replaced, a third each, seeded. Prints lookup's ceiling over all files for K = 4, 8 and 16
(`drafters.lookup_ceiling`: the tokens a round would yield if every draft lookup proposes were
verified) and the drafts it proposed that the answer did not take, a round. The served models
here are too small to make such answers (benchmarks/drafters.py replays lookup over what a
package really answers); this isolates the drafter's part.

    .venv/bin/python benchmarks/lookup_edits.py flare/scheduler/*.py docs/operations.md
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from drafters import lookup_ceiling

from flare.engine.tokenizer import Tokenizer
from flare.package.directory import open_package
from flare.preparation.default_package import default_package_path


def edited(tokens: list[int], vocab: int, rng: random.Random) -> list[int]:
    """`tokens` with an insertion, a deletion or a replacement every 15-45 tokens."""
    out: list[int] = []
    at = 0
    while at < len(tokens):
        run = rng.randint(15, 45)
        out += tokens[at : at + run]
        at += run
        kind = rng.randrange(3)
        if kind == 0:
            out += [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
        elif kind == 1:
            at += rng.randint(1, 3)
        else:
            out.append(rng.randrange(vocab))
            at += 1
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", type=Path, nargs="+")
    parser.add_argument("--package", default="default", help="whose tokenizer (a package directory, or `default`)")
    parser.add_argument("--tokens", type=int, default=800, help="each file's first N tokens")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    package = open_package(default_package_path() if args.package == "default" else Path(args.package))
    tokenizer = Tokenizer.from_package(package)
    rng = random.Random(args.seed)
    prompts: list[tuple[int, ...]] = []
    answers: list[list[int]] = []
    for path in args.files:
        text = tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False)[: args.tokens]
        prompts.append(tuple(text))
        answers.append(edited(text, tokenizer.vocab_size, rng))
    print(f"{len(args.files)} files, {sum(map(len, prompts))} prompt tokens, {sum(map(len, answers))} answer tokens")
    print("| K | tokens a round, every proposed draft verified | drafts not taken, a round |")
    print("| --- | --- | --- |")
    for k in (4, 8, 16):
        ceiling = lookup_ceiling(prompts, answers, k)
        print(f"| {k} | {ceiling.tokens_per_round:.2f} | {ceiling.rejected_per_round:.2f} |")


if __name__ == "__main__":
    main()
