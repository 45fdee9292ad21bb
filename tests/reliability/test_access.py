"""Access, end to end: API keys (near misses refused with OpenAI's 401 body), /health public,
/metrics behind the key only when asked, the warning for a daemon listening beyond loopback without
keys, and hostile request fields that never forge or break a log line."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from tests.reliability.reliability_daemon import Daemon, is_error_body, report

KEY = "sk-reliability-0123456789"


@pytest.fixture(scope="module")
def keyed(tiny_package: Path, daemon_factory: Callable[..., Daemon]) -> Daemon:
    # Listening on every address, with keys and --metrics-require-key.
    return daemon_factory(tiny_package, ["--host", "0.0.0.0", "--api-key", KEY, "--metrics-require-key"])


def test_only_the_exact_key_opens_the_api(keyed: Daemon) -> None:
    near_misses = [None, "", "Bearer", f"Bearer {KEY[:-1]}", f"Bearer {KEY}x", f"Bearer {KEY.upper()}",
                   f"Basic {KEY}", f"{KEY}", f"Bearer  {KEY[1:]}", "Bearer \u00e9"]
    refused = 0
    for authorization in near_misses:
        headers = {} if authorization is None else {"Authorization": authorization.encode("utf-8")}
        response = httpx.get(f"{keyed.url}/v1/models", headers=headers, timeout=30)
        assert response.status_code == 401, authorization
        assert is_error_body(response.json()) and response.json()["error"]["code"] == "invalid_api_key"
        assert response.headers["WWW-Authenticate"] == "Bearer"
        refused += 1
    assert httpx.get(f"{keyed.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).status_code == 200
    assert httpx.get(f"{keyed.url}/health", timeout=30).status_code == 200  # public
    assert httpx.get(f"{keyed.url}/metrics", timeout=30).status_code == 401  # --metrics-require-key
    assert httpx.get(f"{keyed.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).status_code == 200
    assert not keyed.process.events("listening_without_api_keys")
    report("access", near_miss_keys_refused=refused, listening=keyed.process.events("listening")[0]["host"])


def test_listening_beyond_loopback_without_keys_warns_and_loopback_does_not(
    tiny_package: Path, daemon_factory: Callable[..., Daemon]
) -> None:
    exposed = daemon_factory(tiny_package, ["--host", "0.0.0.0"])
    [warning] = exposed.process.events("listening_without_api_keys")
    assert warning["host"] == "0.0.0.0" and "--api-key" in warning["message"]
    assert httpx.get(f"{exposed.url}/metrics", timeout=30).status_code == 200  # public by default
    loopback = daemon_factory(tiny_package)
    assert loopback.process.events("listening")[0]["host"] == "127.0.0.1"  # the default
    assert not loopback.process.events("listening_without_api_keys")


def test_hostile_fields_never_forge_or_split_a_log_line(keyed: Daemon) -> None:
    forged = '\n{"event": "forged", "level": "critical"}\n'
    request_id = "ok\u00e9" + "a" * 200
    headers = {"Authorization": f"Bearer {KEY}".encode(), "X-Request-Id": request_id.encode("latin-1")}
    bodies = [
        {"model": "m" + forged, "prompt": "hi"},
        {"model": keyed.model, "prompt": "hi" + forged, "max_tokens": 2, "stop": [forged]},
        {"model": keyed.model, "messages": [{"role": "user" + forged, "content": "x"}]},
        {"model": keyed.model, "prompt": "hi", forged: 1},
    ]
    for body in bodies:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        response = httpx.post(f"{keyed.url}{path}", json=body, headers=headers, timeout=60)
        assert response.status_code in (200, 400, 404), response.text
        assert response.headers["X-Request-Id"] != request_id  # not echoed: not plain
    # Every line of the log is one JSON object, and none was forged.
    for line in keyed.process.lines:
        event = json.loads(line)
        assert event.get("event") != "forged", line
