"""Percentiles and the summary of one level's requests.

Percentiles interpolate linearly between the two nearest ranks (numpy's default, `linear`), so
p50 of an even count is the mean of the middle two. Latencies are summarised over the requests
that completed; failures are counted by HTTP status and error code.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from flare.bench.client import RequestRecord

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) of `values`, linearly interpolated; NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0 and 100, got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: Iterable[float | None]) -> dict[str, float | int | None]:
    """Mean, p50, p90, p99 and the count, of the values that are not None (None when none are)."""
    present = [v for v in values if v is not None]
    if not present:
        return {"count": 0, "mean": None, **{f"p{q}": None for q in PERCENTILES}}
    return {
        "count": len(present),
        "mean": statistics.fmean(present),
        **{f"p{q}": percentile(present, q) for q in PERCENTILES},
    }


def failures_by_cause(records: Iterable[RequestRecord]) -> list[dict[str, Any]]:
    """Failed requests grouped by (HTTP status, error code), most frequent first."""
    tally = Counter((r.http_status, r.error_code) for r in records if not r.ok)
    return [
        {"http_status": status, "error_code": code, "count": count}
        for (status, code), count in sorted(tally.items(), key=lambda item: (-item[1], str(item[0])))
    ]


def summarize(records: Sequence[RequestRecord], duration_s: float) -> dict[str, Any]:
    """One level's figures: counts, throughput over `duration_s`, latency distributions."""
    done = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    prompt_counts = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
    seconds = max(duration_s, 1e-9)
    return {
        "requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "failures": failures_by_cause(records),
        "duration_s": duration_s,
        "output_tokens": output_tokens,
        "prompt_tokens": sum(prompt_counts) if prompt_counts else None,
        "token_count": sorted({r.token_count for r in done}),
        "output_tok_s": output_tokens / seconds,
        "req_s": len(done) / seconds,
        "ttft_s": distribution(r.ttft_s for r in done),
        "itl_s": distribution(gap for r in done for gap in r.itl_s),
        "tpot_s": distribution(r.tpot_s for r in done),
        "e2e_s": distribution(r.e2e_s for r in done),
    }
