"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, on Anthropic's
Messages API in Anthropic's: `{"type": "error", "error": {"type", "message"}}`, and on Ollama's
API in Ollama's: `{"error": "message"}`.

Every answer that is not a success carries one of these bodies, so the OpenAI and Anthropic
SDKs raise their usual exception classes (BadRequestError, NotFoundError, RateLimitError, ...)
with our message.
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

    def body(self, *, anthropic: bool = False, ollama: bool = False) -> dict[str, Any]:
        if ollama:
            return {"error": self.message}
        if anthropic:
            return anthropic_error_body(self.status, self.message)
        return error_body(self.message, type=self.type, param=self.param, code=self.code)

    def response(self, *, anthropic: bool = False, ollama: bool = False) -> web.Response:
        body = self.body(anthropic=anthropic, ollama=ollama)
        response = web.json_response(body, status=self.status, headers=self.headers)
        if self.close:
            response.force_close()
        return response


def error_body(message: str, *, type: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# Anthropic's error types by HTTP status.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


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


def failure_response(failure: RequestFailure) -> web.Response:
    """A failed request's answer in OpenAI's error shape (chat, completions, Responses)."""
    # The OpenAI SDKs retry a 503 by themselves unless told not to.
    retry = {} if failure.retryable else {"x-should-retry": "false"}
    return web.json_response(failure_body(failure), status=failure.http_status, headers=retry)
