"""One streaming chat completion, timed as the client sees it, and what became of it.

A request never raises: whatever the server does (an error status, a dropped connection, a
stream that stops without `[DONE]`, an error event inside a 200 stream, a body that is not JSON),
the outcome is a `RequestRecord` with `ok` false and the HTTP status and error code that say why.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

# Error codes of failures that carry no OpenAI error body of the server's.
CONNECTION_ERROR = "connection_error"  # refused, reset or dropped before the answer was complete
TIMEOUT = "timeout"  # no complete answer within --timeout
INCOMPLETE_STREAM = "incomplete_stream"  # the stream ended without `data: [DONE]`
INVALID_RESPONSE = "invalid_response"  # a chunk or error body that is not the JSON it should be
NO_ERROR_CODE = "none"  # an error body without a code (OpenAI's own code is often null)

# Token counts: the server's `usage`, else the client's tokenizer on the text, else content chunks.
COUNT_USAGE = "usage"
COUNT_TOKENIZER = "tokenizer"
COUNT_CHUNKS = "chunks"


@dataclass
class RequestRecord:
    """One request. Times are seconds; `start_s` from the start of its level, the others from
    the moment the request was sent."""

    start_s: float
    ok: bool = False
    http_status: int | None = None
    error_code: str | None = None
    error_message: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between consecutive content chunks
    output_tokens: int = 0
    prompt_tokens: int | None = None
    token_count: str = COUNT_CHUNKS  # COUNT_USAGE once the server's usage is read
    text: str = ""  # the answer, for the next turn of a conversation; not written to the result

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (end - first token) / (tokens - 1)."""
        if not self.ok or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        return {
            "start_s": round(self.start_s, 6),
            "ok": self.ok,
            "http_status": self.http_status,
            "error_code": self.error_code,
            "error_message": self.error_message,
            "ttft_s": _round(self.ttft_s),
            "tpot_s": _round(self.tpot_s),
            "e2e_s": _round(self.e2e_s),
            "itl_s": [round(x, 6) for x in self.itl_s],
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "token_count": self.token_count,
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


@dataclass(frozen=True)
class Endpoint:
    """Where and how to send: the server's base URL (without /v1), the model name, the key."""

    url: str
    model: str
    api_key: str | None = None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


async def stream_chat(
    session: aiohttp.ClientSession,
    endpoint: Endpoint,
    body: dict[str, Any],
    *,
    level_start: float,
    timeout_s: float,
    count_tokens: Callable[[str], int] | None = None,
) -> RequestRecord:
    """POST one streaming chat completion (`body` without model/stream, which are added here)."""
    sent = time.perf_counter()
    record = RequestRecord(start_s=sent - level_start)
    payload = {**body, "model": endpoint.model, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(
                f"{endpoint.url}/v1/chat/completions", json=payload, headers=endpoint.headers()
            ) as response:
                record.http_status = response.status
                if response.status != 200:
                    await _read_error(response, record)
                else:
                    await _read_stream(response, record, sent)
    except TimeoutError:
        record.ok, record.error_code = False, TIMEOUT
        record.error_message = f"no complete answer within {timeout_s:g} s"
    except (aiohttp.ClientError, ConnectionError) as error:
        record.ok, record.error_code = False, CONNECTION_ERROR
        record.error_message = f"{type(error).__name__}: {error}"[:500]
    record.e2e_s = time.perf_counter() - sent
    if record.ok:
        _count(record, count_tokens)
    return record


async def _read_error(response: aiohttp.ClientResponse, record: RequestRecord) -> None:
    raw = await response.read()
    record.ok = False
    try:
        error = json.loads(raw)["error"]
        record.error_code = str(error.get("code") or NO_ERROR_CODE)
        record.error_message = str(error.get("message", ""))[:500]
    except (ValueError, KeyError, TypeError, AttributeError):
        record.error_code = INVALID_RESPONSE
        record.error_message = raw[:200].decode("utf-8", "replace")


async def _read_stream(response: aiohttp.ClientResponse, record: RequestRecord, sent: float) -> None:
    """Server-sent events, split on newlines by hand: aiohttp's line reader refuses long lines."""
    texts: list[str] = []
    last_chunk: float | None = None
    pending = b""
    done = False
    async for data in response.content.iter_any():
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, `event:` lines
            value = line[5:].strip()
            if value == b"[DONE]":
                done = True
                continue
            try:
                chunk = json.loads(value)
            except ValueError:
                record.error_code, record.error_message = INVALID_RESPONSE, value[:200].decode("utf-8", "replace")
                return
            if not isinstance(chunk, dict):
                record.error_code, record.error_message = INVALID_RESPONSE, value[:200].decode("utf-8", "replace")
                return
            if "error" in chunk:  # a failure after the 200 status line (flare, vLLM, llama.cpp)
                error = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
                record.error_code = str(error.get("code") or NO_ERROR_CODE)
                record.error_message = str(error.get("message", ""))[:500]
                return
            content = _content(chunk)
            if content:
                now = time.perf_counter()
                if last_chunk is None:
                    record.ttft_s = now - sent
                else:
                    record.itl_s.append(now - last_chunk)
                last_chunk = now
                texts.append(content)
            usage = chunk.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                record.output_tokens = usage["completion_tokens"]
                if isinstance(usage.get("prompt_tokens"), int):
                    record.prompt_tokens = usage["prompt_tokens"]
                record.token_count = COUNT_USAGE
    record.text = "".join(texts)
    if not done:
        record.error_code = INCOMPLETE_STREAM
        record.error_message = "the stream ended without data: [DONE]"
        return
    record.ok = True


def _content(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return ""
    delta = choices[0].get("delta")
    if not isinstance(delta, dict):
        return ""
    # Reasoning models stream their thinking apart from the answer; both are generated tokens.
    parts = [delta.get(key) for key in ("content", "reasoning_content", "reasoning")]
    return "".join(p for p in parts if isinstance(p, str))


def _count(record: RequestRecord, count_tokens: Callable[[str], int] | None) -> None:
    if record.token_count == COUNT_USAGE:
        return
    if count_tokens is not None:
        record.output_tokens, record.token_count = count_tokens(record.text), COUNT_TOKENIZER
    else:
        record.output_tokens, record.token_count = len(record.itl_s) + (record.ttft_s is not None), COUNT_CHUNKS
