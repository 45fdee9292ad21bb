"""Where a running daemon's rounds go: a py-spy profile grouped into the steps of a round.

    py-spy record --pid PID --duration 20 --rate 100 --format raw --threads --nonblocking -o daemon.raw
    .venv/bin/python benchmarks/profile_rounds.py daemon.raw

Record while `flare bench` keeps the daemon busy. Each sample is charged to the innermost frame
of flare's code; a sample inside the model's forward pass is named by the weight its line
multiplies (the line's text is read from the source, so edits to model.py do not mislabel it):
the q/k/v, o, gate/up and down projections, the LM head, attention, RoPE and the KV write,
SwiGLU, the norms. Shares are of all samples, every thread (the event loop's included).
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from functools import cache
from pathlib import Path

FRAME = re.compile(r"(?P<function>\S+) \((?P<path>.*?):(?P<line>\d+)\)")
LINEAR_WEIGHT = re.compile(r"linear\(.*,\s*(?:layer\.|self\.)(\w+)\)")
COLUMNS_WEIGHT = re.compile(r"linear_columns\([^()]*,\s*(?:layer\.|self\.)(\w+)\)")
WEIGHT_NAMES = {"qkv": "GEMM q/k/v", "o": "GEMM o", "gate_up": "GEMM gate/up", "down": "GEMM down", "lm_head": "LM head"}
STEPS = {
    # The steps of flare/engine/layers/ and their kernels in flare/engine/native.py.
    "attend": "attention", "plan": "attention", "paged_attention": "attention",
    "round_tables": "RoPE + KV write", "rope_and_cache": "RoPE + KV write",
    "gated_activation": "SwiGLU", "gated_rows": "SwiGLU",
    "add_norm": "RMS norms", "sublayer_output": "RMS norms", "add_rms_norm": "RMS norms",
    # A round of short rows on float16 or block weights: every step of a layer in one kernel call.
    "decoder_layers": "layers, one kernel call each", "decoder_layer": "layers, one kernel call each",
}


@cache
def source_line(path: str, line: int) -> str:
    try:
        return Path(path).read_text().splitlines()[line - 1]
    except (OSError, IndexError):
        return ""


def step(frames: list[str]) -> str:
    flare = []
    for frame in frames:
        match = FRAME.match(frame)
        if match and "flare/" in match["path"]:
            flare.append((match["function"].split(".")[-1], match["path"], int(match["line"])))
    if not flare:
        return "outside flare (interpreter, threads, libraries)"
    function, path, line = flare[-1]
    names = [f[0] for f in flare]
    forward = [f for f in flare if f[0] == "forward" and f[1].endswith("engine/model.py")]
    if forward and function not in ("forward",) and function not in STEPS:
        text = source_line(forward[-1][1], forward[-1][2])
        pattern = LINEAR_WEIGHT if "linear" in names else COLUMNS_WEIGHT
        found = pattern.search(text)
        if found and found[1] in WEIGHT_NAMES:
            return WEIGHT_NAMES[found[1]]
    if function in STEPS:
        return STEPS[function]
    if function == "forward" and path.endswith("engine/model.py"):
        text = source_line(path, line)
        if "rms_norm" in text:
            return "RMS norms"
        if "embedding" in text:
            return "embedding"
        return "forward, other"
    if "/kernels/" in path or function in ("_sample", "_sample_rows"):
        return "sampling kernels"
    if "/daemon/" in path:
        return "event loop: HTTP, SSE"
    return f"{path.split('flare/')[-1]}: {function}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", type=Path, help="py-spy record --format raw output")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    steps: Counter[str] = Counter()
    total = 0
    for line in args.profile.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        steps[step(stack.split(";"))] += int(count)
        total += int(count)
    print(f"{total} samples")
    for name, count in steps.most_common(args.top):
        print(f"{count / total:6.1%}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
