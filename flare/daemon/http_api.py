"""The HTTP API: routes, middlewares, and the one path every generation request takes.

The path goes one way: parse (one parser per API: openai_schema.py for chat completions and
completions), then prepare (prepare.py, shared by every API: prompt to token ids, grammar,
sampling clamped to the package policy, the scheduler requests), then submit and render
(answer.py, with one renderer per response shape: openai_responses.py). Events are written as
they come: SSE frames when streaming, one JSON body otherwise. Every answer that is not a success is OpenAI's error body with a 4xx,
or a 5xx that names the failure (a request the device failed, shutdown, loading); a bug that
escapes a handler is logged with its traceback and answered 500 with an error body, never a trace.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import structlog
from aiohttp import web

from flare.daemon.answer import GENERATED, answer
from flare.daemon.auth import ApiKeys
from flare.daemon.body_encoding import decode_body
from flare.daemon.cache_scope import prefix_cache_scope
from flare.daemon.chat_page import PAGE_PATHS, add_chat_page_routes
from flare.daemon.config import DaemonConfig
from flare.daemon.errors import AUTHENTICATION, SERVER_ERROR, ApiError, bad_request
from flare.daemon.generation import Generation
from flare.daemon.logging import log_access
from flare.daemon.openai_responses import ChatCompletionShape, OpenAIRenderer, TextCompletionShape
from flare.daemon.openai_schema import check_model, parse_chat_completion, parse_completion, parse_json_body
from flare.daemon.origins import browser_origin_refused, loopback_host_refused, origin_allowed
from flare.daemon.messages_api import MessagesRenderer
from flare.daemon.messages_schema import parse_messages_request
from flare.daemon.prepare import Prepared, Serving, count_prompt_tokens, prepare
from flare.daemon.rendering import Renderer
from flare.daemon.responses_api import ResponsesRenderer
from flare.daemon.responses_schema import parse_response_request
from flare.daemon.state import Phase, ServingState
from flare.sampler.status import DeviceStatus
from flare.scheduler.request import FaultSpec

log = structlog.get_logger("flare.daemon.http")

class ApiSettings:
    """The settings requests read as they arrive; a reload (SIGHUP) swaps them in place."""

    def __init__(self, config: DaemonConfig) -> None:
        self.update(config)

    def update(self, config: DaemonConfig) -> None:
        self.config = config
        self.keys = ApiKeys(config.api_keys)


SETTINGS = web.AppKey("settings", ApiSettings)
STATE = web.AppKey("state", ServingState)
# Tokenizing runs in worker threads with the GIL released; at most this many at once, so a
# flood of long prompts queues here instead of holding a thread (and its text) each.
TOKENIZING = web.AppKey("tokenizing", anyio.CapacityLimiter)
# Grammars compile in worker threads too (llguidance drops the GIL), a few at once, so a flood of
# new schemas queues here and never holds the tokenizer's threads or the event loop.
COMPILING = web.AppKey("compiling", anyio.CapacityLimiter)
REQUEST_ID = web.RequestKey("request_id", str)
# The API key a request was admitted with (empty without keys): its prefix-cache scope.
API_KEY = web.RequestKey("api_key", bytes)
REQUEST_ID_HEADER = "X-Request-Id"
FAULT_HEADER = "X-Flare-Fault"
# A client's request id is echoed and logged only if it is short and plain (no log injection).
_SANE_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
ANTHROPIC_PATH = "/v1/messages"
# The chat page's files hold no secret: the page asks for the key its API requests need.
_PUBLIC_PATHS = frozenset({"/health", *PAGE_PATHS})
BODY_READ_TIMEOUT_S = 30.0
# The status an access line records for a request whose client went away before its answer
# was written (nginx's "client closed request"); never sent.
CLIENT_CLOSED_REQUEST = 499
_CORS_METHODS = "GET, POST, OPTIONS"
_CORS_MAX_AGE_S = "600"


def create_app(config: DaemonConfig, state: ServingState) -> web.Application:
    app = web.Application(
        client_max_size=config.max_body_bytes,
        middlewares=[_request_context, _errors, _cross_site, _authentication],
    )
    app[SETTINGS] = ApiSettings(config)
    app[STATE] = state
    app[TOKENIZING] = anyio.CapacityLimiter(_cpus())
    app[COMPILING] = anyio.CapacityLimiter(2)
    app.on_response_prepare.append(_add_request_id)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", get_model)
    app.router.add_post("/v1/chat/completions", chat_completions, expect_handler=expect_continue)
    app.router.add_post("/v1/completions", completions, expect_handler=expect_continue)
    app.router.add_post("/v1/responses", responses, expect_handler=expect_continue)
    app.router.add_post("/v1/messages", messages, expect_handler=expect_continue)
    app.router.add_post("/v1/messages/count_tokens", count_message_tokens, expect_handler=expect_continue)
    add_chat_page_routes(app)
    return app


def _cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


# --- middlewares ---------------------------------------------------------------------------


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _request_context(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Give the request an id (the client's X-Request-Id when sane) bound to every log line."""
    given = request.headers.get(REQUEST_ID_HEADER, "")
    request_id = given if _SANE_REQUEST_ID.match(given) else uuid.uuid4().hex
    request[REQUEST_ID] = request_id
    started = time.perf_counter()
    with structlog.contextvars.bound_contextvars(request_id=request_id):
        # One access line per request, also for one whose client went away (499) before the
        # answer was written: the handler is cancelled, or its write fails.
        status = CLIENT_CLOSED_REQUEST
        try:
            response = await handler(request)
            # A stream whose client went away mid-answer returns normally, its connection lost.
            if request.transport is not None or not response.prepared:
                status = response.status
            return response
        finally:
            generated = request.get(GENERATED)
            usage = generated.usage if generated is not None else None
            log_access(
                log,
                method=request.method,
                path=request.path,
                status=status,
                request_id=request_id,
                duration_s=time.perf_counter() - started,
                prompt_tokens=usage.prompt_tokens if usage is not None else None,
                completion_tokens=usage.completion_tokens if usage is not None else None,
                ttft_s=generated.ttft_s if generated is not None else None,
            )


async def _add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    if REQUEST_ID in request:
        response.headers[REQUEST_ID_HEADER] = request[REQUEST_ID]


def _anthropic(request: web.Request) -> bool:
    """Anthropic's Messages API answers its errors in Anthropic's shape."""
    return request.path == ANTHROPIC_PATH or request.path.startswith(ANTHROPIC_PATH + "/")


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as error:
        if error.status >= 500:
            log.warning("request_refused", status=error.status, code=error.code, message=error.message)
        return error.response(anthropic=_anthropic(request))
    except web.HTTPException as error:
        if error.status < 400:
            raise
        return _http_exception_error(request, error).response(anthropic=_anthropic(request))
    except Exception:
        log.exception("unhandled_error")
        return ApiError(
            500,
            f"internal error while handling the request (request id {request[REQUEST_ID]}); "
            "the daemon log has the details",
            type=SERVER_ERROR,
            code="internal_error",
        ).response(anthropic=_anthropic(request))


def _http_exception_error(request: web.Request, error: web.HTTPException) -> ApiError:
    """aiohttp's own refusals (no such route, wrong method, body too large) as API errors."""
    headers = {}
    if isinstance(error, web.HTTPNotFound):
        message, code = f"no such endpoint: {request.method} {request.path}", "not_found"
    elif isinstance(error, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(error.allowed_methods))
        message, code = f"{request.method} is not allowed on {request.path}; use {allowed}", "method_not_allowed"
        headers["Allow"] = allowed
    elif isinstance(error, web.HTTPRequestEntityTooLarge):
        limit = request.app[SETTINGS].config.max_body_bytes
        message, code = f"the request body is larger than the limit of {limit} bytes", "request_too_large"
    else:
        message, code = error.reason, None
    return ApiError(error.status, message, code=code, headers=headers)


@web.middleware
async def _cross_site(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse browser requests from origins not allowed, and Host names that are not loopback's
    while listening on loopback (flare/daemon/origins.py); CORS for the allowed origins."""
    settings = request.app[SETTINGS].config
    if request.app[STATE].loopback:
        refused = loopback_host_refused(request.headers.get("Host"), settings.allowed_hosts)
        if refused is not None:
            raise ApiError(403, refused, code="host_not_allowed")
    origin = request.headers.get("Origin")
    refused = browser_origin_refused(
        origin, request.headers.get("Sec-Fetch-Site"), settings.allowed_origins, host=request.headers.get("Host")
    )
    if refused is not None:
        raise ApiError(403, refused, code="origin_not_allowed")
    if origin is None or not origin_allowed(origin, settings.allowed_origins):
        return await handler(request)
    cors = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
    if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
        cors["Access-Control-Allow-Methods"] = _CORS_METHODS
        cors["Access-Control-Allow-Headers"] = request.headers.get("Access-Control-Request-Headers", "")
        cors["Access-Control-Max-Age"] = _CORS_MAX_AGE_S
        return web.Response(status=204, headers=cors)
    try:
        response = await handler(request)
    except ApiError as error:
        error.headers.update(cors)
        raise
    if not response.prepared:
        response.headers.update(cors)
    return response


@web.middleware
async def _authentication(request: web.Request, handler: Handler) -> web.StreamResponse:
    keys = request.app[SETTINGS].keys
    public = request.path in _PUBLIC_PATHS or (
        request.path == "/metrics" and not request.app[SETTINGS].config.metrics_require_key
    )
    presented = keys.accepted_key(request.headers.get("Authorization"), request.headers.get("x-api-key"))
    request[API_KEY] = presented
    if keys.required and not public and not presented:
        raise ApiError(
            401,
            "missing or incorrect API key; send it as the header 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
            type=AUTHENTICATION,
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return await handler(request)


# --- health and models ---------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    """200 only when the model is loaded, warmed up and admitting requests; 503 otherwise."""
    state = request.app[STATE]
    status = state.phase.value
    if state.phase is Phase.READY and state.require_scheduler().draining:
        status = "draining"
    return web.json_response({"status": status}, status=200 if status == "ready" else 503)


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.require_scheduler()  # 503 while loading: the name is known once the package is open
    return web.json_response({"object": "list", "data": [_model_card(state)]})


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.require_scheduler()
    check_model(request.match_info["model"], state.model_name or "")
    return web.json_response(_model_card(state))


def _model_card(state: ServingState) -> dict[str, Any]:
    return {"id": state.model_name, "object": "model", "created": 0, "owned_by": "flare"}


# --- generation ----------------------------------------------------------------------------


async def chat_completions(request: web.Request) -> web.StreamResponse:
    generation = parse_chat_completion(parse_json_body(await read_body(request)))
    return await _generate(request, generation, "chatcmpl", _chat_renderer)


async def completions(request: web.Request) -> web.StreamResponse:
    generation = parse_completion(parse_json_body(await read_body(request)))
    return await _generate(request, generation, "cmpl", _completion_renderer)


async def responses(request: web.Request) -> web.StreamResponse:
    body = parse_json_body(await read_body(request))
    generation = parse_response_request(body)
    created, instructions = int(time.time()), body.get("instructions")  # a string, or None: parsed
    return await _generate(request, generation, "resp", lambda prepared: ResponsesRenderer(prepared, created, instructions))


async def messages(request: web.Request) -> web.StreamResponse:
    generation = parse_messages_request(parse_json_body(await read_body(request)))
    return await _generate(request, generation, "msg", MessagesRenderer)


async def count_message_tokens(request: web.Request) -> web.Response:
    """Anthropic's count_tokens: the prompt's tokens as /v1/messages would send them."""
    generation = parse_messages_request(parse_json_body(await read_body(request)), counting=True)
    serving = _serving(request, generation)
    return web.json_response({"input_tokens": await count_prompt_tokens(serving, generation.prompt)})


def _chat_renderer(prepared: Prepared) -> Renderer:
    generation = prepared.generation
    shape = ChatCompletionShape(prepared.id, int(time.time()), generation.model, generation.include_usage)
    return OpenAIRenderer(shape, [None] * prepared.choices, generation.tokens.logprobs is not None)


def _completion_renderer(prepared: Prepared) -> Renderer:
    generation = prepared.generation
    shape = TextCompletionShape(prepared.id, int(time.time()), generation.model, generation.include_usage)
    echoes = [None if echo is None else echo.text for echo in prepared.echoes for _ in range(generation.n)]
    return OpenAIRenderer(shape, echoes, generation.tokens.logprobs is not None)


async def _generate(
    request: web.Request, generation: Generation, id_prefix: str, renderer: Callable[[Prepared], Renderer]
) -> web.StreamResponse:
    """The one request path after parsing, whichever API: prepare, then submit and render."""
    serving = _serving(request, generation)
    scope = prefix_cache_scope(
        api_key=request[API_KEY], across_keys=serving.config.prefix_cache_across_keys, salt=generation.cache_salt
    )
    prepared = await prepare(serving, generation, _new_id(id_prefix), _fault(request, serving.config), scope)
    state = request.app[STATE]
    return await answer(request, serving.scheduler, state, prepared, renderer(prepared), serving.config.request_timeout_s)


def _serving(request: web.Request, generation: Generation) -> Serving:
    """The running model, once `generation` names it (a 503 while loading, a 404 for another)."""
    state = request.app[STATE]
    scheduler = state.require_scheduler()
    check_model(generation.model, state.model_name or "")
    return Serving(scheduler, request.app[SETTINGS].config, request.app[TOKENIZING], request.app[COMPILING])


async def expect_continue(request: web.Request) -> None:
    """`Expect: 100-continue`: invite the body only when it can be accepted; a declared length
    over max_body_bytes gets its 413 from read_body at once, without the body being sent."""
    expect = request.headers.get("Expect", "").strip().lower()
    if expect != "100-continue":
        raise web.HTTPExpectationFailed(text=f"unknown Expect: {expect}")
    limit = request.app[SETTINGS].config.max_body_bytes
    if request.version >= (1, 1) and (request.content_length or 0) <= limit:
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the response proper has not started


async def read_body(request: web.Request) -> bytes:
    """The body, or a 408 for a client that sends it too slowly (it would hold a connection
    and a handler forever otherwise); a 413 at once for a declared length over max_body_bytes
    (aiohttp's own 413 for a chunked one that grows past it); for a body with a
    Content-Encoding, what decode_body answers: a 400 for one that does not decode, a 413 for
    one that decodes past max_body_bytes, a 415 for a coding not served."""
    limit = request.app[SETTINGS].config.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        # The body is never read: the connection closes after the answer.
        raise ApiError(
            413,
            f"the request body is {request.content_length} bytes, larger than the limit of {limit} bytes",
            code="request_too_large",
            close=True,
        )
    try:
        with anyio.move_on_after(BODY_READ_TIMEOUT_S):
            raw = await request.read()
            encoding = request.headers.get("Content-Encoding")
            if not encoding:
                return raw
            return await anyio.to_thread.run_sync(decode_body, raw, encoding, limit)
    except web.RequestPayloadError as error:
        raise ApiError(
            400,
            f"the request body could not be read ({' '.join(str(error).split())[:200]}); "
            "it does not match its framing",
            param=None,
            code="invalid_body",
            close=True,
        ) from None
    raise ApiError(
        408,
        f"the request body did not arrive within {BODY_READ_TIMEOUT_S:g} s",
        code="request_timeout",
    )


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _fault(request: web.Request, config: DaemonConfig) -> FaultSpec | None:
    """`X-Flare-Fault: STATUS_NAME[@ROUND]`, honoured only under --fault-injection."""
    header = request.headers.get(FAULT_HEADER)
    if not config.fault_injection or header is None:
        return None
    name, at, round_text = header.strip().partition("@")
    names = ", ".join(s.name for s in DeviceStatus if s is not DeviceStatus.OK)
    try:
        status = DeviceStatus[name.strip().upper()]
    except KeyError:
        raise bad_request(f"{FAULT_HEADER}: unknown status {name!r}; use one of {names}", param=FAULT_HEADER) from None
    if status is DeviceStatus.OK:
        raise bad_request(f"{FAULT_HEADER}: OK is not a fault; use one of {names}", param=FAULT_HEADER)
    if not at:
        return FaultSpec(status)
    if not round_text.strip().isdigit():
        raise bad_request(
            f"{FAULT_HEADER}: the round after @ must be a non-negative integer, got {round_text!r}", param=FAULT_HEADER
        )
    return FaultSpec(status, int(round_text))
