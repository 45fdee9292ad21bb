"""Whose prefix-cache blocks a request shares (flare/api/cache_scope.py)."""

from __future__ import annotations

import pytest

from flare.api.cache_scope import MAX_CACHE_SALT_CHARS, cache_salt, prefix_cache_scope
from flare.api.errors import ApiError
from flare.engine.prefix_cache import chain_hashes, namespace_hash, scoped_root
from flare.server.auth import ApiKeys


def _scope(authorization: str | None, salt: str | None = None, *, keys: bool = True, across: bool = False) -> bytes:
    api_key = ApiKeys(["sk-a", "sk-b"] if keys else []).accepted_key(authorization, None)
    return prefix_cache_scope(api_key=api_key, across_keys=across, salt=salt)


def test_without_keys_or_salt_every_request_shares_the_unscoped_chain() -> None:
    assert _scope(None, keys=False) == b""
    assert _scope("Bearer a", across=True) == b""
    root = namespace_hash("weights")
    assert scoped_root(root, b"") == root


def test_each_key_and_each_salt_is_a_scope_of_its_own_and_the_key_is_not_in_it() -> None:
    scopes = {_scope("Bearer sk-a"), _scope("Bearer sk-b"), _scope("Bearer sk-a", "s"), _scope("Bearer sk-a", "t")}
    assert len(scopes) == 4 and b"" not in scopes
    assert _scope("Bearer sk-a") == _scope("bearer  sk-a ")
    assert all(b"sk-a" not in scope for scope in scopes)
    assert _scope(None, "s", keys=False) != b""  # a salt narrows even without keys


def test_chains_of_two_scopes_share_no_block_hash() -> None:
    root = namespace_hash("weights")
    tokens = list(range(64))
    a = chain_hashes(scoped_root(root, _scope("Bearer sk-a")), tokens, 16)
    b = chain_hashes(scoped_root(root, _scope("Bearer sk-b")), tokens, 16)
    assert not set(a) & set(b)


@pytest.mark.parametrize("salt", [17, "", "x" * (MAX_CACHE_SALT_CHARS + 1), ["s"]])
def test_a_malformed_cache_salt_is_a_400_naming_it(salt: object) -> None:
    with pytest.raises(ApiError) as raised:
        cache_salt({"cache_salt": salt})
    assert raised.value.status == 400 and raised.value.param == "cache_salt"


def test_an_absent_or_null_cache_salt_is_none() -> None:
    assert cache_salt({}) is None and cache_salt({"cache_salt": None}) is None
    assert cache_salt({"cache_salt": "tenant-7"}) == "tenant-7"
