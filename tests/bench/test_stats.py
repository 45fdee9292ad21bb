"""Percentiles and level summaries, on inputs whose answers are known."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flare.bench.client import COUNT_USAGE, RequestRecord
from flare.bench.stats import distribution, failures_by_cause, percentile, summarize


@pytest.mark.parametrize("q", [0, 10, 25, 50, 90, 99, 100])
@pytest.mark.parametrize("values", [[3.0], [1.0, 2.0], [5.0, 1.0, 4.0, 2.0, 3.0], list(np.linspace(0, 1, 37) ** 2)])
def test_percentile_interpolates_linearly_like_numpy(values: list[float], q: float) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentiles_of_one_to_a_hundred() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.5
    assert percentile(values, 90) == pytest.approx(90.1)
    assert percentile(values, 99) == pytest.approx(99.01)


def test_percentile_of_nothing_is_nan_and_out_of_range_is_refused() -> None:
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="within 0 and 100"):
        percentile([1.0], 101)


def test_distribution_skips_missing_values_and_reports_none_when_empty() -> None:
    figures = distribution([0.1, None, 0.3])
    assert figures["count"] == 2 and figures["mean"] == pytest.approx(0.2) and figures["p50"] == pytest.approx(0.2)
    assert distribution([None]) == {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None}


def _ok(start: float, ttft: float, e2e: float, tokens: int, itl: list[float]) -> RequestRecord:
    return RequestRecord(start_s=start, ok=True, http_status=200, ttft_s=ttft, e2e_s=e2e, itl_s=itl,
                         output_tokens=tokens, prompt_tokens=10, token_count=COUNT_USAGE)


def _failed(status: int | None, code: str) -> RequestRecord:
    return RequestRecord(start_s=0.0, ok=False, http_status=status, error_code=code, e2e_s=0.01)


def test_failures_are_grouped_by_status_and_code_most_frequent_first() -> None:
    records = [_failed(429, "rate_limit_exceeded")] * 3 + [_failed(None, "connection_error")] + [_failed(503, "draining")] * 2
    assert failures_by_cause(records) == [
        {"http_status": 429, "error_code": "rate_limit_exceeded", "count": 3},
        {"http_status": 503, "error_code": "draining", "count": 2},
        {"http_status": None, "error_code": "connection_error", "count": 1},
    ]


def test_summary_counts_only_completed_requests_in_throughput_and_latency() -> None:
    records = [
        _ok(0.0, ttft=0.5, e2e=1.5, tokens=11, itl=[0.1] * 10),  # TPOT (1.5 - 0.5) / 10 = 0.1
        _ok(0.0, ttft=1.0, e2e=2.0, tokens=5, itl=[0.25] * 4),  # TPOT 1.0 / 4 = 0.25
        _failed(500, "internal_error"),
    ]
    summary = summarize(records, duration_s=2.0)
    assert (summary["requests"], summary["completed"], summary["failed"]) == (3, 2, 1)
    assert summary["output_tokens"] == 16 and summary["prompt_tokens"] == 20
    assert summary["output_tok_s"] == pytest.approx(8.0) and summary["req_s"] == pytest.approx(1.0)
    assert summary["ttft_s"]["mean"] == pytest.approx(0.75) and summary["ttft_s"]["count"] == 2
    assert summary["tpot_s"]["p50"] == pytest.approx(0.175)
    assert summary["itl_s"]["count"] == 14 and summary["itl_s"]["p50"] == pytest.approx(0.1)
    assert summary["e2e_s"]["p90"] == pytest.approx(1.95)
    assert summary["failures"] == [{"http_status": 500, "error_code": "internal_error", "count": 1}]


def test_a_single_token_answer_has_no_time_per_output_token() -> None:
    assert _ok(0.0, ttft=0.2, e2e=0.2, tokens=1, itl=[]).tpot_s is None
