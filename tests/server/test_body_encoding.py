"""Decoding request bodies sent with a Content-Encoding (flare/server/body_encoding.py)."""

from __future__ import annotations

import gzip
import zlib

import pytest

from flare.api.errors import ApiError
from flare.server.body_encoding import decode_body

BODY = b'{"prompt": "' + b"hello " * 100 + b'"}'


def _raw_deflate(data: bytes) -> bytes:
    compressor = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return compressor.compress(data) + compressor.flush()


# gzip's header holds the time it was written (mtime=0 leaves it out): parameters that change from
# one second to the next gave each pytest-xdist worker a different collection, and the run failed.
@pytest.mark.parametrize(
    ("encoded", "encoding"),
    [
        (gzip.compress(BODY, mtime=0), "gzip"),
        (gzip.compress(BODY[:50], mtime=0) + gzip.compress(BODY[50:], mtime=0), "x-gzip"),  # two members
        (zlib.compress(BODY), "deflate"),
        (_raw_deflate(BODY), "deflate"),
        (BODY, "identity"),
        (gzip.compress(zlib.compress(BODY), mtime=0), "deflate, gzip"),
    ],
    ids=["gzip", "x-gzip of two members", "deflate", "raw deflate", "identity", "deflate then gzip"],
)
def test_bodies_that_decode_are_returned_whole(encoded: bytes, encoding: str) -> None:
    assert decode_body(encoded, encoding, 1 << 20) == BODY


def _refusal(encoded: bytes, encoding: str, limit: int = 1 << 20) -> ApiError:
    with pytest.raises(ApiError) as raised:
        decode_body(encoded, encoding, limit)
    return raised.value


def test_what_is_wrong_is_said() -> None:
    assert "magic bytes" in _refusal(b"plain text", "gzip").message
    assert "empty" in _refusal(b"", "gzip").message
    assert "truncated" in _refusal(zlib.compress(BODY)[:-6], "deflate").message
    assert "truncated" in _refusal(gzip.compress(BODY)[:-3], "gzip").message
    assert "zlib" in _refusal(b"\x78\x9c garbage!", "deflate").message
    assert "follow the end" in _refusal(zlib.compress(BODY) + b"tail", "deflate").message
    assert {_refusal(b"x", "gzip").status, _refusal(b"x", "deflate").status} == {400}


def test_a_bomb_stops_at_the_limit_and_unknown_codings_are_415() -> None:
    bomb = zlib.compress(b" " * (10 << 20))
    refused = _refusal(bomb, "deflate", limit=1 << 20)
    assert refused.status == 413 and refused.code == "request_too_large"
    assert decode_body(zlib.compress(b" " * 1000), "deflate", 1000) == b" " * 1000  # exactly the limit
    assert _refusal(b"x", "br").status == 415
    assert _refusal(b"x", "gzip, gzip, gzip, gzip, gzip").status == 415
