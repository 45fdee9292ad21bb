"""The access log: one line per HTTP request, written through the daemon's structured logging."""

from __future__ import annotations

from typing import Any


def log_access(
    logger: Any,
    *,
    method: str,
    path: str,
    status: int,
    request_id: str | None,
    duration_s: float,
    prompt_tokens: int | None = None,
    completion_tokens: int | None = None,
    ttft_s: float | None = None,
) -> None:
    """The one access-log line per HTTP request (event "access"); token counts and time to
    first token are omitted for requests that generated nothing."""
    fields: dict[str, Any] = {
        "method": method,
        "path": path,
        "status": status,
        "request_id": request_id,
        "duration_ms": round(duration_s * 1000, 1),
    }
    if prompt_tokens is not None:
        fields["prompt_tokens"] = prompt_tokens
    if completion_tokens is not None:
        fields["completion_tokens"] = completion_tokens
    if ttft_s is not None:
        fields["ttft_ms"] = round(ttft_s * 1000, 1)
    logger.info("access", **fields)
