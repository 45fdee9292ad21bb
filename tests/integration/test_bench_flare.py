"""`flare bench` against the real daemon on the tiny package: what a user benchmarking flare sees."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.integration.daemon_process import DaemonProcess, start_daemon

from flare.cli.main import main


@pytest.fixture(scope="module")
def daemon(tiny_package: Path) -> Iterator[DaemonProcess]:
    process = start_daemon(tiny_package, ["--max-concurrency", "4", "--api-key", "bench-key", "--metrics-require-key"])
    yield process
    assert process.stop() == 0, process.log()


def test_bench_measures_flare_with_its_device_statuses_and_drafts(daemon: DaemonProcess, tmp_path: Path) -> None:
    out = tmp_path / "flare.json"
    code = main([
        "bench", "--url", daemon.base_url, "--api-key", "bench-key", "--dataset", "copy", "--concurrency", "1,4",
        "--requests", "6", "--max-tokens", "12", "--temperature", "0", "--warmup", "1", "--out", str(out),
    ])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["server"]["is_flare"] and result["server"]["model"] == "tiny-llama"
    for level in result["levels"]:
        assert (level["completed"], level["failed"]) == (6, 0)
        assert level["token_count"] == ["usage"]  # flare reports usage in the stream
        assert 6 <= level["output_tokens"] <= 72 and level["prompt_tokens"] > 6 * 50
        metrics = level["server_metrics"]
        assert metrics is not None
        # Every row the kernels sampled in this level was OK, and it produced the tokens the client got.
        assert metrics["device_statuses"]["OK"] > 0
        assert sum(v for k, v in metrics["device_statuses"].items() if k != "OK") == 0
        assert metrics["generated_tokens"] == level["output_tokens"]
        assert metrics["device_statuses_after"]["OK"] - metrics["device_statuses_before"]["OK"] == metrics["device_statuses"]["OK"]
        assert metrics["tokens_per_row_round"] >= 1.0


def test_prompts_past_the_context_are_counted_as_flare_refuses_them(daemon: DaemonProcess, tmp_path: Path) -> None:
    out = tmp_path / "long.json"
    # The tiny package's context is 512 tokens; every long prompt is longer.
    code = main([
        "bench", "--url", daemon.base_url, "--api-key", "bench-key", "--dataset", "long-prompt",
        "--requests", "3", "--warmup", "0", "--out", str(out),
    ])
    assert code == 1
    level = json.loads(out.read_text())["levels"][0]
    assert level["failures"] == [{"http_status": 400, "error_code": "context_length_exceeded", "count": 3}]


def test_a_wrong_key_is_counted_as_the_servers_401(daemon: DaemonProcess, tmp_path: Path) -> None:
    out = tmp_path / "unauthorized.json"
    code = main([
        "bench", "--url", daemon.base_url, "--api-key", "wrong", "--model", "tiny-llama",
        "--requests", "2", "--warmup", "0", "--out", str(out),
    ])
    assert code == 1
    result = json.loads(out.read_text())
    assert not result["server"]["is_flare"]  # /metrics refused the key too
    assert [(f["http_status"], f["count"]) for f in result["levels"][0]["failures"]] == [(401, 2)]
