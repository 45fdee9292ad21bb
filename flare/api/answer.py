"""Submit and render: a prepared request's scheduler events, written by one API's renderer.

The events of every prompt and choice are read here, whichever API asked: text deltas (each
choice's tool calls read out of its text as they stream), one Finished per choice, or a Failed
that ends the request. A `Renderer` turns them into its API's SSE frames or JSON body. The
request ends here too: past `request_timeout_s` it is failed, and when the client goes away
every sequence of it is cancelled at once. A stream with no event for `keep_alive_s` (a round
stalled, a long prompt prefilling) gets its API's keep-alive, so that clients and proxies with
read timeouts keep the connection.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
import structlog
from aiohttp import web

from flare.api.errors import RATE_LIMIT, SERVER_ERROR, ApiError, bad_request
from flare.api.generation import Generation
from flare.api.harmony import HarmonyCalls, HarmonyReader
from flare.api.prepare import Echo, Prepared
from flare.api.reasoning import ReasoningReader
from flare.api.rendering import ChoiceText, RenderedToken, Renderer, TextPiece, TokenRenderer
from flare.api.sse import SSE_HEADERS
from flare.api.tools.reader import ToolCallReader
from flare.scheduler.errors import Draining, PromptTooLong, QueueFull, TooManyChoices
from flare.scheduler.request import (
    Failed,
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
# A handler whose response status does not tell the whole story (a stream that answered 200 and
# then failed or was cancelled) records the outcome here; the metrics middleware counts it.
OUTCOME = web.RequestKey("flare_outcome", str)


class ClientNotReading(ConnectionResetError):
    """A write waited `write_timeout_s` for a client that does not read what it asked for
    (raised by the server's connection guard, server/connections.py)."""


async def answer(
    request: web.Request,
    scheduler: Scheduler,
    in_flight: set[str],
    prepared: Prepared,
    renderer: Renderer,
    timeout_s: float | None,
    keep_alive_s: float,
    stream_headers: Mapping[str, str] = SSE_HEADERS,
) -> web.StreamResponse:
    """Submit `prepared`'s requests and write their answer; cancel them all if the client goes.
    `in_flight` holds their ids until the answer is written (shutdown waits for it to empty).
    A stream is SSE unless the API streams otherwise (`stream_headers`: Ollama's NDJSON)."""
    streams = _submit(scheduler, prepared)
    ids = [r.request_id for r in prepared.requests]
    generated = request[GENERATED] = Generated(time.perf_counter())
    in_flight.update(ids)
    ended = False
    gone: ConnectionResetError | None = None
    headers = prepared.headers()
    events = _Events(scheduler, prepared, streams, timeout_s)
    reading = _Reading(prepared, TokenRenderer(scheduler.tokenizer.token_bytes))
    with structlog.contextvars.bound_contextvars(completion_id=prepared.id, **_labels(prepared.generation)):
        log.info(
            "generation_started",
            prompt_tokens=prepared.prompt_tokens,
            n=prepared.choices,
            stream=prepared.generation.stream,
            adjusted=list(headers.values()),
        )
        try:
            if not prepared.generation.stream:
                collected = await _collect(request, events, reading, renderer, prepared, generated)
                ended = True
                return collected
            response = web.StreamResponse(headers={**stream_headers, **headers})
            try:
                await _stream(request, response, events, reading, renderer, prepared, generated, keep_alive_s)
            except ConnectionResetError as error:
                # The client is gone, or stopped reading: `finally` cancels the request.
                gone = error
                return response
            ended = True
            return response
        finally:
            in_flight.difference_update(ids)
            if not ended:
                # Client gone (the handler was cancelled or a write failed): free its rows now.
                for request_id in ids:
                    scheduler.cancel(request_id)
                reason = (
                    f"client not reading ({gone})" if isinstance(gone, ClientNotReading) else "client disconnected"
                )
                log.info("generation_cancelled", reason=reason)


def _labels(generation: Generation) -> dict[str, str]:
    """What the client sent for the operator (its labels, a model name mapped to the served
    model), on every log line of its request."""
    labels = {
        "safety_identifier": generation.safety_identifier,
        "prompt_cache_key": generation.prompt_cache_key,
        "model_mapped_from": generation.model if generation.model_mapped_to is not None else None,
    }
    return {name: value for name, value in labels.items() if value is not None}


def _submit(scheduler: Scheduler, prepared: Prepared) -> list[RequestStream]:
    """Every prompt's request admitted, or none: one refused cancels those before it."""
    streams: list[RequestStream] = []
    try:
        for generation in prepared.requests:
            streams.append(_submit_one(scheduler, generation, prepared.generation.prompt.param))
    except BaseException:
        for admitted in prepared.requests[: len(streams)]:
            scheduler.cancel(admitted.request_id)
        raise
    return streams


def _submit_one(scheduler: Scheduler, generation: GenerationRequest, prompt_param: str) -> RequestStream:
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


class _Events:
    """The events of every prompt's request in turn, each choice renumbered prompt-major
    (prompt k's choice j is k*n + j). The requests run together in the scheduler; reading
    them one after another only orders how their (buffered) events are written.

    Past `timeout_s` every request is ended with a request_timeout failure, which then
    arrives as the last event read."""

    def __init__(
        self, scheduler: Scheduler, prepared: Prepared, streams: list[RequestStream], timeout_s: float | None
    ) -> None:
        self._scheduler = scheduler
        self._ids = [r.request_id for r in prepared.requests]
        self._streams = streams
        self._n = prepared.n
        self._current = 0
        self._finished = 0  # choices of the current prompt finished
        self._timeout_s = timeout_s
        self._deadline = None if timeout_s is None else anyio.current_time() + timeout_s

    async def next(self) -> tuple[int, StreamEvent]:
        """(the prompt's number, its event with the request-wide choice index)."""
        prompt = self._current
        event = await self._read(self._streams[prompt])
        if isinstance(event, Failed):
            return prompt, event
        if isinstance(event, Finished):
            self._finished += 1
            if self._finished == self._n:
                self._current, self._finished = prompt + 1, 0
        if isinstance(event, (TextDelta, Finished)) and prompt:
            event = dataclasses.replace(event, index=prompt * self._n + event.index)
        return prompt, event

    async def _read(self, stream: RequestStream) -> StreamEvent:
        if self._deadline is not None:
            with anyio.move_on_after(self._deadline - anyio.current_time()):
                return await anext(stream)
            self._deadline = None
            for request_id in self._ids:
                self._scheduler.cancel(
                    request_id,
                    RequestFailure(
                        code="request_timeout",
                        message=f"the request took longer than the server's limit of {self._timeout_s:g} s",
                        http_status=504,
                    ),
                )
        return await anext(stream)


@dataclass
class _Reading:
    """How one request's token-level answer is read: its reasoning, its tool calls and
    log-probability entries."""

    prepared: Prepared
    renderer: TokenRenderer
    readers: list[ToolCallReader | HarmonyCalls] = field(init=False)
    reasoners: list[ReasoningReader | HarmonyReader | None] = field(init=False)

    def __post_init__(self) -> None:
        calls = self.prepared.generation.calls_possible
        fmt, call_prefix = self.prepared.tool_format, self.prepared.ids.call
        if fmt.name == "harmony" and self.prepared.reasoning is not None:
            # A chat answer of gpt-oss: one reader splits its channels into reasoning, text and calls.
            harmony = [HarmonyReader(call_prefix) for _ in range(self.prepared.choices)]
            self.reasoners, self.readers = list(harmony), [reader.calls for reader in harmony]
            return
        self.readers = [ToolCallReader(calls, fmt, call_prefix) for _ in range(self.prepared.choices)]
        reasoning, inside = self.prepared.reasoning, self.prepared.reasoning_inside
        self.reasoners = [
            None if reasoning is None else ReasoningReader(reasoning, inside) for _ in range(self.prepared.choices)
        ]

    def split(self, index: int, text: str) -> tuple[str, str]:
        """(reasoning, answer) of a piece of choice `index`'s text."""
        reasoner = self.reasoners[index]
        return ("", text) if reasoner is None else reasoner.push(text)

    def flush(self, index: int) -> tuple[str, str]:
        """(reasoning, answer) held back at the end of choice `index`."""
        reasoner = self.reasoners[index]
        return ("", "") if reasoner is None else reasoner.flush()

    def echo(self, index: int) -> Echo | None:
        return self.prepared.echoes[index // self.prepared.n]

    def entries(self, event: TextDelta) -> list[RenderedToken] | None:
        if self.prepared.tokens.logprobs is None:
            return None
        return [self.renderer.render(entry) for entry in event.logprobs]

    def prompt_entries(self, event: TextDelta) -> list[RenderedToken] | None:
        """The echoed prompt's entries: its first token unscored, then the scored ones."""
        echo = self.echo(event.index)
        if echo is None or self.prepared.tokens.logprobs is None or event.prompt_logprobs is None:
            return None
        first = self.renderer.unscored(echo.token_ids[0])
        return [first, *(self.renderer.render(entry) for entry in event.prompt_logprobs)]

    def reason(self, event: Finished) -> str:
        return "tool_calls" if self.readers[event.index].called and event.reason == "stop" else event.reason


async def _write(response: web.StreamResponse, frames: list[bytes]) -> None:
    for frame in frames:
        await response.write(frame)


async def _stream(
    request: web.Request,
    response: web.StreamResponse,
    events: _Events,
    reading: _Reading,
    renderer: Renderer,
    prepared: Prepared,
    generated: Generated,
    keep_alive_s: float,
) -> None:
    await response.prepare(request)
    await _write(response, renderer.start(prepared.flare()))
    finished: list[Finished] = []
    while True:
        # Cancelling the wait loses no event (the stream's queue keeps it for the next read).
        with anyio.move_on_after(keep_alive_s) as waited:
            _, event = await events.next()
        if waited.cancelled_caught:
            await _write(response, renderer.keep_alive())
            continue
        if isinstance(event, TextDelta):
            generated.token()
            reasoning, answer_text = reading.split(event.index, event.text)
            text, deltas = reading.readers[event.index].push(answer_text)
            piece = TextPiece(event.index, text, reading.entries(event), reading.prompt_entries(event), reasoning)
            await _write(response, renderer.text(piece))
            if deltas:
                await _write(response, renderer.calls(event.index, deltas))
            continue
        if isinstance(event, Finished):
            reasoning, answer_text = reading.flush(event.index)
            if reasoning or answer_text:
                text, deltas = reading.readers[event.index].push(answer_text)
                await _write(response, renderer.text(TextPiece(event.index, text, None, None, reasoning)))
            else:  # a harmony call's last arguments may still be held
                _, deltas = reading.readers[event.index].push("")
            if deltas:
                await _write(response, renderer.calls(event.index, deltas))
            await _write(response, renderer.finish(event.index, reading.reason(event), event.fell_back, event.stop_string))
            finished.append(event)
            if len(finished) < prepared.choices:
                continue
            usage = _request_usage(prepared, finished)
            _log_end(event, generated, usage)
            await _write(response, renderer.end(usage))
        else:
            # The status line said 200; the metrics must still count a failure.
            request[OUTCOME] = "cancelled" if event.failure.code == "cancelled" else "failed"
            _log_end(event, generated, event.usage)
            await _write(response, renderer.fail(event.failure))
        await response.write_eof()
        return


async def _collect(
    request: web.Request,
    events: _Events,
    reading: _Reading,
    renderer: Renderer,
    prepared: Prepared,
    generated: Generated,
) -> web.Response:
    count = prepared.choices
    texts: list[list[str]] = [[] for _ in range(count)]
    entries: list[list[RenderedToken]] = [[] for _ in range(count)]
    finished: dict[int, Finished] = {}
    while True:
        _, event = await events.next()
        if isinstance(event, TextDelta):
            generated.token()
            texts[event.index].append(event.text)
            prompt_entries = reading.prompt_entries(event)
            if prompt_entries is not None:
                entries[event.index][:0] = prompt_entries
            entries[event.index].extend(reading.entries(event) or ())
            continue
        if isinstance(event, Failed):
            _log_end(event, generated, event.usage)
            if event.failure.code == "cancelled":
                request[OUTCOME] = "cancelled"  # its 503 is the operator's doing, not the server's state
            return renderer.failure_response(event.failure)
        finished[event.index] = event
        if len(finished) < count:
            continue
        usage = _request_usage(prepared, list(finished.values()))
        _log_end(event, generated, usage)
        choices = []
        for i in range(count):
            reader = reading.readers[i]
            reasoning, answer_text = reading.split(i, "".join(texts[i]))
            held_reasoning, held_text = reading.flush(i)
            text, _ = reader.push(answer_text + held_text)
            echo = reading.echo(i)
            if echo is not None:
                text = echo.text + text
            logprobs = entries[i] if prepared.tokens.logprobs is not None else None
            thought = reasoning + held_reasoning if reading.reasoners[i] is not None else None
            choice = ChoiceText(
                text, reading.reason(finished[i]), logprobs, reader.calls or None, finished[i].stop_string, thought
            )
            choices.append(choice)
        flare = {**prepared.flare(), "fell_back": any(f.fell_back for f in finished.values())}
        return web.json_response(renderer.body(choices, usage, flare), headers=prepared.headers())


def _request_usage(prepared: Prepared, finished: Sequence[Finished]) -> Usage:
    """The request's usage: each prompt once, however many choices shared it, and every
    choice's completion tokens."""
    n = prepared.n
    firsts = {f.index // n: f.usage for f in finished}
    return Usage(
        sum(u.prompt_tokens for u in firsts.values()),
        sum(f.usage.completion_tokens for f in finished),
        sum(u.cached_tokens for u in firsts.values()),
        sum(f.usage.accepted_prediction_tokens for f in finished),
        sum(f.usage.rejected_prediction_tokens for f in finished),
    )


def _log_end(event: Finished | Failed, generated: Generated, usage: Usage) -> None:
    generated.usage = usage
    if isinstance(event, Finished):
        log.info(
            "generation_finished",
            finish_reason=event.reason,
            completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
            accepted_prediction_tokens=usage.accepted_prediction_tokens,
            rejected_prediction_tokens=usage.rejected_prediction_tokens,
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
