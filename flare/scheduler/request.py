"""What the daemon submits to the scheduler, and the events it reads back."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Literal

from flare.kernels.status import DeviceStatus
from flare.sampling.params import SamplingParams


@dataclass(frozen=True)
class FaultSpec:
    """A device status to inject on this request's row (tests only, `--fault-injection`).

    round None means the first round in which the request samples a token.
    """

    status: DeviceStatus
    round: int | None = None


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    fault: FaultSpec | None = None


@dataclass(frozen=True)
class TextDelta:
    """New text, never a broken UTF-8 sequence and never part of a stop string."""

    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Finished:
    reason: Literal["stop", "length"]
    usage: Usage
    fell_back: bool = False


@dataclass(frozen=True)
class RequestFailure:
    """Why one request ended without finishing; the daemon turns it into an OpenAI error body."""

    code: str  # DeviceStatus name, or "cancelled", "shutdown", ...
    message: str
    http_status: int
    type: str = "server_error"
    param: str | None = None
    status: DeviceStatus | None = None
    round: int | None = None
    # False when sending the same request again is pointless (an operator cancelled it); the
    # daemon then says so to clients that retry 5xx answers on their own (x-should-retry).
    retryable: bool = True


@dataclass(frozen=True)
class Failed:
    failure: RequestFailure
    usage: Usage


StreamEvent = TextDelta | Finished | Failed


class RequestStream:
    """The daemon's end of one request: `async for event in stream`; the last event is
    Finished or Failed, after which iteration stops. Events are put from the event loop
    by the scheduler; the queue is unbounded because a round adds at most K+1 tokens."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self._ended = False

    def put(self, event: StreamEvent) -> None:
        self._queue.put_nowait(event)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamEvent:
        if self._ended:
            raise StopAsyncIteration
        event = await self._queue.get()
        if not isinstance(event, TextDelta):
            self._ended = True
        return event
