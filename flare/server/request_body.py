"""Reading a request's body: `Expect: 100-continue` answered only for a body that can be
accepted, the body read within a time limit and max_body_bytes, and decoded (body_encoding.py)."""

from __future__ import annotations

import anyio
from aiohttp import web

from flare.api.errors import ApiError
from flare.server.body_encoding import decode_body
from flare.server.context import SETTINGS

BODY_READ_TIMEOUT_S = 30.0


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
