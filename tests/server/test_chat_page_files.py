"""The chat page's files as the daemon serves them: public, with a strict Content Security
Policy, only relative URLs, and its API requests accepted from the page's own origin."""

from __future__ import annotations

import re

from aiohttp.test_utils import TestClient, TestServer

from flare.daemon.config import DaemonConfig
from flare.server.chat_page import PAGE_PATHS
from flare.server.metrics import DaemonMetrics
from flare.server.routes import create_app
from flare.server.state import ServingState


async def serve(**config: object) -> TestClient:
    client = TestClient(TestServer(create_app(DaemonConfig(**config), ServingState(), DaemonMetrics.create())))
    await client.start_server()
    return client


async def test_the_page_and_its_files_are_served_without_a_key_under_a_strict_policy() -> None:
    client = await serve(api_keys=("sk-secret",))
    try:
        for path, kind in (("/", "text/html"), ("/chat.css", "text/css"), ("/chat.js", "text/javascript")):
            response = await client.get(path)
            assert response.status == 200, path
            assert response.headers["Content-Type"].startswith(kind)
            policy = response.headers["Content-Security-Policy"]
            assert "default-src 'none'" in policy and "connect-src 'self'" in policy and "script-src 'self'" in policy
            assert response.headers["X-Content-Type-Options"] == "nosniff"
        # The API itself still needs the key.
        assert (await client.get("/v1/models")).status == 401
    finally:
        await client.close()


async def test_the_page_uses_only_relative_urls() -> None:
    client = await serve()
    try:
        for path in PAGE_PATHS:
            text = await (await client.get(path)).text()
            assert not re.search(r"https?://|//[a-z]", text, re.IGNORECASE), f"{path} names an absolute URL"
            assert not re.search(r"""(fetch\(|href=|src=)["']/""", text), f"{path} names a root-relative URL"
    finally:
        await client.close()


async def test_the_pages_own_requests_pass_the_origin_check_and_other_sites_do_not() -> None:
    client = await serve()
    try:
        host = f"{client.server.host}:{client.server.port}"
        own = {"Origin": f"http://{host}", "Sec-Fetch-Site": "same-origin"}
        # 503 (no model loaded in this app) means the origin check let it through.
        assert (await client.get("/v1/models", headers=own)).status == 503
        other = {"Origin": "https://evil.example", "Sec-Fetch-Site": "cross-site"}
        response = await client.get("/v1/models", headers=other)
        assert response.status == 403
        assert (await response.json())["error"]["code"] == "origin_not_allowed"
    finally:
        await client.close()
