"""Browser origins and loopback Host names: what is refused and what passes."""

from __future__ import annotations

import pytest

from flare.server.origins import browser_origin_refused, loopback_host_refused, origin_allowed


@pytest.mark.parametrize(
    ("origin", "allowed", "expected"),
    [
        ("https://app.example", ["https://app.example"], True),
        ("HTTPS://App.Example/", ["https://app.example"], True),
        ("https://evil.example", ["https://app.example"], False),
        ("http://localhost:5173", ["http://localhost:*"], True),
        ("http://localhost", ["http://localhost:*"], True),
        ("http://localhost.evil.example:80", ["http://localhost:*"], False),
        ("null", ["https://app.example"], False),
        ("null", ["*"], True),
        ("https://anything.example", [], False),
    ],
)
def test_origin_patterns(origin: str, allowed: list[str], expected: bool) -> None:
    assert origin_allowed(origin, allowed) is expected


def test_requests_without_browser_headers_are_never_refused() -> None:
    assert browser_origin_refused(None, None, []) is None
    assert browser_origin_refused(None, "none", []) is None  # typed into the address bar
    assert browser_origin_refused(None, "same-origin", []) is None


def test_cross_site_requests_are_refused_naming_the_option() -> None:
    refused = browser_origin_refused("https://evil.example", "cross-site", [])
    assert refused is not None and "--allowed-origins" in refused
    assert browser_origin_refused(None, "cross-site", []) is not None
    assert browser_origin_refused("https://app.example", "cross-site", ["https://app.example"]) is None


@pytest.mark.parametrize(
    "host", ["localhost", "localhost:8000", "127.0.0.1:8000", "127.1.2.3", "[::1]:8000", "[::1]", "app.localhost:80", None]
)
def test_loopback_names_pass_the_host_check(host: str | None) -> None:
    assert loopback_host_refused(host, []) is None


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "10.0.0.1:8000", "localhost.evil.example"])
def test_other_names_fail_the_host_check_unless_allowed(host: str) -> None:
    refused = loopback_host_refused(host, [])
    assert refused is not None and "--allowed-hosts" in refused
    assert loopback_host_refused(host, [host.split(":")[0]]) is None
    assert loopback_host_refused(host, ["*"]) is None


def test_the_daemons_own_page_is_same_origin_and_allowed() -> None:
    # The chat page at / posts to the API: same-origin, its Origin naming the Host it was sent to.
    assert browser_origin_refused("http://127.0.0.1:8000", "same-origin", [], host="127.0.0.1:8000") is None
    assert browser_origin_refused("https://chat.example", "same-origin", [], host="chat.example:443") is None
    assert browser_origin_refused("http://localhost:8000", None, [], host="LOCALHOST:8000") is None


@pytest.mark.parametrize(
    ("origin", "fetch_site", "host"),
    [
        ("http://127.0.0.1:9999", "same-origin", "127.0.0.1:8000"),  # another port is another origin
        ("http://127.0.0.1:8000", "cross-site", "127.0.0.1:8000"),  # the browser knows better
        ("http://127.0.0.1:8000", "same-site", "127.0.0.1:8000"),
        ("https://evil.example", "same-origin", None),
        ("null", "same-origin", "127.0.0.1:8000"),
    ],
)
def test_an_origin_that_is_not_the_hosts_own_is_still_refused(origin: str, fetch_site: str, host: str | None) -> None:
    assert browser_origin_refused(origin, fetch_site, [], host=host) is not None
