"""The OpenAI-compatible HTTP API: routes, middlewares and the path of one generation request.

A request is parsed and validated completely (openai_schema.py) before the scheduler sees it;
then the prompt is rendered and tokenized, the sampling fields are clamped to the package policy,
and the request is submitted. Its events are written as they come: SSE chunks when streaming,
one JSON body otherwise. Every answer that is not a success is OpenAI's error body with a 4xx,
or a 5xx that names the failure (a request the device failed, shutdown, loading); a bug that
escapes a handler is logged with its traceback and answered 500 with an error body, never a trace.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
import structlog
from aiohttp import web

from flare.daemon.abandonable import run_abandonable
from flare.daemon.auth import ApiKeys
from flare.daemon.body_encoding import decode_body
from flare.daemon.cache_scope import cache_salt, prefix_cache_scope
from flare.daemon.config import DaemonConfig
from flare.daemon.connections import ClientNotReading
from flare.daemon.errors import (
    AUTHENTICATION,
    RATE_LIMIT,
    SERVER_ERROR,
    ApiError,
    bad_request,
    error_body,
    failure_body,
)
from flare.daemon.logging import log_access
from flare.daemon.metrics import OUTCOME
from flare.daemon.openai_responses import (
    ChatCompletionShape,
    ChoiceText,
    RenderedToken,
    ResponseShape,
    TextCompletionShape,
    TokenRenderer,
    flare_object,
    logprobs_object,
)
from flare.daemon.openai_schema import (
    TokenOptions,
    check_logit_bias,
    check_model,
    parse_chat_completion,
    parse_completion,
    parse_json_body,
)
from flare.daemon.origins import browser_origin_refused, loopback_host_refused, origin_allowed
from flare.daemon.sse import DONE, SSE_HEADERS, sse_data
from flare.daemon.state import Phase, ServingState
from flare.daemon.tool_calls import ToolCallReader, render_messages, template_messages, template_tools
from flare.engine.tokenizer import ChatTemplateError
from flare.preparation.chat_template import ChatTemplateLimit
from flare.sampling.policy import Adjustment
from flare.structured import Grammar, GrammarError, GrammarSpec
from flare.kernels.status import DeviceStatus
from flare.scheduler.errors import Draining, PromptTooLong, QueueFull, TooManyChoices
from flare.scheduler.request import (
    Failed,
    FaultSpec,
    Finished,
    GenerationRequest,
    RequestFailure,
    RequestStream,
    StreamEvent,
    TextDelta,
    Usage,
)

if TYPE_CHECKING:
    from flare.scheduler.scheduler import Scheduler

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
COMPILE_TIMEOUT_S = 10.0
REQUEST_ID = web.RequestKey("request_id", str)


@dataclass
class Generated:
    """What the access line reports about a generation request."""

    started: float
    ttft_s: float | None = None
    usage: Usage | None = None

    def token(self) -> None:
        if self.ttft_s is None:
            self.ttft_s = time.perf_counter() - self.started


GENERATED = web.RequestKey("generated", Generated)

REQUEST_ID_HEADER = "X-Request-Id"
FAULT_HEADER = "X-Flare-Fault"
ADJUSTED_HEADER = "Flare-Sampling-Adjusted"
# A client's request id is echoed and logged only if it is short and plain (no log injection).
_SANE_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_PUBLIC_PATHS = frozenset({"/health"})
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
    app.router.add_post("/v1/chat/completions", chat_completions, expect_handler=_expect_continue)
    app.router.add_post("/v1/completions", completions, expect_handler=_expect_continue)
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


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as error:
        if error.status >= 500:
            log.warning("request_refused", status=error.status, code=error.code, message=error.message)
        return error.response()
    except web.HTTPException as error:
        if error.status < 400:
            raise
        return _http_exception_response(request, error)
    except Exception:
        log.exception("unhandled_error")
        return web.json_response(
            error_body(
                f"internal error while handling the request (request id {request[REQUEST_ID]}); "
                "the daemon log has the details",
                type=SERVER_ERROR,
                param=None,
                code="internal_error",
            ),
            status=500,
        )


def _http_exception_response(request: web.Request, error: web.HTTPException) -> web.Response:
    """aiohttp's own refusals (no such route, wrong method, body too large) in OpenAI's shape."""
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
    return web.json_response(
        error_body(message, type="invalid_request_error", param=None, code=code), status=error.status, headers=headers
    )


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
    refused = browser_origin_refused(origin, request.headers.get("Sec-Fetch-Site"), settings.allowed_origins)
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
    if keys.required and not public and not keys.accepts(request.headers.get("Authorization")):
        raise ApiError(
            401,
            "missing or incorrect API key; send it as the header 'Authorization: Bearer <key>'",
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
    body = parse_json_body(await _read_body(request))
    parsed = parse_chat_completion(body)
    scope = _cache_scope(request, body)
    state = request.app[STATE]
    scheduler = state.require_scheduler()
    check_model(parsed.model, state.model_name or "")
    messages = parsed.messages
    encode = partial(scheduler.tokenizer.encode_chat)
    if parsed.tools is not None or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
        if scheduler.tokenizer.knows_tools:
            messages = tuple(template_messages(messages))
            encode = partial(scheduler.tokenizer.encode_chat, tools=template_tools(parsed.tools))
        else:
            messages = tuple(render_messages(messages, parsed.tools))
    _check_prompt_size(scheduler, sum(len(m["content"] or "") for m in messages), "messages")
    special = request.app[SETTINGS].config.allow_special_tokens_in_messages
    try:
        # The template renders in a thread the daemon never waits for at exit (abandonable.py).
        prompt_ids = await run_abandonable(
            partial(encode, messages, special_tokens_in_content=special),
            limiter=request.app[TOKENIZING],
            name="chat template",
        )
    except ChatTemplateError as error:
        # The package's template refused the conversation (for example roles out of order), or
        # ran past its render budget on it (preparation/chat_template.py).
        limit = isinstance(error, ChatTemplateLimit)
        raise bad_request(str(error), param="messages", code="chat_template_limit" if limit else None) from None
    shape = ChatCompletionShape(_new_id("chatcmpl"), int(time.time()), parsed.model, parsed.include_usage)
    grammar = await _compile(request, scheduler, parsed.constraint)
    return await _generate(
        request, scheduler, prompt_ids, "messages", parsed.sampling, parsed.stream, shape, parsed.n, parsed.tokens,
        grammar=grammar,
        tools=parsed.tools is not None and parsed.tools.calls_possible,
        cache_scope=scope,
    )


async def completions(request: web.Request) -> web.StreamResponse:
    body = parse_json_body(await _read_body(request))
    parsed = parse_completion(body)
    scope = _cache_scope(request, body)
    state = request.app[STATE]
    scheduler = state.require_scheduler()
    check_model(parsed.model, state.model_name or "")
    _check_prompt_size(scheduler, len(parsed.prompt), "prompt")
    prompt_ids = await anyio.to_thread.run_sync(
        scheduler.tokenizer.encode, parsed.prompt, limiter=request.app[TOKENIZING]
    )
    if not prompt_ids:
        raise bad_request("prompt is empty; send at least one token of text", param="prompt")
    shape = TextCompletionShape(_new_id("cmpl"), int(time.time()), parsed.model, parsed.include_usage)
    echo = _Echo(parsed.prompt, tuple(prompt_ids)) if parsed.tokens.echo else None
    grammar = await _compile(request, scheduler, parsed.constraint)
    return await _generate(
        request, scheduler, prompt_ids, "prompt", parsed.sampling, parsed.stream, shape, parsed.n, parsed.tokens, echo,
        grammar=grammar,
        cache_scope=scope,
    )


def _cache_scope(request: web.Request, body: Mapping[str, Any]) -> bytes:
    """Whose prefix-cache blocks the request may share (daemon/cache_scope.py)."""
    settings = request.app[SETTINGS]
    return prefix_cache_scope(
        keys_required=settings.keys.required,
        across_keys=settings.config.prefix_cache_across_keys,
        authorization=request.headers.get("Authorization"),
        salt=cache_salt(body),
    )


async def _compile(request: web.Request, scheduler: Scheduler, spec: GrammarSpec | None) -> Grammar | None:
    """The request's grammar, compiled off the event loop (or found in the cache), within
    COMPILE_TIMEOUT_S; a 400 naming the field for one that cannot be served."""
    if spec is None:
        return None
    if scheduler.grammars is None:
        raise bad_request(f"{spec.param}: this server does not serve structured output", param=spec.param)
    grammars = scheduler.grammars
    try:
        with anyio.fail_after(COMPILE_TIMEOUT_S):
            return await anyio.to_thread.run_sync(grammars.compile, spec, limiter=request.app[COMPILING])
    except GrammarError as error:
        raise bad_request(f"{error.param}: {error.message}", param=error.param, code="invalid_grammar") from None
    except TimeoutError:
        # The compile goes on in its thread until llguidance's own limits end it; the request
        # does not wait for it.
        raise bad_request(
            f"{spec.param}: compiling it took longer than {COMPILE_TIMEOUT_S:g} s; simplify it",
            param=spec.param,
            code="invalid_grammar",
        ) from None


@dataclass(frozen=True)
class _Echo:
    """The prompt a completions answer starts with (echo), and its tokens (scored with logprobs)."""

    text: str
    token_ids: tuple[int, ...]


@dataclass
class _Tokens:
    """How one request's token-level answer is written: which entries, rendered how."""

    logprobs: int | None
    echo: _Echo | None
    renderer: TokenRenderer
    tools: bool = False  # the answer may be tool calls (chat with tools)

    def entries(self, event: TextDelta) -> list[RenderedToken] | None:
        if self.logprobs is None:
            return None
        return [self.renderer.render(entry) for entry in event.logprobs]

    def prompt_entries(self, event: TextDelta) -> list[RenderedToken] | None:
        """The echoed prompt's entries: its first token unscored, then the scored ones."""
        if self.echo is None or self.logprobs is None or event.prompt_logprobs is None:
            return None
        first = self.renderer.unscored(self.echo.token_ids[0])
        return [first, *(self.renderer.render(entry) for entry in event.prompt_logprobs)]


def _check_prompt_size(scheduler: Scheduler, characters: int, param: str) -> None:
    """Refuse, before tokenizing it, a prompt too long for the context whatever its tokens:
    tokenizing a long text costs the CPU for nothing when the answer is a 400 anyway."""
    fewest = scheduler.tokenizer.fewest_tokens(characters)
    if fewest is not None and fewest >= scheduler.max_context:
        raise bad_request(
            f"the prompt is {characters} characters, at least {fewest} tokens, and this model's context is "
            f"{scheduler.max_context} tokens, which leaves no room for a completion; shorten the prompt",
            param=param,
            code="context_length_exceeded",
        )


async def _expect_continue(request: web.Request) -> None:
    """`Expect: 100-continue`: invite the body only when it can be accepted; a declared length
    over max_body_bytes gets its 413 from _read_body at once, without the body being sent."""
    expect = request.headers.get("Expect", "").strip().lower()
    if expect != "100-continue":
        raise web.HTTPExpectationFailed(text=f"unknown Expect: {expect}")
    limit = request.app[SETTINGS].config.max_body_bytes
    if request.version >= (1, 1) and (request.content_length or 0) <= limit:
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the response proper has not started


async def _read_body(request: web.Request) -> bytes:
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


async def _generate(
    request: web.Request,
    scheduler: Scheduler,
    prompt_ids: Sequence[int],
    prompt_param: str,
    sampling: Mapping[str, Any],
    stream: bool,
    shape: ResponseShape,
    n: int = 1,
    token_options: TokenOptions = TokenOptions(),
    echo: _Echo | None = None,
    *,
    grammar: Grammar | None = None,
    tools: bool = False,
    cache_scope: bytes = b"",
) -> web.StreamResponse:
    config = request.app[SETTINGS].config
    check_logit_bias(token_options.logit_bias, scheduler.vocab_size)
    room = scheduler.max_context - len(prompt_ids)
    if room < 1:
        raise bad_request(
            f"the prompt is {len(prompt_ids)} tokens and this model's context is {scheduler.max_context} tokens, "
            "which leaves no room for a completion; shorten the prompt",
            param=prompt_param,
            code="context_length_exceeded",
        )
    clamp = scheduler.policy.clamp(sampling, max_tokens_limit=room)
    if token_options.logit_bias:
        # The policy has no say on logit_bias: it passes through, like seed and stop.
        clamp = dataclasses.replace(clamp, params=dataclasses.replace(clamp.params, logit_bias=token_options.logit_bias))
    if grammar is not None and clamp.params.stop:
        # A stop string could end a constrained answer before its grammar is complete (a JSON
        # object without its closing brace, finish_reason "stop"): the grammar decides the end.
        dropped = Adjustment(
            "stop", list(clamp.params.stop), [], f"{grammar.spec.param} decides where the answer ends"
        )
        clamp = dataclasses.replace(
            clamp, params=dataclasses.replace(clamp.params, stop=()), adjusted=(*clamp.adjusted, dropped)
        )
    scores_prompt = echo is not None and token_options.logprobs is not None
    generation = GenerationRequest(
        request_id=shape.id,
        prompt_token_ids=tuple(prompt_ids),
        params=clamp.params,
        fault=_fault(request, config),
        n=n,
        logprobs=token_options.logprobs,
        raw_logprobs=token_options.raw_logprobs,
        prompt_logprobs=token_options.logprobs if scores_prompt else None,
        grammar=grammar,
        cache_scope=cache_scope,
    )
    tokens = _Tokens(token_options.logprobs, echo, TokenRenderer(scheduler.tokenizer.token_bytes), tools)
    events = _submit(scheduler, generation, prompt_param)
    generated = request[GENERATED] = Generated(time.perf_counter())
    state = request.app[STATE]
    state.in_flight.add(generation.request_id)
    ended = False
    gone: ConnectionResetError | None = None
    flare = flare_object(clamp)
    if token_options.logprobs is not None:
        flare["logprobs"] = logprobs_object(clamp.params, raw=token_options.raw_logprobs)
    headers = {ADJUSTED_HEADER: ",".join(a.param for a in clamp.adjusted)} if clamp.adjusted else {}
    with structlog.contextvars.bound_contextvars(completion_id=shape.id):
        log.info(
            "generation_started", prompt_tokens=len(prompt_ids), n=n, stream=stream, adjusted=list(headers.values())
        )
        try:
            deadline = _Deadline(scheduler, generation.request_id, config.request_timeout_s)
            if not stream:
                collected = await _collect(request, events, deadline, shape, flare, headers, generated, n, tokens)
                ended = True
                return collected
            response = web.StreamResponse(headers={**SSE_HEADERS, **headers})
            try:
                await _stream(request, response, events, deadline, shape, flare, generated, n, tokens)
            except ConnectionResetError as error:
                # The client is gone, or stopped reading: `finally` cancels the request.
                gone = error
                return response
            ended = True
            return response
        finally:
            state.in_flight.discard(generation.request_id)
            if not ended:
                # Client gone (the handler was cancelled or a write failed): free its rows now.
                scheduler.cancel(generation.request_id)
                reason = (
                    f"client not reading ({gone})" if isinstance(gone, ClientNotReading) else "client disconnected"
                )
                log.info("generation_cancelled", reason=reason)


def _submit(scheduler: Scheduler, generation: GenerationRequest, prompt_param: str) -> RequestStream:
    try:
        return scheduler.submit(generation)
    except QueueFull as full:
        raise ApiError(
            429,
            f"the server is at capacity ({full}); retry after the Retry-After seconds",
            type=RATE_LIMIT,
            code="queue_full",
            headers={"Retry-After": str(max(1, math.ceil(full.retry_after_s)))},
        ) from None
    except Draining as draining:
        raise ApiError(
            503,
            "the server is draining (shutting down or paused by its operator) and admits no new requests",
            type=SERVER_ERROR,
            code="draining",
            headers={"Retry-After": str(max(1, math.ceil(draining.retry_after_s)))},
        ) from None
    except PromptTooLong as error:
        # Longer than the context, or than the whole KV cache: it could never be served here.
        raise bad_request(str(error), param=prompt_param, code="context_length_exceeded") from None
    except TooManyChoices as error:
        raise bad_request(str(error), param="n") from None


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


class _Deadline:
    """Reads a request's events, and past `request_timeout_s` has the scheduler end the request
    with a request_timeout failure (which then arrives as its last event)."""

    def __init__(self, scheduler: Scheduler, request_id: str, timeout_s: float | None) -> None:
        self._scheduler = scheduler
        self._request_id = request_id
        self._timeout_s = timeout_s
        self._deadline = None if timeout_s is None else anyio.current_time() + timeout_s

    async def next_event(self, events: RequestStream) -> StreamEvent:
        if self._deadline is not None:
            with anyio.move_on_after(self._deadline - anyio.current_time()):
                return await anext(events)
            self._deadline = None
            self._scheduler.cancel(
                self._request_id,
                RequestFailure(
                    code="request_timeout",
                    message=f"the request took longer than the server's limit of {self._timeout_s:g} s",
                    http_status=504,
                ),
            )
        return await anext(events)


async def _stream(
    request: web.Request,
    response: web.StreamResponse,
    events: RequestStream,
    deadline: _Deadline,
    shape: ResponseShape,
    flare: dict[str, Any],
    generated: Generated,
    n: int,
    tokens: _Tokens,
) -> None:
    await response.prepare(request)
    # Echo without scores: the prompt is the first text of every choice; with scores, it waits
    # for the prompt's entries, which come with each choice's first delta.
    echo_now = tokens.echo is not None and tokens.logprobs is None
    offsets = [0] * n  # characters of each choice written so far (completions' text_offset)
    readers = [ToolCallReader(tokens.tools) for _ in range(n)]
    for index in range(n):
        first = shape.first_chunk(index)
        if index == 0:
            first["flare"] = flare
        await response.write(sse_data(first))
        if echo_now and tokens.echo is not None:
            await response.write(sse_data(shape.text_chunk(tokens.echo.text, index)))
            offsets[index] = len(tokens.echo.text)
    finished: list[Finished] = []
    while True:
        event = await deadline.next_event(events)
        if isinstance(event, TextDelta):
            generated.token()
            prompt_entries = tokens.prompt_entries(event)
            if prompt_entries is not None and tokens.echo is not None:
                chunk = shape.text_chunk(tokens.echo.text, event.index, prompt_entries, offsets[event.index])
                await response.write(sse_data(chunk))
                offsets[event.index] += len(tokens.echo.text)
            entries = tokens.entries(event)
            text, deltas = readers[event.index].push(event.text)
            if text or entries:
                chunk = shape.text_chunk(text, event.index, entries, offsets[event.index])
                await response.write(sse_data(chunk))
                offsets[event.index] += len(text)
            if deltas and isinstance(shape, ChatCompletionShape):
                await response.write(sse_data(shape.tool_calls_chunk(deltas, event.index)))
            continue
        if isinstance(event, Finished):
            reason = "tool_calls" if readers[event.index].called and event.reason == "stop" else event.reason
            final = shape.final_chunk(reason, event.index)
            if event.fell_back:
                final["flare"] = {"fell_back": True}
            await response.write(sse_data(final))
            finished.append(event)
            if len(finished) < n:
                continue
            usage = _request_usage(finished)
            if shape.include_usage:
                await response.write(sse_data(shape.usage_chunk(usage)))
            _log_end(event, generated, usage)
        else:
            # The status line said 200; the metrics must still count a failure.
            request[OUTCOME] = "cancelled" if event.failure.code == "cancelled" else "failed"
            await response.write(sse_data(failure_body(event.failure)))
            _log_end(event, generated, event.usage)
        await response.write(DONE)
        await response.write_eof()
        return


async def _collect(
    request: web.Request,
    events: RequestStream,
    deadline: _Deadline,
    shape: ResponseShape,
    flare: dict[str, Any],
    headers: Mapping[str, str],
    generated: Generated,
    n: int,
    tokens: _Tokens,
) -> web.Response:
    texts: list[list[str]] = [[tokens.echo.text] if tokens.echo is not None else [] for _ in range(n)]
    entries: list[list[RenderedToken]] = [[] for _ in range(n)]
    finished: dict[int, Finished] = {}
    while True:
        event = await deadline.next_event(events)
        if isinstance(event, TextDelta):
            generated.token()
            texts[event.index].append(event.text)
            prompt_entries = tokens.prompt_entries(event)
            if prompt_entries is not None:
                entries[event.index][:0] = prompt_entries
            entries[event.index].extend(tokens.entries(event) or ())
            continue
        if isinstance(event, Failed):
            _log_end(event, generated, event.usage)
            if event.failure.code == "cancelled":
                request[OUTCOME] = "cancelled"  # its 503 is the operator's doing, not the server's state
            # The OpenAI SDKs retry a 503 by themselves unless told not to.
            retry = {} if event.failure.retryable else {"x-should-retry": "false"}
            return web.json_response(failure_body(event.failure), status=event.failure.http_status, headers=retry)
        finished[event.index] = event
        if len(finished) < n:
            continue
        usage = _request_usage(list(finished.values()))
        _log_end(event, generated, usage)
        choices = []
        for i in range(n):
            reader = ToolCallReader(tokens.tools)
            text, _ = reader.push("".join(texts[i]))
            reason = "tool_calls" if reader.called and finished[i].reason == "stop" else finished[i].reason
            calls = [call.to_json() for call in reader.calls] if reader.called else None
            choices.append(ChoiceText(text, reason, entries[i] if tokens.logprobs is not None else None, calls))
        body = shape.body(choices, usage)
        body["flare"] = {**flare, "fell_back": any(f.fell_back for f in finished.values())}
        return web.json_response(body, headers=headers)


def _request_usage(finished: Sequence[Finished]) -> Usage:
    """The request's usage: its prompt once, however many choices shared it, and every choice's
    completion tokens."""
    first = finished[0].usage
    return Usage(first.prompt_tokens, sum(f.usage.completion_tokens for f in finished), first.cached_tokens)


def _log_end(event: Finished | Failed, generated: Generated, usage: Usage) -> None:
    generated.usage = usage
    if isinstance(event, Finished):
        log.info(
            "generation_finished",
            finish_reason=event.reason,
            completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
            fell_back=event.fell_back,
        )
    else:
        failure = event.failure
        log.warning(
            "generation_failed",
            code=failure.code,
            http_status=failure.http_status,
            device_status=failure.status.name if failure.status is not None else None,
            round=failure.round,
            message=failure.message,
        )
