"""Whose prefix-cache blocks a request may find: its API key's, narrowed by its `cache_salt`.

A cache hit answers faster and says so (`usage.prompt_tokens_details.cached_tokens`), so a
client that can hit another client's blocks can confirm guesses about that client's prompt one
block at a time. So, with API keys configured, the key (through a digest of it, never the key
itself) enters the root of the hash chain (engine/prefix_cache.py `scoped_root`): blocks
computed under one key are found only by requests of the same key. Without keys every request
is one client and all share, as an operator can choose with `prefix_cache_across_keys` (a shared
system prompt computed once for every key, at the cost above). A request's own `cache_salt`
(vLLM's name for it) narrows its scope further, to requests that send the same salt.

Scoping changes which blocks are found, never what is computed: an answer is the same hit or miss.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from flare.api.errors import bad_request

CACHE_SALT_FIELD = "cache_salt"
# A salt longer than this adds nothing a 256-bit secret does not; the bound keeps a body's
# megabyte out of the hash.
MAX_CACHE_SALT_CHARS = 1024
_DIGEST_BYTES = 16
# Separates the parts hashed, so ("ab", "c") and ("a", "bc") never give one scope.
_SEPARATOR = b"\x1f"


def cache_salt(body: Mapping[str, Any]) -> str | None:
    """The request's `cache_salt`: a non-empty string of at most MAX_CACHE_SALT_CHARS
    characters, or None when it is absent or null; a 400 naming the field otherwise."""
    salt = body.get(CACHE_SALT_FIELD)
    if salt is None:
        return None
    if not isinstance(salt, str):
        raise bad_request(
            f"cache_salt must be a string, got {type(salt).__name__}", param=CACHE_SALT_FIELD, code="invalid_type"
        )
    if not salt or len(salt) > MAX_CACHE_SALT_CHARS:
        raise bad_request(
            f"cache_salt must be 1 to {MAX_CACHE_SALT_CHARS} characters long, got {len(salt)}",
            param=CACHE_SALT_FIELD,
            code="invalid_value",
        )
    return salt


def prefix_cache_scope(*, api_key: bytes, across_keys: bool, salt: str | None) -> bytes:
    """The scope a request's blocks are published and found in: empty (shared by every
    request) when no key separates it and it sends no salt. `api_key` is the key the request
    was admitted with (empty where no keys are configured)."""
    parts: list[bytes] = []
    if api_key and not across_keys:
        # A digest, so the key itself is kept nowhere but in the settings.
        key = hashlib.blake2b(api_key, digest_size=_DIGEST_BYTES, person=b"flare-cache-key")
        parts.append(b"key=" + key.digest())
    if salt is not None:
        parts.append(b"salt=" + salt.encode("utf-8", "surrogatepass"))
    if not parts:
        return b""
    return hashlib.blake2b(_SEPARATOR.join(parts), digest_size=_DIGEST_BYTES).digest()
