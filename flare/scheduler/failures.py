"""How a device status or a scheduler decision ends one request.

HTTP statuses (documented in docs/api.md): the request's own sampling parameters cannot be
served -> 422; the device produced an invalid result for the row (the model or the drafter
failed, not the request) -> 502; the server ended the request (operator cancel, shutdown)
-> 503. Never a bare 500.
"""

from __future__ import annotations

from flare.sampler.status import STATUS_MEANING, DeviceStatus
from flare.scheduler.request import RequestFailure

_HTTP_STATUS: dict[DeviceStatus, int] = {
    DeviceStatus.NONFINITE_LOGITS: 502,
    DeviceStatus.INVALID_DRAFT_TOKEN: 502,
    DeviceStatus.INVALID_DRAFT_PROBABILITY: 502,
    DeviceStatus.EMPTY_DISTRIBUTION: 422,
    DeviceStatus.INVALID_SAMPLING_PARAMETERS: 422,
    DeviceStatus.INVALID_SPECULATION: 422,
}

_TYPE: dict[int, str] = {422: "invalid_request_error", 502: "server_error"}


def device_failure(status: DeviceStatus, round_index: int, constraint: str | None = None) -> RequestFailure:
    """`constraint`: the field of the row's grammar, if it has one. An empty distribution under a
    grammar is the grammar's mask leaving no token the rest of the sampling keeps, so the
    failure names that field."""
    http_status = _HTTP_STATUS[status]
    message = f"device status {int(status)} ({status.name}) in round {round_index}: {STATUS_MEANING[status]}"
    named = constraint is not None and status is DeviceStatus.EMPTY_DISTRIBUTION
    if named:
        message += f"; {constraint} allowed no token with positive probability"
    return RequestFailure(
        code=status.name,
        message=message,
        http_status=http_status,
        type=_TYPE[http_status],
        param=constraint if named else None,
        status=status,
        round=round_index,
    )


def cancelled_failure(reason: str) -> RequestFailure:
    return RequestFailure(
        code="cancelled",
        message=f"request cancelled: {reason}",
        http_status=503,
        type="server_error",
        retryable=False,
    )


def engine_dead_failure(reason: str) -> RequestFailure:
    """A tensor-parallel group lost a rank (flare/parallel/failstop.py): the daemon stops and
    its supervisor restarts the group."""
    return RequestFailure(
        code="engine_dead",
        message=f"the engine stopped ({reason}); the server restarts, retry the request",
        http_status=503,
        type="server_error",
    )


def round_failure(round_index: int, error: Exception) -> RequestFailure:
    """A bug or device fault outside any row's status: every request with a row in the round ends."""
    return RequestFailure(
        code="round_failed", message=f"the model failed in round {round_index}: {error}", http_status=503
    )


def shutdown_failure() -> RequestFailure:
    return RequestFailure(
        code="shutdown",
        message="the server shut down before the request finished; retry it",
        http_status=503,
        type="server_error",
    )


def grammar_failure(error: str | None, param: str) -> RequestFailure:
    """A choice's grammar could not go on: llguidance stops a grammar whose next step passes its
    limits (a lexer or parser too complex for the text so far) and then refuses every token.
    The request's constraint is what cannot be served: 422 naming its field."""
    return RequestFailure(
        code="grammar_error",
        message=f"{param}: the answer could not follow the constraint ({_reason(error)})",
        http_status=422,
        type="invalid_request_error",
        param=param,
    )


def _reason(error: str | None) -> str:
    """llguidance's error without the parser-state dump it appends after "<state>"."""
    return (error or "no token allowed").split("<state>", 1)[0].strip()[:300]
