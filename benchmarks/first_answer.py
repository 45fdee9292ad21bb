"""The README's first question, sampled many times: how often the answer names Paris, and how often
it loops until the length limit.

Sends `--samples` chat requests of "What is the capital of France?" (the README's first curl: no
sampling field but the ones given with --params) to a running daemon, each with its own seed
(0, 1, ...) so that a run is reproducible, at most --concurrency at a time. An answer *loops* when
it ended by length (finish_reason "length") and its last --tail words repeat themselves: fewer
than half of their --ngram-word runs are distinct (a free text has nearly all distinct; a text
going round a circle of k words has about k). The model went round in a circle until max_tokens
cut it off. --answers FILE writes every answer, to check the rule by eye.

    flare run &   # the default package
    python benchmarks/first_answer.py --base-url http://127.0.0.1:8000
    python benchmarks/first_answer.py --params '{"repetition_penalty": 1.0}'
    python benchmarks/first_answer.py --prompt "Give me three tips for staying healthy."

With another --prompt, the Paris count means nothing; the loop count still does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any

import httpx

PROMPT = "What is the capital of France?"


@dataclass(frozen=True)
class Answer:
    seed: int
    text: str
    finish_reason: str
    completion_tokens: int
    flare: dict[str, Any]


def loops(answer: Answer, ngram: int, tail: int) -> bool:
    """Ended by the length limit, its last `tail` words going round a circle: fewer than half
    of their `ngram`-word runs distinct."""
    if answer.finish_reason != "length":
        return False
    words = re.findall(r"\w+", answer.text.lower())[-tail:]
    runs = [tuple(words[i : i + ngram]) for i in range(len(words) - ngram + 1)]
    return bool(runs) and len(set(runs)) < len(runs) / 2


def names_paris(answer: Answer) -> bool:
    return "paris" in answer.text.lower()


async def ask(
    client: httpx.AsyncClient, model: str, prompt: str, seed: int, params: dict[str, Any], gate: asyncio.Semaphore
) -> Answer:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "seed": seed, **params}
    async with gate:
        response = await client.post("/v1/chat/completions", json=body)
    response.raise_for_status()
    data = response.json()
    choice = data["choices"][0]
    text = choice["message"]["content"] or ""
    return Answer(seed, text, choice["finish_reason"], data["usage"]["completion_tokens"], data["flare"])


def write_answers(path: str, answers: list[Answer], looping: list[Answer]) -> None:
    with open(path, "w", encoding="utf-8") as out:
        for a in answers:
            line = {"seed": a.seed, "finish_reason": a.finish_reason, "loops": a in looping, "text": a.text}
            out.write(json.dumps(line, ensure_ascii=False) + "\n")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    params = json.loads(args.params)
    gate = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout_s) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        asked = (ask(client, model, args.prompt, seed, params, gate) for seed in range(args.samples))
        answers = list(await asyncio.gather(*asked))
    looping = [a for a in answers if loops(a, args.ngram, args.tail)]
    if args.answers is not None:
        write_answers(args.answers, answers, looping)
    return {
        "prompt": args.prompt,
        "params": params,
        "applied": answers[0].flare.get("sampling"),
        "samples": len(answers),
        "paris": sum(names_paris(a) for a in answers),
        "loops": len(looping),
        "length": sum(a.finish_reason == "length" for a in answers),
        "mean_completion_tokens": sum(a.completion_tokens for a in answers) / len(answers),
        "looping_seeds": [a.seed for a in looping],
        "examples": {str(a.seed): a.text[:300] for a in (looping[:2] + [a for a in answers if a not in looping][:2])},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--params", default="{}", help="sampling fields sent with every request, as JSON")
    parser.add_argument("--ngram", type=int, default=4)
    parser.add_argument("--tail", type=int, default=60)
    parser.add_argument("--answers", help="write every answer to this file, one JSON line each")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args)), indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
