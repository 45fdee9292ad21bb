"""API keys: `Authorization: Bearer <key>`, compared in constant time."""

from __future__ import annotations

import hmac
from collections.abc import Sequence


class ApiKeys:
    def __init__(self, keys: Sequence[str]) -> None:
        self._keys = tuple(key.encode("utf-8") for key in keys)

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def accepts(self, authorization: str | None) -> bool:
        """True when the Authorization header carries one of the keys.

        Every key is compared, whichever matches, and each comparison is hmac.compare_digest,
        so the time taken says nothing about how much of a key was right.
        """
        presented = presented_key(authorization)
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(presented, key)
        return matched and bool(presented)


def presented_key(authorization: str | None) -> bytes:
    """The key an Authorization header presents (`Bearer <key>`), as bytes; empty when it
    presents none."""
    if authorization is None:
        return b""
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return b""
    # Header text may hold undecodable bytes as surrogates; they can never match a key.
    return token.strip().encode("utf-8", "surrogateescape") if token.strip().isprintable() else b""
