"""A small OpenAI-compatible server for the benchmark's tests, run in a thread of its own.

Each chat completion is answered by the behaviour the test's `choose(index, body)` returns for
it: a normal stream of `tokens` chunks (with or without usage), an HTTP error with OpenAI's body
(429, 500, 503) or one that is not JSON, a connection dropped mid-stream, an error event inside
a 200 stream, a stream that stops without [DONE]. It records when each request arrived.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

MODEL = "fake-model"


@dataclass(frozen=True)
class Behaviour:
    kind: str = "ok"  # ok | status | not_json | drop | error_event | no_done
    tokens: int = 8
    gap_s: float = 0.0  # between chunks
    usage: bool = True
    status: int = 200
    code: str | None = None


Choose = Callable[[int, dict[str, Any]], Behaviour]


def _chunk(content: str | None = None, usage: dict[str, int] | None = None, finish: str | None = None) -> bytes:
    payload: dict[str, Any] = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": MODEL}
    payload["choices"] = [] if usage else [{"index": 0, "delta": {"content": content} if content else {}, "finish_reason": finish}]
    if usage:
        payload["usage"] = usage
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


@dataclass
class FakeOpenAIServer:
    choose: Choose = lambda index, body: Behaviour()
    arrivals: list[float] = field(default_factory=list)  # perf_counter() at each chat request
    bodies: list[dict[str, Any]] = field(default_factory=list)
    metrics_text: str | None = None  # served at /metrics when set (a flare-like server)

    def __post_init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FakeOpenAIServer:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main())

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/metrics", self._metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.metrics_text is None:
            raise web.HTTPNotFound()
        return web.Response(text=self.metrics_text)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.arrivals.append(time.perf_counter())
        body = await request.json()
        index = len(self.bodies)
        self.bodies.append(body)
        behaviour = self.choose(index, body)
        if behaviour.kind == "status":
            error = {"message": f"fake {behaviour.status}", "type": "server_error", "param": None, "code": behaviour.code}
            return web.json_response({"error": error}, status=behaviour.status)
        if behaviour.kind == "not_json":
            return web.Response(status=behaviour.status, text="<html>bad gateway</html>")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(_chunk())  # the role chunk: no content
        for i in range(behaviour.tokens):
            if behaviour.gap_s:
                await asyncio.sleep(behaviour.gap_s)
            await response.write(_chunk(f" t{i}"))
            if behaviour.kind == "drop" and i == behaviour.tokens // 2:
                assert request.transport is not None
                request.transport.close()
                return response
        if behaviour.kind == "error_event":
            error = {"message": "device failed", "type": "server_error", "param": None, "code": behaviour.code}
            await response.write(b"data: " + json.dumps({"error": error}).encode() + b"\n\n")
        else:
            await response.write(_chunk(finish="length"))
            if behaviour.usage:
                await response.write(_chunk(usage={"prompt_tokens": 5, "completion_tokens": behaviour.tokens, "total_tokens": 5 + behaviour.tokens}))
        if behaviour.kind != "no_done":
            await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
