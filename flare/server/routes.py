"""The HTTP API's one route table: every URL the daemon answers, its handler, and the app around
them (middlewares, settings, state, worker-thread limiters).

A generation request goes one way: its handler (endpoints.py) parses the body with its API's
parser (flare/api/<api>/parse.py) into a `Generation`, then prepare (api/prepare.py, shared by
every API: prompt to token ids, grammar, sampling clamped to the package policy, the scheduler
requests), then answer (api/answer.py) with its API's renderer (flare/api/<api>/render.py).
Events are written as they come: SSE frames when streaming (NDJSON lines on Ollama's /api/), one
JSON body otherwise. Every answer that is not a success is OpenAI's error body with a 4xx
(Anthropic's on /v1/messages, Ollama's on /api/), or a 5xx that names the failure (a request the
device failed, shutdown, loading); a bug that escapes a handler is logged with its traceback and
answered 500 with an error body, never a trace.
"""

from __future__ import annotations

import os

import anyio
from aiohttp import web

from flare.server.chat_page import chat_page_handlers
from flare.server.context import COMPILING, SETTINGS, STATE, TOKENIZING, ApiSettings, ServerConfig
from flare.server.endpoints import (
    chat_completions,
    completions,
    count_message_tokens,
    delete_response,
    detokenize,
    get_model,
    get_response,
    health,
    list_input_items,
    list_models,
    messages,
    ollama_chat,
    ollama_generate,
    ollama_ps,
    ollama_show,
    ollama_tags,
    ollama_version,
    responses,
    tokenize,
)
from flare.server.metrics import DaemonMetrics, http_metrics_middleware, metrics_handler
from flare.server.middlewares import add_response_headers, authentication, cross_site, error_answers, request_context
from flare.server.request_body import expect_continue
from flare.server.state import ServingState


def create_app(config: ServerConfig, state: ServingState, metrics: DaemonMetrics) -> web.Application:
    """The app; the daemon sets its RESPONSE_STORE before it starts (none: nothing is kept)."""
    app = web.Application(
        client_max_size=config.max_body_bytes,
        # The metrics' count is outermost, so it counts the status the error middleware chose.
        middlewares=[http_metrics_middleware(metrics.http), request_context, error_answers, cross_site, authentication],
    )
    app[SETTINGS] = ApiSettings(config)
    app[STATE] = state
    app[TOKENIZING] = anyio.CapacityLimiter(_cpus())
    app[COMPILING] = anyio.CapacityLimiter(2)
    app.on_response_prepare.append(add_response_headers)
    routes = app.router
    routes.add_get("/health", health)
    routes.add_get("/metrics", metrics_handler(metrics.registry))
    # OpenAI's routes answer with and without /v1, as llama.cpp's server does: tools written
    # for it call /chat/completions. Each API's parser and renderer: flare/api/chat/ (both
    # completions), responses/, messages/, tokenize/.
    for prefix in ("/v1", ""):
        routes.add_get(f"{prefix}/models", list_models)
        routes.add_get(f"{prefix}/models/{{model:.+}}", get_model)
        routes.add_post(f"{prefix}/chat/completions", chat_completions, expect_handler=expect_continue)
        routes.add_post(f"{prefix}/completions", completions, expect_handler=expect_continue)
        routes.add_post(f"{prefix}/responses", responses, expect_handler=expect_continue)
        routes.add_get(f"{prefix}/responses/{{response_id}}", get_response)
        routes.add_get(f"{prefix}/responses/{{response_id}}/input_items", list_input_items)
        routes.add_delete(f"{prefix}/responses/{{response_id}}", delete_response)
    routes.add_post("/v1/messages", messages, expect_handler=expect_continue)
    routes.add_post("/v1/messages/count_tokens", count_message_tokens, expect_handler=expect_continue)
    # Ollama's API: flare/api/ollama/ (its errors in Ollama's shape, middlewares.py).
    routes.add_post("/api/chat", ollama_chat, expect_handler=expect_continue)
    routes.add_post("/api/generate", ollama_generate, expect_handler=expect_continue)
    routes.add_get("/api/tags", ollama_tags)
    routes.add_post("/api/show", ollama_show, expect_handler=expect_continue)
    routes.add_get("/api/ps", ollama_ps)
    routes.add_get("/api/version", ollama_version)
    routes.add_post("/tokenize", tokenize, expect_handler=expect_continue)
    routes.add_post("/detokenize", detokenize, expect_handler=expect_continue)
    # The chat page's files: /, /chat.css, /chat.js (chat_page.py).
    for path, handler in chat_page_handlers().items():
        routes.add_get(path, handler)
    return app


def _cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1
