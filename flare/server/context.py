"""What every handler reads from the app and the request: the settings (swapped in place on a
reload), the serving state, the worker-thread limiters, the request's id and API key."""

from __future__ import annotations

from typing import Protocol

import anyio
from aiohttp import web

from flare.api.responses.store import ResponseStore
from flare.server.auth import ApiKeys
from flare.server.state import ServingState


class ServerConfig(Protocol):
    """The settings the HTTP server reads, named here so that the server imports nothing of the
    daemon above it; the daemon's config (daemon/config.py) has them all."""

    @property
    def api_keys(self) -> tuple[str, ...]: ...

    @property
    def max_body_bytes(self) -> int: ...

    @property
    def metrics_require_key(self) -> bool: ...

    @property
    def allowed_origins(self) -> tuple[str, ...]: ...

    @property
    def allowed_hosts(self) -> tuple[str, ...]: ...

    @property
    def prefix_cache_across_keys(self) -> bool: ...

    @property
    def request_timeout_s(self) -> float | None: ...

    @property
    def stream_keepalive_s(self) -> float: ...

    @property
    def fault_injection(self) -> bool: ...

    @property
    def allow_special_tokens_in_messages(self) -> bool: ...


class ApiSettings:
    """The settings requests read as they arrive; a reload (SIGHUP) swaps them in place."""

    def __init__(self, config: ServerConfig) -> None:
        self.update(config)

    def update(self, config: ServerConfig) -> None:
        self.config = config
        self.keys = ApiKeys(config.api_keys)


SETTINGS = web.AppKey("settings", ApiSettings)
STATE = web.AppKey("state", ServingState)
# Tokenizing runs in worker threads with the GIL released; at most this many at once, so a
# flood of long prompts queues here instead of holding a thread (and its text) each.
TOKENIZING = web.AppKey("tokenizing", anyio.CapacityLimiter)
# Grammars compile in worker threads too (llguidance drops the GIL), a few at once, so a flood of
# new schemas queues here and never holds the tokenizer's threads or the event loop.
COMPILING = web.AppKey("compiling", anyio.CapacityLimiter)
# The stored Responses (`store: true`); absent when the operator turned the store off.
RESPONSE_STORE = web.AppKey("response_store", ResponseStore)
REQUEST_ID = web.RequestKey("request_id", str)
# The API key a request was admitted with (empty without keys): its prefix-cache scope.
API_KEY = web.RequestKey("api_key", bytes)
