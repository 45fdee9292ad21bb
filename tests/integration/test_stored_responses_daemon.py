"""Stored Responses against the real daemon, through the official openai SDK unchanged: a
two-turn conversation by previous_response_id across a restart on the same state directory,
another key's 404, the store's file mode, and `flare ctl` reporting and clearing the store."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from tests.integration.daemon_process import DaemonProcess, start_daemon

ROOT = Path(__file__).resolve().parents[2]
KEY_A, KEY_B = "key-a", "key-b"
# Long enough to fill whole prefix-cache blocks, so a continuation's prefill is visibly reused.
OPENING = "Tell me about the sea. " * 12


@pytest.fixture
def workdir() -> Iterator[Path]:
    # AF_UNIX paths are limited to 108 bytes: a short directory rather than pytest's tmp_path.
    path = Path(tempfile.mkdtemp(prefix="flare-store-", dir="/tmp"))
    yield path
    shutil.rmtree(path)


def start(package: Path, workdir: Path) -> DaemonProcess:
    return start_daemon(
        package,
        [
            "--state-dir", str(workdir / "state"), "--control-socket", str(workdir / "control.sock"),
            "--api-key", KEY_A, "--api-key", KEY_B,
        ],
    )


def client_of(daemon: DaemonProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{daemon.base_url}/v1", api_key=key, max_retries=0)


def ctl(workdir: Path, *argv: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "flare.cli.main", "ctl", "--socket", str(workdir / "control.sock"), "--json", *argv],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_conversation_continues_by_previous_response_id_across_a_restart(tiny_package: Path, workdir: Path) -> None:
    daemon = start(tiny_package, workdir)
    try:
        model = client_of(daemon, KEY_A).models.list().data[0].id
        first = client_of(daemon, KEY_A).responses.create(
            model=model, input=OPENING, max_output_tokens=8, temperature=0
        )
        assert first.store is True and first.status in ("completed", "incomplete")
        assert daemon.stop() == 0
    finally:
        daemon.kill()

    store_file = workdir / "state" / "responses.sqlite3"
    assert stat.S_IMODE(os.stat(store_file).st_mode) == 0o600

    daemon = start(tiny_package, workdir)
    try:
        a = client_of(daemon, KEY_A)
        second = a.responses.create(
            model=model, input="And the mountains?", previous_response_id=first.id, max_output_tokens=8, temperature=0
        )
        assert second.previous_response_id == first.id
        # The first turn's input and answer came back from the store into the prompt.
        assert second.usage is not None and first.usage is not None
        assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
        kept = a.responses.retrieve(first.id)
        assert kept.id == first.id and kept.output_text == first.output_text
        items = a.responses.input_items.list(second.id, order="asc")
        assert [item.type for item in items.data] == ["message", "message", "message"]
        assert items.data[0].content[0].text == OPENING

        # A third turn in the same daemon: the earlier turns' prefill comes from the prefix cache.
        third = a.responses.create(
            model=model, input="Thanks.", previous_response_id=second.id, max_output_tokens=4, temperature=0
        )
        assert third.usage is not None and third.usage.input_tokens_details.cached_tokens > 0

        other = client_of(daemon, KEY_B)
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(first.id)
        with pytest.raises(openai.BadRequestError) as refused:
            other.responses.create(model=model, input="Hi", previous_response_id=first.id, max_output_tokens=4)
        assert refused.value.body["param"] == "previous_response_id"

        status = ctl(workdir, "status")["responses_store"]
        assert status["responses"] == 3 and status["bytes"] > 0 and status["path"] == str(store_file)
        assert ctl(workdir, "responses", "clear")["dropped_responses"] == 3
        with pytest.raises(openai.NotFoundError):
            a.responses.retrieve(first.id)
    finally:
        daemon.kill()
