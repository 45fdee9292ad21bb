"""Server-sent events: as OpenAI's chat and completions stream them (`data: <json>` lines, each
event ended by a blank line, the stream ended by `data: [DONE]`), and named events (`event: <type>`
before the data) as the Responses and Messages APIs stream them."""

from __future__ import annotations

import json
from typing import Any

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    # Reverse proxies (nginx) buffer responses unless told not to, which would hold tokens back.
    "X-Accel-Buffering": "no",
}
DONE = b"data: [DONE]\n\n"
KEEP_ALIVE = b": keep-alive\n\n"
"""An SSE comment: clients skip it, and it keeps a stalled stream's connection and proxies open."""


def sse_data(payload: Any) -> bytes:
    """One event. JSON escapes newlines inside strings, so the payload stays on one line."""
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


def sse_event(name: str, payload: Any) -> bytes:
    """One named event."""
    return f"event: {name}\n".encode("utf-8") + sse_data(payload)
