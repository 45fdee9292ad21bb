"""`flare bench` end to end against a fake OpenAI-compatible server: the result's shape, failures
counted by HTTP status and code, misbehaving servers counted and never crashing the tool,
Poisson arrivals, flare's /metrics read around each level, plots."""

from __future__ import annotations

import builtins
import json
import socket
import statistics
from pathlib import Path
from typing import Any

import pytest
from tests.bench.fake_openai_server import MODEL, Behaviour, FakeOpenAIServer

from flare.bench.load import MAX_TURNS, arrival_offsets
from flare.cli.main import main


def bench(server_url: str, tmp_path: Path, *flags: str, name: str = "result.json") -> tuple[int, dict[str, Any] | None]:
    out = tmp_path / name
    code = main(["bench", "--url", server_url, "--warmup", "0", "--out", str(out), *flags])
    return code, json.loads(out.read_text()) if out.exists() else None


def test_the_result_records_machine_versions_settings_and_every_level(tmp_path: Path) -> None:
    with FakeOpenAIServer(lambda i, body: Behaviour(tokens=6, gap_s=0.002)) as server:
        code, result = bench(server.url, tmp_path, "--concurrency", "1,3", "--requests", "6", "--label", "fake",
                             "--max-tokens", "6", "--temperature", "0.7")
    assert code == 0 and result is not None
    assert result["format"] == "flare-bench/1" and result["label"] == "fake"
    assert result["server"] == {"url": server.url, "model": MODEL, "models": [MODEL], "is_flare": False,
                                "server_header": result["server"]["server_header"]}
    assert result["machine"]["cpus"] >= 1 and "platform" in result["machine"]
    assert result["versions"]["python"] and result["versions"]["aiohttp"]
    settings = result["settings"]
    assert settings["concurrency"] == "1,3" and settings["requests"] == 6 and settings["dataset"] == "chat"
    assert "api_key" not in settings and settings["api_key_given"] is False
    assert [(level["mode"], level["concurrency"]) for level in result["levels"]] == [("concurrency", 1), ("concurrency", 3)]
    for level in result["levels"]:
        assert (level["requests"], level["completed"], level["failed"], level["failures"]) == (6, 6, 0, [])
        assert level["output_tokens"] == 36 and level["token_count"] == ["usage"]
        assert level["output_tok_s"] == pytest.approx(36 / level["duration_s"])
        for key in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
            assert set(level[key]) == {"count", "mean", "p50", "p90", "p99"}
            assert 0 < level[key]["p50"] <= level[key]["p90"] <= level[key]["p99"]
        assert level["ttft_s"]["p50"] < level["e2e_s"]["p50"]
        assert level["server_metrics"] is None
        assert len(level["records"]) == 6 and all(r["ok"] and len(r["itl_s"]) == 5 for r in level["records"])
    # Each request carries the run's settings; the model comes from /v1/models.
    assert all(b["model"] == MODEL and b["max_tokens"] == 6 and b["temperature"] == 0.7 and b["stream"] for b in server.bodies)


FAILURES = [
    Behaviour(),
    Behaviour("status", status=429, code="rate_limit_exceeded"),
    Behaviour("status", status=500, code=None),
    Behaviour("status", status=503, code="draining"),
    Behaviour("not_json", status=502),
    Behaviour("drop", tokens=6),
    Behaviour("error_event", code="device_error"),
    Behaviour("no_done"),
]


def test_failures_are_counted_by_status_and_code_and_never_stop_the_run(tmp_path: Path) -> None:
    with FakeOpenAIServer(lambda i, body: FAILURES[i % len(FAILURES)]) as server:
        code, result = bench(server.url, tmp_path, "--concurrency", "1", "--requests", "16")
    assert code == 0 and result is not None
    level = result["levels"][0]
    assert (level["requests"], level["completed"], level["failed"]) == (16, 2, 14)
    assert {(f["http_status"], f["error_code"]): f["count"] for f in level["failures"]} == {
        (429, "rate_limit_exceeded"): 2,
        (500, "none"): 2,
        (503, "draining"): 2,
        (502, "invalid_response"): 2,
        (200, "connection_error"): 2,
        (200, "device_error"): 2,
        (200, "incomplete_stream"): 2,
    }
    # Only the completed requests count in throughput and latency.
    assert level["output_tokens"] == 16 and level["e2e_s"]["count"] == 2


def test_a_server_that_refuses_connections_is_reported_not_crashed_on(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, result = bench(f"http://127.0.0.1:{port}", tmp_path, "--model", "m", "--requests", "3")
    assert code == 1 and result is not None
    assert result["levels"][0]["failures"] == [{"http_status": None, "error_code": "connection_error", "count": 3}]
    assert "no request completed" in capsys.readouterr().err


def test_without_a_model_an_unreachable_server_is_one_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, result = bench(f"http://127.0.0.1:{port}", tmp_path)
    assert code == 1 and result is None
    assert "listed no model" in capsys.readouterr().err


def test_a_request_slower_than_the_timeout_fails_as_a_timeout(tmp_path: Path) -> None:
    with FakeOpenAIServer(lambda i, body: Behaviour(tokens=4, gap_s=0.5)) as server:
        code, result = bench(server.url, tmp_path, "--requests", "2", "--timeout", "0.3")
    assert code == 1 and result is not None
    assert result["levels"][0]["failures"] == [{"http_status": 200, "error_code": "timeout", "count": 2}]


def test_without_usage_tokens_are_counted_by_the_tokenizer_given(tmp_path: Path, tiny_package: Path) -> None:
    with FakeOpenAIServer(lambda i, body: Behaviour(tokens=5, usage=False)) as server:
        code, chunks = bench(server.url, tmp_path, "--requests", "2", name="chunks.json")
        code_tok, tokenized = bench(server.url, tmp_path, "--requests", "2", "--tokenizer", str(tiny_package), name="tok.json")
    assert code == code_tok == 0 and chunks is not None and tokenized is not None
    assert chunks["levels"][0]["token_count"] == ["chunks"] and chunks["levels"][0]["output_tokens"] == 10
    # " t0 t1 t2 t3 t4" is more than one token a chunk in SmolLM2's vocabulary.
    assert tokenized["levels"][0]["token_count"] == ["tokenizer"] and tokenized["levels"][0]["output_tokens"] > 10


def test_the_duration_bounds_a_level(tmp_path: Path) -> None:
    with FakeOpenAIServer(lambda i, body: Behaviour(tokens=2, gap_s=0.05)) as server:
        code, result = bench(server.url, tmp_path, "--requests", "0", "--duration", "0.5", "--concurrency", "2")
    assert code == 0 and result is not None
    level = result["levels"][0]
    # 2 clients x about 0.1 s a request within 0.5 s: about 10 requests, none started after 0.5 s.
    assert 4 <= level["requests"] <= 14
    assert max(r["start_s"] for r in level["records"]) < 0.5


def test_rate_mode_sends_requests_at_the_seeded_poisson_arrivals(tmp_path: Path) -> None:
    with FakeOpenAIServer(lambda i, body: Behaviour(tokens=2)) as server:
        code, result = bench(server.url, tmp_path, "--rate", "20", "--requests", "30", "--seed", "3")
    assert code == 0 and result is not None
    level = result["levels"][0]
    assert level["mode"] == "rate" and level["rate"] == 20 and level["completed"] == 30
    expected = arrival_offsets(20, 3, 30, None)
    assert level["arrivals_s"] == pytest.approx(expected, abs=1e-6)
    # The server saw them at those offsets (relative to the first), within scheduling noise.
    seen = [t - server.arrivals[0] for t in server.arrivals]
    assert seen == pytest.approx([t - expected[0] for t in expected], abs=0.05)


def test_poisson_arrivals_have_the_rate_as_mean_and_respect_both_bounds() -> None:
    offsets = arrival_offsets(4.0, seed=1, count=4000, duration_s=None)
    gaps = [b - a for a, b in zip([0.0, *offsets], offsets)]
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.08)  # exponential: sd = mean
    assert arrival_offsets(4.0, seed=1, count=4000, duration_s=None) == offsets
    assert max(arrival_offsets(4.0, seed=1, count=None, duration_s=10.0)) < 10.0
    assert len(arrival_offsets(4.0, seed=1, count=5, duration_s=100.0)) == 5


def test_rate_mode_with_max_concurrency_holds_arrivals_back(tmp_path: Path) -> None:
    with FakeOpenAIServer(lambda i, body: Behaviour(tokens=2, gap_s=0.1)) as server:
        code, result = bench(server.url, tmp_path, "--rate", "100", "--requests", "6", "--max-concurrency", "1")
    assert code == 0 and result is not None
    starts = sorted(r["start_s"] for r in result["levels"][0]["records"])
    assert all(b - a >= 0.15 for a, b in zip(starts, starts[1:]))  # one at a time, 0.2 s each


def test_multi_turn_resends_each_conversation_with_its_history(tmp_path: Path) -> None:
    with FakeOpenAIServer(lambda i, body: Behaviour(tokens=3)) as server:
        code, result = bench(server.url, tmp_path, "--dataset", "multi-turn", "--requests", "3")
    assert code == 0 and result is not None
    first, second, third = server.bodies
    assert [m["role"] for m in first["messages"]] == ["user"]
    assert [m["role"] for m in third["messages"]] == ["user", "assistant", "user", "assistant", "user"]
    assert second["messages"][1] == {"role": "assistant", "content": " t0 t1 t2"}
    assert second["messages"][:1] == first["messages"] and third["messages"][:3] == second["messages"]
    assert [b["seed"] for b in server.bodies] == [b["seed"] for b in server.bodies[:1]] + [
        server.bodies[0]["seed"] + 1, server.bodies[0]["seed"] + 2
    ] and server.bodies[0]["seed"] % MAX_TURNS == 0


def test_extra_body_fields_reach_the_server(tmp_path: Path) -> None:
    with FakeOpenAIServer(lambda i, body: Behaviour(tokens=1)) as server:
        code, _ = bench(server.url, tmp_path, "--requests", "1", "--extra-body", '{"top_p": 0.9, "top_k": -1}')
    assert code == 0 and server.bodies[0]["top_p"] == 0.9 and server.bodies[0]["top_k"] == -1


FLARE_METRICS = """# TYPE flare_device_statuses_total counter
flare_device_statuses_total{{status="OK"}} {ok}
flare_device_statuses_total{{status="NONFINITE_LOGITS"}} {bad}
# TYPE flare_generated_tokens_total counter
flare_generated_tokens_total {generated}
# TYPE flare_draft_tokens_proposed_total counter
flare_draft_tokens_proposed_total{{drafter="ngram"}} {proposed}
flare_draft_tokens_proposed_total{{drafter="mtp"}} 5
# TYPE flare_draft_tokens_accepted_total counter
flare_draft_tokens_accepted_total{{drafter="ngram"}} {accepted}
flare_draft_tokens_accepted_total{{drafter="mtp"}} 2
# TYPE flare_draft_tokens_accepted_per_round histogram
flare_draft_tokens_accepted_per_round_bucket{{le="+Inf"}} {rounds}
flare_draft_tokens_accepted_per_round_count {rounds}
flare_draft_tokens_accepted_per_round_sum {accepted}
"""


def test_against_flare_the_counters_before_and_after_each_level_are_reported(tmp_path: Path) -> None:
    counters = {"ok": 10, "bad": 0, "generated": 30, "proposed": 8, "accepted": 4, "rounds": 2}
    server = FakeOpenAIServer(lambda i, body: Behaviour(tokens=4))
    server.metrics_text = FLARE_METRICS.format(**counters)

    def choose(index: int, body: dict[str, Any]) -> Behaviour:
        # Each request moves the counters as a round of flare would.
        counters.update(ok=counters["ok"] + 2, bad=counters["bad"] + (index == 1), generated=counters["generated"] + 4,
                        proposed=counters["proposed"] + 4, accepted=counters["accepted"] + 3, rounds=counters["rounds"] + 1)
        server.metrics_text = FLARE_METRICS.format(**counters)
        return Behaviour(tokens=4)

    server.choose = choose
    with server:
        code, result = bench(server.url, tmp_path, "--requests", "2")
    assert code == 0 and result is not None and result["server"]["is_flare"]
    metrics = result["levels"][0]["server_metrics"]
    assert metrics["device_statuses_before"] == {"OK": 10, "NONFINITE_LOGITS": 0}
    assert metrics["device_statuses_after"] == {"OK": 14, "NONFINITE_LOGITS": 1}
    assert metrics["device_statuses"] == {"OK": 4, "NONFINITE_LOGITS": 1}
    assert metrics["generated_tokens"] == 8 and metrics["tokens_per_row_round"] == pytest.approx(8 / 5)
    assert (metrics["draft_tokens_proposed"], metrics["draft_tokens_accepted"]) == (8, 6)
    assert metrics["draft_acceptance"] == pytest.approx(0.75) and metrics["accepted_per_round"] == pytest.approx(3.0)
    # The head's counters did not move over the level: only lookup's drafts are reported.
    assert metrics["drafts_by_drafter"] == {"ngram": {"proposed": 8, "accepted": 6, "acceptance": 0.75}}


def test_plots_are_written_and_several_results_share_the_axes(tmp_path: Path) -> None:
    results = []
    with FakeOpenAIServer(lambda i, body: Behaviour(tokens=4, gap_s=0.001)) as server:
        for label in ("alpha", "beta"):
            code, _ = bench(server.url, tmp_path, "--concurrency", "1,2", "--requests", "4", "--label", label,
                            "--plot", str(tmp_path / f"plots-{label}"), name=f"{label}.json")
            assert code == 0
            results.append(tmp_path / f"{label}.json")
    names = ("throughput.png", "latency.png", "latency_cdf.png")
    for name in names:
        assert (tmp_path / "plots-alpha" / name).stat().st_size > 5000
    together = tmp_path / "together"
    assert main(["bench", "plot", *map(str, results), "--out", str(together), "--title", "two runs"]) == 0
    for name in names:
        png = (together / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 5000


def test_plot_refuses_files_that_are_not_results(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "other.json"
    other.write_text('{"hello": 1}')
    assert main(["bench", "plot", str(other), "--out", str(tmp_path / "p")]) == 1
    assert "is not a flare bench result" in capsys.readouterr().err


def test_without_matplotlib_plotting_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with FakeOpenAIServer(lambda i, body: Behaviour(tokens=2)) as server:
        code, _ = bench(server.url, tmp_path, "--requests", "1")
    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert main(["bench", "plot", str(tmp_path / "result.json"), "--out", str(tmp_path / "p")]) == 1
    assert "pip install 'flare[bench]'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ([], "--url is required"),
        (["--url", "http://x", "--concurrency", "1,zero"], "--concurrency takes a comma-separated list"),
        (["--url", "http://x", "--rate", "-1"], "--rate takes a comma-separated list"),
        (["--url", "http://x", "--max-concurrency", "2"], "--max-concurrency applies to --rate"),
        (["--url", "http://x", "--requests", "0"], "give --duration too"),
        (["--url", "http://x", "--max-tokens", "0"], "--max-tokens must be at least 1"),
        (["--url", "http://x", "--extra-body", "[1]"], "must be a JSON object"),
        (["--url", "http://x", "--extra-body", '{"stream": false}'], "may not set 'stream'"),
        (["--url", "http://x", "--dataset", "nope"], "neither one of"),
    ],
)
def test_bad_usage_is_one_line_and_exit_2(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
