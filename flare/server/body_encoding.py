"""Request bodies sent with a Content-Encoding: decoded here, not by aiohttp.

aiohttp's own decoding (its `auto_decompress`) reports an undecodable body by raising from the
body stream, where the handler's error answer is followed by an error-level traceback when the
connection drains it; it reports a deflate stream cut short (all of Content-Length sent) only
at the parser's end, so a handler waiting for the body waits for its read timeout; and its
message for a gzip body that is not gzip does not say so. The daemon therefore reads the body's
bytes as sent (the server runs with `auto_decompress=False`) and decodes them here: a 400 at
once that says what is wrong with the data, a 413 when the decoded body outgrows the limit
(however small the compressed one: a decompression bomb is stopped at the limit, never
inflated whole), a 415 for a coding it does not decode.
"""

from __future__ import annotations

import zlib

from flare.api.errors import ApiError

# The codings decoded, with the zlib window bits that read them (RFC 9110 §8.4.1): gzip's
# header (RFC 1952), and deflate's zlib wrapper (RFC 1950), or bare deflate (RFC 1951), which
# some clients send under the same name.
_GZIP_WBITS = 16 + zlib.MAX_WBITS
_ZLIB_WBITS = zlib.MAX_WBITS
_RAW_DEFLATE_WBITS = -zlib.MAX_WBITS
SUPPORTED_ENCODINGS = ("gzip", "x-gzip", "deflate", "identity")
# Codings stacked on one body ("gzip, gzip, ..."): more than this is no client's honest body.
MAX_CODINGS = 4


def decode_body(raw: bytes, content_encoding: str | None, limit: int) -> bytes:
    """The body `raw` with its `content_encoding` undone (codings applied in the order listed,
    undone last first), at most `limit` bytes; an ApiError saying what is wrong otherwise."""
    codings = [c.strip().lower() for c in (content_encoding or "").split(",") if c.strip()]
    if len(codings) > MAX_CODINGS:
        raise _unsupported(f"{len(codings)} stacked Content-Encoding codings (at most {MAX_CODINGS})")
    for coding in codings:
        if coding not in SUPPORTED_ENCODINGS:
            raise _unsupported(f"Content-Encoding {coding!r}")
    body = raw
    for coding in reversed(codings):
        if coding == "identity":
            continue
        body = _inflate(body, coding, limit)
    return body


def _inflate(data: bytes, coding: str, limit: int) -> bytes:
    if not data:
        raise _invalid(coding, "the body is empty, so it holds no compressed data")
    gzip = coding in ("gzip", "x-gzip")
    if gzip and data[:2] != b"\x1f\x8b":
        raise _invalid(coding, f"it does not begin with gzip's magic bytes 1f 8b (it begins {data[:2].hex(' ')})")
    wbits = _GZIP_WBITS if gzip else (_ZLIB_WBITS if _zlib_header(data) else _RAW_DEFLATE_WBITS)
    out = bytearray()
    rest = data
    while True:
        decompressor = zlib.decompressobj(wbits)
        consumed = len(rest)
        try:
            # One byte past the limit tells "exactly the limit" from "more".
            out += decompressor.decompress(rest, limit - len(out) + 1)
        except zlib.error as error:
            raise _invalid(coding, f"zlib: {error}") from None
        if len(out) > limit or decompressor.unconsumed_tail:
            raise ApiError(
                413,
                f"the request body decoded from {coding} is larger than the limit of {limit} bytes",
                code="request_too_large",
            )
        if not decompressor.eof:
            raise _invalid(
                coding,
                f"its {consumed} bytes end inside the compressed stream (it is truncated: the stream's end "
                "marker and checksum are missing)",
            )
        rest = decompressor.unused_data
        if not rest:
            return bytes(out)
        if not gzip:
            raise _invalid(coding, f"{len(rest)} bytes follow the end of the compressed stream")
        # A gzip body may hold several members one after another (RFC 1952 §2.2).


def _zlib_header(data: bytes) -> bool:
    """Whether `data` begins with a zlib header (RFC 1950 §2.2: CM 8, the check bits)."""
    return len(data) >= 2 and data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0


def _invalid(coding: str, why: str) -> ApiError:
    return ApiError(
        400,
        f"the request body is not valid {coding} data (its Content-Encoding): {why}",
        code="invalid_body_encoding",
    )


def _unsupported(what: str) -> ApiError:
    return ApiError(
        415,
        f"{what} is not supported; send the body as it is, or with Content-Encoding gzip or deflate",
        code="unsupported_content_encoding",
    )
