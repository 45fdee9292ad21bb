"""Stop strings over streamed text.

Text that could still turn out to be the start of a stop string is held back, so a stop
string is never emitted, not even in part, whatever the token boundaries.
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""

    def push(self, text: str) -> tuple[str, str | None]:
        """Add text; return (text safe to emit, the stop string reached or None). Of several,
        the one that starts first is reached; at one start, the first given."""
        if not self._stops:
            return text, None
        buffer = self._held + text
        found = [(at, order) for order, at in enumerate(buffer.find(s) for s in self._stops) if at >= 0]
        if found:
            cut, order = min(found)
            self._held = ""
            return buffer[:cut], self._stops[order]
        keep = self._longest_stop_prefix_suffix(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep], None

    def flush(self) -> str:
        """The held-back text, once the sequence ended without reaching a stop string."""
        held, self._held = self._held, ""
        return held

    def _longest_stop_prefix_suffix(self, buffer: str) -> int:
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:n]):
                    longest = n
                    break
        return longest
