"""API keys: `Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`), compared in constant time."""

from __future__ import annotations

import hmac
from collections.abc import Sequence


class ApiKeys:
    def __init__(self, keys: Sequence[str]) -> None:
        self._keys = tuple(key.encode("utf-8") for key in keys)

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def accepted_key(self, authorization: str | None, x_api_key: str | None) -> bytes:
        """The key the request presents, `Authorization: Bearer <key>` or `x-api-key: <key>`,
        when it is one of the keys; empty when neither header carries one.

        Every key is compared, whichever matches, and each comparison is hmac.compare_digest,
        so the time taken says nothing about how much of a key was right.
        """
        for presented in (_bearer_key(authorization), _key_bytes(x_api_key)):
            matched = False
            for key in self._keys:
                matched |= hmac.compare_digest(presented, key)
            if matched and presented:
                return presented
        return b""


def _bearer_key(authorization: str | None) -> bytes:
    if authorization is None:
        return b""
    scheme, _, token = authorization.strip().partition(" ")
    return _key_bytes(token) if scheme.lower() == "bearer" else b""


def _key_bytes(token: str | None) -> bytes:
    if token is None:
        return b""
    # Header text may hold undecodable bytes as surrogates; they can never match a key.
    return token.strip().encode("utf-8", "surrogateescape") if token.strip().isprintable() else b""
