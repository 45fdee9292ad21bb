"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Every answer that is not a success carries this body, so the OpenAI SDK raises its usual
exception classes (BadRequestError, NotFoundError, RateLimitError, ...) with our message.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from flare.scheduler.request import RequestFailure

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
RATE_LIMIT = "rate_limit_error"
SERVER_ERROR = "server_error"


class ApiError(Exception):
    """An answer other than success, raised anywhere below a handler and rendered by the error middleware."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}
        # Close the connection after the answer: bytes the request left unread (a body refused
        # before it was read) must not be taken for the next request.
        self.close = close

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)

    def response(self) -> web.Response:
        response = web.json_response(self.body(), status=self.status, headers=self.headers)
        if self.close:
            response.force_close()
        return response


def error_body(message: str, *, type: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, *, param: str | None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def failure_body(failure: RequestFailure) -> dict[str, Any]:
    """The body of a request that ended without finishing: OpenAI's error, plus a `flare` member.

    `flare.status` / `status_name` are the device status (DESIGN.md's table) and `round` the
    scheduler round it occurred in; all three are null for failures that are not device
    statuses (cancelled, shutdown, request_timeout).
    """
    body = error_body(failure.message, type=failure.type, param=failure.param, code=failure.code)
    body["error"]["flare"] = {
        "status": int(failure.status) if failure.status is not None else None,
        "status_name": failure.status.name if failure.status is not None else None,
        "round": failure.round,
    }
    return body
