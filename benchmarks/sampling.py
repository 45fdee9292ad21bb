"""CPU cost of one sampling round (flare.sampler.sample_round on the torch twins).

For each policy, rows and draft count: the median wall time of sample_round over random logits
of the default model's vocabulary (49152), including the read-back of the tokens. Drafts are
one-hot (a deterministic drafter) and propose each position's argmax, so greedy rows accept them.

    .venv/bin/python benchmarks/sampling.py --threads 1 2 --rows 1 8 32 --drafts 0 4

With `--kernels c twins` each cell is timed with the sampler's C kernels (flare/sampler/csrc/, as
`flare run` samples where they were built) and with the torch twins alone, alternating, and the
second figure follows the first.

The machine may be shared: compare configurations measured in the same run, not absolute times.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flare.sampler import SamplingBatch, native_sampler, sample_round
from flare.policy.params import SamplingParams

VOCAB = 49152
POLICIES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 1": SamplingParams(temperature=1.0),
    "temperature 0.7": SamplingParams(temperature=0.7),
    "top_k 50": SamplingParams(temperature=0.7, top_k=50),
    "top_p 0.9 (t 0.2)": SamplingParams(temperature=0.2, top_p=0.9),
    "top_p 0.95 (t 1)": SamplingParams(temperature=1.0, top_p=0.95),
    "min_p 0.05": SamplingParams(temperature=1.0, min_p=0.05),
    "top_k+top_p+min_p": SamplingParams(temperature=0.8, top_k=100, top_p=0.9, min_p=0.02),
    "penalties": SamplingParams(temperature=0.8, repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.3),
}


def round_inputs(rows: int, drafts: int, params: SamplingParams, generator: torch.Generator):
    positions = rows * (drafts + 1)
    logits = torch.randn(positions, VOCAB, generator=generator) * 3
    num_drafts = torch.full((rows,), drafts, dtype=torch.int64)
    draft_tokens = logits.argmax(1).view(rows, drafts + 1)[:, :drafts].contiguous()
    prompt = torch.randint(0, VOCAB, (rows, 200), generator=generator).tolist()
    output = torch.randint(0, VOCAB, (rows, 100), generator=generator).tolist()
    batch = SamplingBatch.from_rows(
        [params] * rows, seeds=list(range(rows)), positions=[100] * rows, prompt_ids=prompt, output_ids=output, device="cpu"
    )
    return logits, num_drafts, draft_tokens, batch


def median_ms_each(inputs, repeats: int, kernels: list[str]) -> list[float]:
    """median_ms under each of `kernels` ("c", "twins"), alternating `repeats` times."""
    native = native_sampler._native
    times: dict[str, list[float]] = {k: [] for k in kernels}
    try:
        for _ in range(repeats):
            for k in kernels:
                native_sampler._native = native if k == "c" else None
                times[k].append(median_ms(inputs, 1))
    finally:
        native_sampler._native = native
    return [statistics.median(times[k]) for k in kernels]


def median_ms(inputs, repeats: int) -> float:
    logits, num_drafts, draft_tokens, batch = inputs
    for _ in range(2):
        sample_round(logits, num_drafts, draft_tokens, None, batch).tokens.tolist()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sample_round(logits, num_drafts, draft_tokens, None, batch).tokens.tolist()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--drafts", type=int, nargs="+", default=[0, 4])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--kernels", nargs="+", choices=["c", "twins"], default=["c"], help="c: the sampler's C kernels; twins: torch alone")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    columns = [(threads, drafts, rows) for threads in args.threads for drafts in args.drafts for rows in args.rows]
    print("median ms per sample_round, vocab 49152, one-hot drafts")
    print(f"{'policy':20s}" + "".join(f"{f't{t} K{k} R{r}':>{12 * len(args.kernels)}s}" for t, k, r in columns))
    if len(args.kernels) > 1:
        print(f"{'':20s}" + " / ".join(args.kernels).rjust(12 * len(args.kernels)) * len(columns))
    for name in args.policies:
        cells = []
        for threads, drafts, rows in columns:
            torch.set_num_threads(threads)
            cells += median_ms_each(round_inputs(rows, drafts, POLICIES[name], generator), args.repeats, args.kernels)
        print(f"{name:20s}" + "".join(f"{c:12.1f}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
