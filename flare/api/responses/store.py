"""Stored Responses: each complete response of `store: true`, with the input items it answered,
kept in one SQLite file so that `previous_response_id` and `GET /v1/responses/{id}` find it
after a restart.

SQLite is embedded (nothing to run). The file is opened in WAL mode and written one transaction
per response, so a daemon killed mid-write loses no committed response and corrupts none; it is
mode 0600, as it holds conversations. One connection, owned by one `ResponseStore`, serves every
call in one worker thread at a time, so the event loop never waits on the disk. Each response
belongs to the hash of the API key that made it (never the key); retention by age and by total
size is enforced on every write, oldest first.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import structlog

log = structlog.get_logger("flare.daemon.http")

FILE_MODE = 0o600
FILE_NAME = "responses.sqlite3"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    created_at REAL NOT NULL,
    bytes INTEGER NOT NULL,
    input_items TEXT NOT NULL,
    response TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created_at);
"""


def owner_of(api_key: bytes) -> str:
    """Whose a response is: the SHA-256 of the API key it was made with ("" without keys, where
    every request shares one owner)."""
    return hashlib.sha256(api_key).hexdigest() if api_key else ""


@dataclass(frozen=True)
class Retention:
    """How long and how much the store keeps: older or beyond the size, the oldest go first."""

    max_age_s: float
    max_bytes: int


@dataclass(frozen=True)
class StoredResponse:
    """One response as kept: its input items (the earlier turns' included) and its response
    object, whose `output` holds its output items."""

    id: str
    owner: str
    created_at: float
    input_items: list[dict[str, Any]]
    response: dict[str, Any]


@dataclass(frozen=True)
class StoreUse:
    """What the store holds: responses, their bytes, and the oldest one's time (None: empty)."""

    responses: int
    bytes: int
    oldest_created_at: float | None

    def to_json(self) -> dict[str, Any]:
        return {"responses": self.responses, "bytes": self.bytes, "oldest_created_at": self.oldest_created_at}


class ResponseStore:
    """The store's file and its one connection. Every call but `staged` and `use` runs in a
    worker thread; the lock keeps the connection to one thread at a time."""

    def __init__(self, path: Path, retention: Retention, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.retention = retention
        self._clock = clock
        self._lock = threading.Lock()
        self._staged: dict[str, StoredResponse] = {}
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Created 0600 before SQLite opens it; SQLite gives its -wal and -shm files the same mode.
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, FILE_MODE))
        os.chmod(path, FILE_MODE)
        self._connection = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=10.0)
        self._connection.execute("PRAGMA journal_mode=WAL")
        self._connection.execute("PRAGMA synchronous=FULL")
        self._connection.executescript(_SCHEMA)
        self._use = self._measure()

    def close(self) -> None:
        with self._lock:
            self._connection.close()

    def use(self) -> StoreUse:
        """What the store held after its last write (no disk read: `flare ctl status` asks often)."""
        return self._use

    # --- writing ------------------------------------------------------------------------------

    def stage(self, stored: StoredResponse) -> None:
        """Make a complete response findable at once (the client may chain on it before its
        write is committed); `commit` writes it."""
        self._staged[stored.id] = stored

    async def commit(self, response_id: str) -> None:
        """Write a staged response. A write that fails (a full disk) is logged, not raised: the
        client has its answer, which only cannot be continued by id."""
        stored = self._staged.get(response_id)
        if stored is None:
            return
        try:
            await anyio.to_thread.run_sync(self._write, stored)
        except (sqlite3.Error, OSError) as error:
            log.error("responses_store_write_failed", response_id=response_id, path=str(self.path), error=str(error))
        finally:
            self._staged.pop(response_id, None)

    def _write(self, stored: StoredResponse) -> None:
        items = json.dumps(stored.input_items, separators=(",", ":"))
        response = json.dumps(stored.response, separators=(",", ":"))
        size = len(items.encode()) + len(response.encode())
        with self._lock:
            connection = self._connection
            connection.execute("BEGIN IMMEDIATE")
            try:
                connection.execute(
                    "INSERT OR REPLACE INTO responses (id, owner, created_at, bytes, input_items, response) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    (stored.id, stored.owner, stored.created_at, size, items, response),
                )
                self._enforce_retention()
                connection.execute("COMMIT")
            except BaseException:
                connection.execute("ROLLBACK")
                raise
            self._use = self._measure()

    def _enforce_retention(self) -> None:
        """Delete what is older than max_age_s, then the oldest until the rest fit max_bytes."""
        connection = self._connection
        connection.execute("DELETE FROM responses WHERE created_at < ?", (self._clock() - self.retention.max_age_s,))
        (total,) = connection.execute("SELECT COALESCE(SUM(bytes), 0) FROM responses").fetchone()
        excess = total - self.retention.max_bytes
        if excess <= 0:
            return
        doomed = []
        for response_id, size in connection.execute("SELECT id, bytes FROM responses ORDER BY created_at, id"):
            doomed.append((response_id,))
            excess -= size
            if excess <= 0:
                break
        connection.executemany("DELETE FROM responses WHERE id = ?", doomed)

    # --- reading and deleting -------------------------------------------------------------------

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """The response of that id made by that owner; None for any other (never another's)."""
        staged = self._staged.get(response_id)
        if staged is not None:
            return staged if staged.owner == owner else None
        return await anyio.to_thread.run_sync(self._read, response_id, owner)

    def _read(self, response_id: str, owner: str) -> StoredResponse | None:
        with self._lock:
            row = self._connection.execute(
                "SELECT created_at, input_items, response FROM responses WHERE id = ? AND owner = ?",
                (response_id, owner),
            ).fetchone()
        if row is None:
            return None
        created_at, items, response = row
        return StoredResponse(response_id, owner, created_at, json.loads(items), json.loads(response))

    async def delete(self, response_id: str, owner: str) -> bool:
        """Delete that owner's response of that id; False when it has none."""
        return await anyio.to_thread.run_sync(self._delete, response_id, owner)

    def _delete(self, response_id: str, owner: str) -> bool:
        with self._lock:
            deleted = self._connection.execute(
                "DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner)
            ).rowcount
            self._use = self._measure()
        return deleted > 0

    async def clear(self) -> StoreUse:
        """Delete every stored response (`flare ctl responses clear`); returns what was dropped."""
        return await anyio.to_thread.run_sync(self._clear)

    def _clear(self) -> StoreUse:
        with self._lock:
            dropped = self._measure()
            self._connection.execute("DELETE FROM responses")
            self._use = self._measure()
        return dropped

    def _measure(self) -> StoreUse:
        count, size, oldest = self._connection.execute(
            "SELECT COUNT(*), COALESCE(SUM(bytes), 0), MIN(created_at) FROM responses"
        ).fetchone()
        return StoreUse(count, size, oldest)
