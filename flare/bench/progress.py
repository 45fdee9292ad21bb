"""The live progress line of a level, on a terminal only.

`Progress` owns one level's running tally (the load generator reports each request's end)
and redraws one line of stderr a few times a second; off a terminal it stays silent until the
level ends, then writes one plain line, so logs and CI output stay readable.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

import anyio

REDRAW_S = 0.25
BAR_WIDTH = 24


class Progress:
    def __init__(self, level: str, total: int | None, duration_s: float | None, stream: TextIO | None = None) -> None:
        self.level = level
        self.total = total
        self.duration_s = duration_s
        self.stream = stream if stream is not None else sys.stderr
        self.live = self.stream.isatty()
        self.completed = 0
        self.failed = 0
        self.tokens = 0
        self.started = time.perf_counter()

    def request_done(self, ok: bool, tokens: int) -> None:
        if ok:
            self.completed += 1
            self.tokens += tokens
        else:
            self.failed += 1

    def line(self) -> str:
        elapsed = time.perf_counter() - self.started
        done = self.completed + self.failed
        # The bar follows whichever bound ends the level first: the count or the time.
        shares = []
        if self.total:
            shares.append(done / self.total)
        if self.duration_s:
            shares.append(elapsed / self.duration_s)
        share = min(max(shares, default=0.0), 1.0)
        filled = int(share * BAR_WIDTH)
        bar = "#" * filled + "-" * (BAR_WIDTH - filled)
        count = f"{done}/{self.total}" if self.total else f"{done}"
        return (
            f"{self.level:<16} [{bar}] {count} requests, {self.failed} failed, "
            f"{self.tokens / max(elapsed, 1e-9):7.1f} tok/s, {elapsed:6.1f} s"
        )

    async def redraw(self) -> None:
        """Runs until cancelled (the level's task group cancels it when the level ends)."""
        if not self.live:
            await anyio.sleep_forever()
        while True:
            self.stream.write("\r" + self.line() + "\x1b[K")
            self.stream.flush()
            await anyio.sleep(REDRAW_S)

    def finish(self) -> None:
        self.stream.write(("\r" if self.live else "") + self.line() + ("\x1b[K" if self.live else "") + "\n")
        self.stream.flush()
