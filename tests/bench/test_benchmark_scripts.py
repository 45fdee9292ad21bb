"""The benchmark scripts that drive the engine's own classes run against today's API (a change
to PlannedRow once broke benchmarks/mtp_head.py without a test noticing)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.mtp_heads import repeat_head_state, write_head_package

ROOT = Path(__file__).resolve().parents[2]


def test_the_draft_head_cost_benchmark_runs_on_a_package_with_a_head(make_package, package_parts):
    vocab = torch.arange(0, package_parts["config"].vocab_size, 3)
    head_state = repeat_head_state(package_parts["config"], package_parts["state_dict"], vocab, mix=0.5, seed=2)
    package = write_head_package(make_package, package_parts, head_state, draft_tokens=3)
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "mtp_head.py"), str(package), "--batch", "1", "2", "--context", "20",
         "--rounds", "1", "--threads", "1"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(rows) == 2 and all(line.count("|") == 5 for line in rows), result.stdout


def test_the_drafters_benchmark_compares_configurations_on_one_model_thread(make_package, package_parts):
    vocab = torch.arange(0, package_parts["config"].vocab_size, 3)
    head_state = repeat_head_state(package_parts["config"], package_parts["state_dict"], vocab, mix=0.5, seed=2)
    package = write_head_package(make_package, package_parts, head_state, draft_tokens=3)
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "drafters.py"), str(package), "--configs", "K0,ngram,mtp:2,auto",
         "--answers", "2", "--max-tokens", "8", "--threads", "1"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    rows = {line.split("|")[1].strip(): line for line in result.stdout.splitlines() if line.startswith("| ") and "x |" in line}
    assert set(rows) == {"K0", "ngram", "mtp:2", "auto"}, result.stdout
    assert all(line.rstrip().endswith("2/2 |") for line in rows.values())  # greedy: the same answers
    assert "n-gram lookup's ceiling on K0's answers" in result.stdout and "K = unbounded: " in result.stdout


def test_compare_refuses_a_versus_draft_length_past_the_packages_before_starting_a_server(make_package, package_parts):
    vocab = torch.arange(0, package_parts["config"].vocab_size, 3)
    head_state = repeat_head_state(package_parts["config"], package_parts["state_dict"], vocab, mix=0.5, seed=2)
    package = write_head_package(make_package, package_parts, head_state, draft_tokens=3)
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compare.py"), "--package", str(package), "--versus-draft-tokens", "4",
         "--skip-llama-cpp", "--skip-transformers"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "--versus-draft-tokens 4 is more than the package's 3 (flare run may only lower it)" in result.stderr


def test_lookup_ceiling_counts_the_rounds_a_copied_answer_takes_at_each_draft_length(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")  # the script sets it on import where unset
    spec = importlib.util.spec_from_file_location("drafters_benchmark", ROOT / "benchmarks" / "drafters.py")
    drafters = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, drafters)  # its dataclasses look their module up
    spec.loader.exec_module(drafters)
    prompt, answer = (5, 6, 7, 8, 9, 10, 11, 12, 99), [5, 6, 7, 8, 9, 10, 11, 12]
    # The first token has no earlier occurrence to follow (a round of one token); then lookup
    # finds "5" in the prompt and proposes what followed it: with K = 4, 6-9 accepted and 10
    # sampled, then 11 and 12 (its 99 past the answer's end); unbounded, 6-12 at once.
    four, unbounded = drafters.lookup_ceiling([prompt], [answer], 4), drafters.lookup_ceiling([prompt], [answer], None)
    assert (four.tokens_per_round, unbounded.tokens_per_round) == (8 / 3, 8 / 2)
    # The drafts the answer did not take, proposed past its end: 99 and 5 (K = 4: 11 12 99 5), 99.
    assert (four.rejected_per_round, unbounded.rejected_per_round) == (2 / 3, 1 / 2)
    # An answer that leaves the text: 6 and 7 accepted, 8 and 9 rejected for 1 (the round's own
    # token), then nothing to follow "1" and a round of one token.
    left = drafters.lookup_ceiling([prompt], [[5, 6, 7, 1, 2]], 4)
    assert (left.tokens_per_round, left.rejected_per_round) == (5 / 3, 2 / 3)


def test_the_lookup_edits_benchmark_replays_lookup_over_edited_copies(make_package):
    package = make_package()
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "lookup_edits.py"), str(ROOT / "README.md"),
         str(ROOT / "flare" / "engine" / "drafters" / "ngram.py"), "--package", str(package), "--tokens", "300"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    rows = [line.split("|") for line in result.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row[1].strip() for row in rows] == ["4", "8", "16"], result.stdout
    # Copied text: every round yields more than its own token, and never more than K + 1.
    assert all(1 < float(row[2]) <= int(row[1]) + 1 for row in rows), result.stdout


def test_compare_names_its_files_for_a_jsonl_dataset_by_the_files_stem(monkeypatch: pytest.MonkeyPatch):
    spec = importlib.util.spec_from_file_location("compare_benchmark", ROOT / "benchmarks" / "compare.py")
    compare = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, compare)
    spec.loader.exec_module(compare)
    assert compare.dataset_label("copy") == "copy"
    assert compare.dataset_label("/tmp/sets/long_copy.jsonl") == "long_copy"


def test_the_paged_attention_benchmark_times_each_pool_dtype_over_a_cut_row():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "paged_attention.py"), "--context", "1100", "--query-len", "1", "5",
         "--calls", "2", "--repeats", "1", "--threads", "1"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith("| 1100 |")]
    assert [row[1].strip() for row in rows] == ["1", "5"], result.stdout
    assert all(float(cell) > 0 for row in rows for cell in row[2:]) and all(len(row) == 5 for row in rows)
