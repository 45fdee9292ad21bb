"""What `flare run` serves and refuses: the sampler contract checked at load, `--sampling-policy
unfiltered`, and a vocabulary-parallel package that clamps a filtered request instead of failing it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
from tests.integration.daemon_process import DaemonProcess, start_daemon

from flare.package.manifest import MAX_CONTEXT

CHAT = [{"role": "user", "content": "Tell me about the sea."}]


def refusal(package: Path, *flags: str) -> tuple[int, str]:
    daemon = DaemonProcess(package, *flags)
    try:
        code = daemon.process.wait(120)
    finally:
        daemon.kill()
    daemon._reader.join(5)
    return code, daemon.log()


def test_a_package_whose_policy_contradicts_its_sampler_is_refused_with_both_fixes(contradicting_package: Path) -> None:
    code, output = refusal(contradicting_package)
    assert code == 2
    assert "--sampling-policy unfiltered" in output and "flare export" in output
    assert "Traceback" not in output


def test_a_tampered_package_is_refused(tiny_package: Path, tmp_path: Path) -> None:
    package = shutil.copytree(tiny_package, tmp_path / "pkg")
    with open(package / "model.safetensors", "r+b") as weights:
        weights.seek(-16, 2)
        weights.write(b"\0" * 16)
    code, output = refusal(package)
    assert code == 2
    assert "cannot be used" in output and "Traceback" not in output


@pytest.mark.parametrize("context", [1 << 40, 1 << 28])
def test_a_package_serving_an_implausible_context_is_refused_in_one_line(tiny_package: Path, tmp_path: Path, context: int) -> None:
    """A package exported before the bound (issue 40, item 4): `flare run` used to die in
    rope_tables allocating 4.4 TB."""
    package = shutil.copytree(tiny_package, tmp_path / "pkg")
    manifest = json.loads((package / "manifest.json").read_text())
    manifest["serving"]["max_context"] = manifest["model"]["config"]["max_position_embeddings"] = context
    (package / "manifest.json").write_text(json.dumps(manifest))
    code, output = refusal(package)
    assert code == 2 and "Traceback" not in output, output
    last = output.strip().splitlines()[-1]
    assert last.startswith(f"flare run: error: the package at {package} cannot be used"), output
    assert f"serving: max_context {context} is beyond the longest context flare serves, {MAX_CONTEXT} tokens" in last


def test_the_mtp_drafter_is_refused_for_a_package_without_a_draft_head(tiny_package: Path) -> None:
    code, output = refusal(tiny_package, "--drafter", "mtp")
    assert code == 2
    assert "--drafter mtp: the package at" in output and "ships no draft head" in output
    assert "--drafter mtp` to distill one, or run with --drafter ngram" in output
    assert "Traceback" not in output


def filtered_chat(daemon: DaemonProcess, stream: bool) -> httpx.Response:
    body = {"model": daemon.model_name(), "messages": CHAT, "top_p": 0.95, "top_k": 40, "max_tokens": 16, "stream": stream}
    return httpx.post(f"{daemon.base_url}/v1/chat/completions", json=body, timeout=120)


def test_sampling_policy_unfiltered_serves_a_contradicting_package_unfiltered(contradicting_package: Path) -> None:
    daemon = start_daemon(contradicting_package, ["--sampling-policy", "unfiltered", "--vocabulary-shards", "2"])
    try:
        response = filtered_chat(daemon, stream=False)
        assert response.status_code == 200, response.text
        assert response.headers["Flare-Sampling-Adjusted"] == "top_k,top_p"
        sampling = response.json()["flare"]["sampling"]
        assert (sampling["top_p"], sampling["top_k"]) == (1.0, -1)
        assert daemon.stop() == 0
    finally:
        daemon.kill()


def test_a_vocabulary_parallel_package_serves_top_p_095_as_1(vocabulary_parallel_package: Path) -> None:
    daemon = start_daemon(vocabulary_parallel_package, ["--vocabulary-shards", "2"])
    try:
        response = filtered_chat(daemon, stream=False)
        assert response.status_code == 200, response.text
        adjusted = {a["param"]: a for a in response.json()["flare"]["adjusted"]}
        assert (adjusted["top_p"]["requested"], adjusted["top_p"]["applied"]) == (0.95, 1.0)
        streamed = filtered_chat(daemon, stream=True)
        assert streamed.status_code == 200 and "top_p" in streamed.headers["Flare-Sampling-Adjusted"].split(",")
        assert streamed.text.endswith("data: [DONE]\n\n") and '"error"' not in streamed.text
        assert daemon.stop() == 0
    finally:
        daemon.kill()
