"""Exports that do not finish (issue 29, items 6 and 7): SIGTERM at several points of an export
of the default model leaves nothing (it unwinds as Ctrl-C does); a partial directory left by a
killed export (SIGKILL) is removed, with a log line, by the next export to the same
destination, while a running export's own is never touched; a full file system ends in one
line and leaves nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from tests.package_commands import flare

from flare.package.staging import claim_staging, remove_abandoned_staging

ROOT = Path(__file__).resolve().parents[2]
WEIGHTS = "model.safetensors"


def _start_export(out: Path) -> subprocess.Popen[str]:
    # float32, 538 MB of weights: long enough to be caught half written (the blocks package the
    # default export makes writes 96 MB, often before a poll sees it).
    return subprocess.Popen(
        [sys.executable, "-m", "flare.cli.main", "export", "default", "-o", str(out), "--dtype", "float32"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )


def _partials(out: Path) -> list[Path]:
    return list(out.parent.glob(f".{out.name}.partial-*"))


def _wait_for(condition: Callable[[], bool], process: subprocess.Popen[str], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert process.poll() is None, f"the export ended first: {process.communicate()}"
        assert time.monotonic() < deadline, "the export never reached the point"
        time.sleep(0.01)


def _weights_written(out: Path, size: int) -> Callable[[], bool]:
    def reached() -> bool:
        return any((p / WEIGHTS).exists() and (p / WEIGHTS).stat().st_size >= size for p in _partials(out))

    return reached


# Points of an export: reading the source, the staging directory just made, weights half
# written, weights whole (tokenizer and checksums being written).
POINTS: dict[str, Callable[[Path], Callable[[], bool]]] = {
    "reading the source": lambda out: lambda: True,
    "staging made": lambda out: lambda: bool(_partials(out)),
    "weights half written": lambda out: _weights_written(out, 100 << 20),
    "tokenizer written": lambda out: lambda: any((p / "tokenizer.json").exists() for p in _partials(out)),
}


@pytest.mark.parametrize("point", list(POINTS))
def test_sigterm_at_any_point_of_an_export_leaves_nothing(point: str, tmp_path: Path) -> None:
    out = tmp_path / "package"
    process = _start_export(out)
    _wait_for(POINTS[point](out), process)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    # Before the export installs its handler (the interpreter starting), SIGTERM's default ends it.
    assert process.returncode in (128 + signal.SIGTERM, -signal.SIGTERM), stderr
    assert "Traceback" not in stderr, stderr
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())


def test_a_killed_exports_partial_directory_is_removed_by_the_next_export(tmp_path: Path, tiny_hf_directory: Path) -> None:
    out = tmp_path / "package"
    process = _start_export(out)
    _wait_for(_weights_written(out, 50 << 20), process)
    process.kill()
    process.wait(30)
    [left] = _partials(out)
    # The next export to the destination, of any source: the tiny model's takes a moment.
    again = subprocess.run(
        [sys.executable, "-m", "flare.cli.main", "export", str(tiny_hf_directory), "-o", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert again.returncode == 0, again.stderr
    assert not left.exists() and _partials(out) == []
    assert "export_partial_removed" in again.stderr and left.name in again.stderr, again.stderr
    assert (out / WEIGHTS).is_file()


def test_a_running_exports_staging_directory_is_never_removed(tmp_path: Path) -> None:
    out = tmp_path / "package"
    running = claim_staging(out)
    abandoned = tmp_path / ".package.partial-0123456789ab"
    abandoned.mkdir()
    (abandoned / WEIGHTS).write_bytes(b"half")
    assert remove_abandoned_staging(out) == [abandoned]
    assert running.path.is_dir() and not abandoned.exists()
    running.release()
    assert remove_abandoned_staging(out) == [running.path]


def test_an_export_onto_a_full_file_system_is_one_line_and_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tiny_hf_directory: Path
) -> None:
    from safetensors import SafetensorError

    import flare.package.directory as package

    def full(*_: object, **__: object) -> None:
        raise SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        )

    monkeypatch.setattr(package, "save_file", full)
    out = tmp_path / "package"
    assert flare("export", str(tiny_hf_directory), "-o", str(out)) == 1
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "No space left on device" in error[0], error
    assert not out.exists() and _partials(out) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_an_export_onto_a_real_50_mib_file_system_is_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    mount = tmp_path / "small"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=50m", "tmpfs", str(mount)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr!r}")
    try:
        out = mount / "package"
        result = subprocess.run(
            [sys.executable, "-m", "flare.cli.main", "export", "default", "-o", str(out)],
            capture_output=True, text=True, timeout=600, cwd=ROOT,
        )
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1 and len(lines) == 1 and "No space left" in lines[0], result.stderr
        assert list(mount.iterdir()) == []
    finally:
        subprocess.run(["umount", str(mount)], check=False)
