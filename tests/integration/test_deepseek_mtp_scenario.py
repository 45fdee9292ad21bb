"""Issue 39's contract scenario: a DeepSeek-V3 checkpoint exported with `--drafter mtp
--mtp-draft-tokens 7 --vocabulary-parallel-sampling` (its own MTP layer becomes the draft head),
served by `flare run --drafter mtp --draft-length fixed` at tensor parallel 1 and 2: a request
with top_p 0.95 is answered 200 with the clamp reported, drafts are accepted (more than one token
per drafting round on copy text, as /metrics reads), and greedy output is the output of the same
package served with --draft-tokens 0. The draft length is held fixed because on this tiny model a
head step costs about what it saves, and the adaptive length pauses the head after its first
drafts."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from tests.deepseek_mtp import write_mtp_checkpoint
from tests.integration.daemon_process import DaemonProcess, start_daemon
from tests.package_commands import flare

from flare.package.directory import open_package
from flare.preparation.source import ModelSource

CHAT = [{"role": "user", "content": "one two three four one two three four"}]


@pytest.fixture(scope="module")
def deepseek_mtp_package(smollm2_source: ModelSource, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("deepseek-mtp-scenario")
    checkpoint = write_mtp_checkpoint(root / "hf", smollm2_source.tokenizer_json, smollm2_source.chat_template)
    out = root / "pkg"
    code = flare(
        "export", str(checkpoint.path), "-o", str(out),
        "--drafter", "mtp", "--mtp-draft-tokens", "7", "--vocabulary-parallel-sampling",
        # The head's held-out acceptance is measured on what 2 s of answers give: the scenario
        # reads only that the layer was imported as the head.
        "--distill-seconds", "2",
    )
    assert code == 0
    head = open_package(out).manifest.draft_head
    assert head is not None and head.layer == "target" and head.draft_tokens == 7
    return out


def chat(daemon: DaemonProcess, **fields: object) -> httpx.Response:
    body = {"model": daemon.model_name(), "messages": CHAT, "max_tokens": 40, **fields}
    return httpx.post(f"{daemon.base_url}/v1/chat/completions", json=body, timeout=300)


@dataclass(frozen=True)
class DraftFigures:
    """What /metrics says of the daemon's drafts since it started."""

    accepted: float  # the head's draft tokens accepted
    drafting_rows: float  # rows that verified drafts (flare_draft_tokens_accepted_per_round's count)
    accepted_in_drafting_rows: float  # that histogram's sum
    rows: float  # rows the sampler reported, each with its device status
    generated: float

    @property
    def tokens_per_drafting_round(self) -> float:
        """A drafting row emits the drafts it accepted and one token more."""
        return 1.0 + self.accepted_in_drafting_rows / max(self.drafting_rows, 1.0)

    @property
    def tokens_per_round(self) -> float:
        return self.generated / max(self.rows, 1.0)


def draft_figures(daemon: DaemonProcess) -> DraftFigures:
    text = httpx.get(f"{daemon.base_url}/metrics", timeout=30).text

    def value(pattern: str) -> float:
        match = re.search(rf"^{pattern} (\S+)$", text, re.MULTILINE)
        assert match is not None, pattern
        return float(match.group(1))

    return DraftFigures(
        accepted=value(r'flare_draft_tokens_accepted_total\{drafter="mtp"\}'),
        drafting_rows=value("flare_draft_tokens_accepted_per_round_count"),
        accepted_in_drafting_rows=value("flare_draft_tokens_accepted_per_round_sum"),
        rows=sum(float(n) for n in re.findall(r"^flare_device_statuses_total\{[^}]*\} (\S+)$", text, re.MULTILINE)),
        generated=value("flare_generated_tokens_total"),
    )


def greedy_answer(package: Path, flags: list[str]) -> tuple[str, DraftFigures]:
    daemon = start_daemon(package, flags)
    try:
        response = chat(daemon, temperature=0.0)
        assert response.status_code == 200, response.text
        answer = response.json()["choices"][0]["message"]["content"]
        figures = draft_figures(daemon)
        assert daemon.stop() == 0
        return answer, figures
    finally:
        daemon.kill()


def scenario(package: Path, tensor_parallel: int) -> None:
    flags = ["--tensor-parallel", str(tensor_parallel), "--drafter", "mtp", "--draft-length", "fixed"]
    daemon = start_daemon(package, flags)
    try:
        response = chat(daemon, top_p=0.95, temperature=0.8, seed=7)
        assert response.status_code == 200, response.text
        adjusted = {a["param"]: a for a in response.json()["flare"]["adjusted"]}
        assert (adjusted["top_p"]["requested"], adjusted["top_p"]["applied"]) == (0.95, 1.0)
        assert "top_p" in response.headers["Flare-Sampling-Adjusted"].split(",")
        greedy = chat(daemon, temperature=0.0)
        assert greedy.status_code == 200, greedy.text
        speculative = greedy.json()["choices"][0]["message"]["content"]
        (loaded,) = daemon.events("engine_loaded")
        figures = draft_figures(daemon)
        print(
            f"TP {tensor_parallel}: {figures.accepted:g} drafts accepted in {figures.drafting_rows:g} of "
            f"{figures.rows:g} rows, {figures.tokens_per_drafting_round:.2f} tokens per drafting round, "
            f"{figures.tokens_per_round:.2f} per round"
        )
        assert daemon.stop() == 0
        assert (loaded["drafter"], loaded["draft_tokens"], loaded["draft_length"]) == ("mtp", 7, "fixed")
        assert figures.accepted > 0 and figures.tokens_per_drafting_round > 1.0 and figures.tokens_per_round > 1.0
        # Held fixed, every row drafts but each answer's first (the prompt's) and any its
        # max_tokens leaves no room in; the adaptive length drafts in 1 row of 79 here.
        assert figures.drafting_rows > figures.rows / 2
    finally:
        daemon.kill()
    plain, undrafted = greedy_answer(package, [*flags, "--draft-tokens", "0"])
    assert undrafted.accepted == 0
    assert speculative == plain


def test_the_deepseek_mtp_scenario_at_tensor_parallel_1(deepseek_mtp_package: Path) -> None:
    scenario(deepseek_mtp_package, 1)


def test_the_deepseek_mtp_scenario_at_tensor_parallel_2(deepseek_mtp_package: Path) -> None:
    scenario(deepseek_mtp_package, 2)
