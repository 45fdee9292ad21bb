"""The answers of Ollama's `/api/chat` and `/api/generate`: NDJSON streamed (one JSON object a
line, the last with `"done": true`), or one object with `"stream": false`.

Every line names the model as the client sent it and `created_at`; chat's carry a `message`
({"role": "assistant", "content"}), generate's a `response` text. The last line adds
`done_reason` ("stop" or "length": Ollama says "stop" for an answer that is tool calls too),
Ollama's counters (`prompt_eval_count`, `eval_count`) and its durations in nanoseconds
(`total_duration` since the request was submitted, `load_duration` 0 as the model is always
loaded, `prompt_eval_duration` up to the first token, `eval_duration` after it), and flare's `flare` object (the sampling applied
and what the package policy changed). Tool calls are whole objects with their arguments as an
object, Ollama's form; a streamed call is sent once its arguments are complete. A request that
fails mid-stream ends with Ollama's `{"error": message}` line.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from flare.api.answer import Generated
from flare.api.prepare import Prepared
from flare.api.rendering import ChoiceText, IdForm, TextPiece
from flare.scheduler.request import RequestFailure, Usage

# Ollama's answers have no ids; the request's own (its logs, its scheduler requests) take this form.
OLLAMA_IDS = IdForm("ollama-")
NDJSON_HEADERS = {"Content-Type": "application/x-ndjson", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def ndjson(payload: Any) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n"


def error_body(message: str) -> dict[str, Any]:
    """Ollama's error shape."""
    return {"error": message}


def created_at() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


class OllamaRenderer:
    """One answer of /api/chat (`chat`) or /api/generate, as answer.py's `Renderer`."""

    def __init__(self, prepared: Prepared, model: str, generated: Callable[[], Generated], *, chat: bool) -> None:
        """`generated`: the request's timing (answer.py records it), read when the answer ends."""
        self._prepared = prepared
        self._model = model
        self._generated = generated
        self._chat = chat
        self._reason = "stop"
        self._arguments: dict[int, tuple[str, str]] = {}  # a streamed call's (name, arguments so far)

    def _line(self, text: str, calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        line: dict[str, Any] = {"model": self._model, "created_at": created_at()}
        if self._chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                message["tool_calls"] = calls
            line["message"] = message
        else:
            line["response"] = text
        line["done"] = False
        return line

    def _done(self, line: dict[str, Any], usage: Usage, flare: dict[str, Any]) -> dict[str, Any]:
        generated = self._generated()
        total = time.perf_counter() - generated.started
        first = generated.ttft_s if generated.ttft_s is not None else total
        return {
            **line,
            "done": True,
            "done_reason": self._reason,
            "total_duration": _nanoseconds(total),
            "load_duration": 0,
            "prompt_eval_count": usage.prompt_tokens,
            "prompt_eval_duration": _nanoseconds(first),
            "eval_count": usage.completion_tokens,
            "eval_duration": _nanoseconds(total - first),
            "flare": flare,
        }

    def start(self, flare: dict[str, Any]) -> list[bytes]:
        return []

    def text(self, piece: TextPiece) -> list[bytes]:
        return [ndjson(self._line(piece.text))] if piece.text else []

    def calls(self, index: int, deltas: list[dict[str, Any]]) -> list[bytes]:
        """Each call once its arguments are a whole JSON object (an object's prefix never is)."""
        whole = []
        for delta in deltas:
            name, arguments = self._arguments.get(delta["index"], ("", ""))
            function = delta["function"]
            name = function.get("name") or name
            arguments += function.get("arguments", "")
            self._arguments[delta["index"]] = (name, arguments)
            try:
                parsed = json.loads(arguments)
            except ValueError:
                continue
            whole.append({"function": {"name": name, "arguments": parsed}})
        return [ndjson(self._line("", whole))] if whole else []

    def finish(self, index: int, reason: str, fell_back: bool, stop_string: str | None) -> list[bytes]:
        self._reason = "length" if reason == "length" else "stop"
        return []

    def end(self, usage: Usage) -> list[bytes]:
        return [ndjson(self._done(self._line(""), usage, self._prepared.flare()))]

    def fail(self, failure: RequestFailure) -> list[bytes]:
        return [ndjson(error_body(failure.message))]

    def keep_alive(self) -> list[bytes]:
        # NDJSON has no comments: an empty piece of the answer, which clients append as nothing.
        return [ndjson(self._line(""))]

    def body(self, choices: list[ChoiceText], usage: Usage, flare: dict[str, Any]) -> dict[str, Any]:
        choice = choices[0]
        self._reason = "length" if choice.finish_reason == "length" else "stop"
        calls = [{"function": {"name": c.name, "arguments": json.loads(c.arguments)}} for c in choice.tool_calls or ()]
        return self._done(self._line(choice.text, calls), usage, flare)

    def failure_response(self, failure: RequestFailure) -> web.Response:
        return web.json_response(error_body(failure.message), status=failure.http_status)


def _nanoseconds(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


def loaded_body(model: str) -> dict[str, Any]:
    """/api/generate's answer to a request without a prompt: the model is loaded (it always is)."""
    return {"model": model, "created_at": created_at(), "response": "", "done": True, "done_reason": "load"}
