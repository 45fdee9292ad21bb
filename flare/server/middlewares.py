"""The middlewares every request passes, outermost first after the metrics' count: its id and
access line, errors as API error bodies (OpenAI's shape, Anthropic's on /v1/messages), browser
origins and Host names, and API keys."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Awaitable, Callable

import structlog
from aiohttp import web

from flare.api.answer import GENERATED
from flare.api.errors import AUTHENTICATION, SERVER_ERROR, ApiError
from flare.server.access_log import log_access
from flare.server.chat_page import PAGE_PATHS
from flare.server.context import API_KEY, REQUEST_ID, SETTINGS, STATE
from flare.server.origins import browser_origin_refused, loopback_host_refused, origin_allowed

log = structlog.get_logger("flare.daemon.http")

REQUEST_ID_HEADER = "X-Request-Id"
# Headers every response carries, whatever answers it (handlers, errors, aiohttp's own refusals,
# the connection guard's raw answers): a browser never sniffs a JSON or SSE body into a script.
EVERY_RESPONSE_HEADERS = {"X-Content-Type-Options": "nosniff"}
# A client's request id is echoed and logged only if it is short and plain (no log injection).
_SANE_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
ANTHROPIC_PATH = "/v1/messages"
# The chat page's files hold no secret: the page asks for the key its API requests need.
_PUBLIC_PATHS = frozenset({"/health", *PAGE_PATHS})
# The status an access line records for a request whose client went away before its answer
# was written (nginx's "client closed request"); never sent.
CLIENT_CLOSED_REQUEST = 499
_CORS_METHODS = "GET, POST, OPTIONS"
_CORS_MAX_AGE_S = "600"


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def request_context(request: web.Request, handler: Handler) -> web.StreamResponse:
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


async def add_response_headers(request: web.Request, response: web.StreamResponse) -> None:
    """The app's hook on every response it prepares: EVERY_RESPONSE_HEADERS and the request id."""
    response.headers.update(EVERY_RESPONSE_HEADERS)
    if REQUEST_ID in request:
        response.headers[REQUEST_ID_HEADER] = request[REQUEST_ID]


def _anthropic(request: web.Request) -> bool:
    """Anthropic's Messages API answers its errors in Anthropic's shape."""
    return request.path == ANTHROPIC_PATH or request.path.startswith(ANTHROPIC_PATH + "/")


OLLAMA_PREFIX = "/api/"


def _error_shape(request: web.Request) -> dict[str, bool]:
    """Which API's error shape the request's path answers in (OpenAI's unless another's)."""
    return {"anthropic": _anthropic(request), "ollama": request.path.startswith(OLLAMA_PREFIX)}


@web.middleware
async def error_answers(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as error:
        if error.status >= 500:
            log.warning("request_refused", status=error.status, code=error.code, message=error.message)
        return error.response(**_error_shape(request))
    except web.HTTPException as error:
        if error.status < 400:
            raise
        return _http_exception_error(request, error).response(**_error_shape(request))
    except Exception:
        log.exception("unhandled_error")
        return ApiError(
            500,
            f"internal error while handling the request (request id {request[REQUEST_ID]}); "
            "the daemon log has the details",
            type=SERVER_ERROR,
            code="internal_error",
        ).response(**_error_shape(request))


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
async def cross_site(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse browser requests from origins not allowed, and Host names that are not loopback's
    while listening on loopback (origins.py); CORS for the allowed origins."""
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
async def authentication(request: web.Request, handler: Handler) -> web.StreamResponse:
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
