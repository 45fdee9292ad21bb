"""The hidden directory a package is written into before it is renamed into place.

`write_package` writes `.NAME.partial-<suffix>` next to the destination and removes it on any
failure or interrupt it lives through (SIGINT, and SIGTERM, which `flare export` turns into
the same unwinding). An export killed outright (SIGKILL, power loss) cannot: its directory of
some hundred megabytes stays. So every export holds an exclusive `flock` on its staging
directory while it writes, and before writing, removes every staging directory of the same
destination that no live export holds (the kernel drops a lock when its holder dies, however
it dies), with a log line for each. A concurrent export to the same destination keeps its lock,
and its directory.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger("flare.preparation")


@dataclass
class Staging:
    """A staging directory and the lock that says an export is writing it."""

    path: Path
    _lock: int

    def release(self) -> None:
        """Give up the lock (once the directory is renamed into place, or removed)."""
        if self._lock >= 0:
            os.close(self._lock)
            self._lock = -1


def _pattern(out_dir: Path) -> str:
    return f".{out_dir.name}.partial-*"


def claim_staging(out_dir: Path) -> Staging:
    """A new, empty, locked staging directory for `out_dir` (whose parent exists)."""
    path = out_dir.parent / f".{out_dir.name}.partial-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    lock = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new and ours: never contended
    return Staging(path, lock)


def remove_abandoned_staging(out_dir: Path) -> list[Path]:
    """Remove the staging directories of `out_dir` that no running export holds; returns them."""
    removed = []
    for path in sorted(out_dir.parent.glob(_pattern(out_dir))):
        if path.is_symlink() or not path.is_dir():
            continue
        try:
            lock = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live export is writing it
            shutil.rmtree(path, ignore_errors=True)
        finally:
            os.close(lock)
        log.warning("export_partial_removed", path=str(path), reason="left by an interrupted export")
        removed.append(path)
    return removed
