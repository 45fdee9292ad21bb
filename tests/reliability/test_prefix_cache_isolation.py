"""One API key must not learn another's prompts through the prefix cache (issue 29, item 3).

A cache hit is visible (`usage.prompt_tokens_details.cached_tokens`, and a faster first token),
so a key that could hit another key's blocks could confirm guesses about its prompt one
16-token block at a time. These tests run the real daemon with several keys: the second key's
full copy of the first key's prompt, and its guesses at every block-aligned prefix, find
nothing cached, while the first key's own repeat and own prefixes still hit; `cache_salt`
narrows a key's scope further; `--prefix-cache-across-keys on` shares again."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from tests.reliability.reliability_daemon import Daemon, is_error_body, report

KEYS = ["sk-tenant-a", "sk-tenant-b", "sk-probe-1", "sk-probe-2", "sk-probe-3", "sk-probe-4"]
# Words the tokenizer splits one token each, so a cut at a word is a cut at a token and the
# secret spans several 16-token blocks.
SECRET = " ".join(f"alpha{i} bravo{i}" for i in range(40))


def _flags(*extra: str) -> list[str]:
    return [flag for key in KEYS for flag in ("--api-key", key)] + list(extra)


def _complete(daemon: Daemon, key: str, prompt: str, **fields: Any) -> httpx.Response:
    return httpx.post(
        f"{daemon.url}/v1/completions",
        json={"model": daemon.model, "prompt": prompt, "max_tokens": 4, "temperature": 0, **fields},
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )


def _cached(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _prefixes(words: int) -> list[str]:
    """Cuts of SECRET at every 8 words (prefixes that span one, two, ... blocks)."""
    split = SECRET.split(" ")
    return [" ".join(split[:end]) for end in range(8, words, 8)]


def test_a_second_key_finds_none_of_the_first_keys_prompt_while_the_first_keys_repeat_hits(
    tiny_package: Path, daemon_factory: Callable[..., Daemon]
) -> None:
    daemon = daemon_factory(tiny_package, _flags())
    tenant_a, tenant_b, *probes = KEYS
    first = _complete(daemon, tenant_a, SECRET)
    cold = _cached(first)
    repeat = _complete(daemon, tenant_a, SECRET)
    # The first key's own repeat hits, and answers the same.
    warm = _cached(repeat)
    assert cold == 0 and warm > 0
    assert repeat.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]

    # The second key's copy of the whole prompt finds nothing, and answers the same.
    stolen = _complete(daemon, tenant_b, SECRET)
    assert _cached(stolen) == 0
    assert stolen.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]

    # Guesses block by block, each from a key that has sent nothing else: none is confirmed.
    guesses = _prefixes(len(SECRET.split(" ")))[: len(probes)]
    probed = [_cached(_complete(daemon, key, guess)) for key, guess in zip(probes, guesses, strict=True)]
    # The same prefixes from the first key do hit: a probe that works within a key, found nothing across keys.
    own = [_cached(_complete(daemon, tenant_a, guess)) for guess in guesses]
    report("prefix_cache_isolation", a_cold=cold, a_warm=warm, b_whole=0, b_guesses=probed, a_guesses=own)
    assert probed == [0] * len(guesses)
    assert all(hit > 0 for hit in own) and own == sorted(own)


def test_cache_salt_narrows_a_keys_scope_and_a_malformed_salt_is_a_400_naming_it(
    tiny_package: Path, daemon_factory: Callable[..., Daemon]
) -> None:
    daemon = daemon_factory(tiny_package, _flags())
    tenant_a = KEYS[0]
    prompt = SECRET + " salted"
    assert _cached(_complete(daemon, tenant_a, prompt)) == 0
    assert _cached(_complete(daemon, tenant_a, prompt, cache_salt="user-17")) == 0  # another scope
    assert _cached(_complete(daemon, tenant_a, prompt, cache_salt="user-17")) > 0  # its own scope
    assert _cached(_complete(daemon, tenant_a, prompt, cache_salt="user-18")) == 0
    for salt, why in ((17, "must be a string"), ("", "1 to 1024 characters"), ("s" * 1025, "1 to 1024 characters")):
        refused = _complete(daemon, tenant_a, prompt, cache_salt=salt)
        assert refused.status_code == 400 and is_error_body(refused.json()), refused.text
        assert refused.json()["error"]["param"] == "cache_salt" and why in refused.json()["error"]["message"]
    chat = httpx.post(
        f"{daemon.url}/v1/chat/completions",
        json={"model": daemon.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "cache_salt": "x"},
        headers={"Authorization": f"Bearer {tenant_a}"},
        timeout=120,
    )
    assert chat.status_code == 200, chat.text


def test_sharing_across_keys_is_the_operators_choice(tiny_package: Path, daemon_factory: Callable[..., Daemon]) -> None:
    daemon = daemon_factory(tiny_package, _flags("--prefix-cache-across-keys", "on"))
    tenant_a, tenant_b = KEYS[:2]
    prompt = SECRET + " shared system prompt"
    assert _cached(_complete(daemon, tenant_a, prompt)) == 0
    assert _cached(_complete(daemon, tenant_b, prompt)) > 0
