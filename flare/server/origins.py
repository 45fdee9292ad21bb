"""Which browsers and which Host names may use the API: against cross-site requests and DNS
rebinding.

A web page the user visits can send requests to a daemon on the user's machine (a `text/plain`
POST needs no CORS preflight), and a loopback daemon has no API key by default. Browsers say
where a request comes from (`Origin`, `Sec-Fetch-Site`), so a request from a page whose origin
the operator did not allow (`allowed_origins`, as Ollama's OLLAMA_ORIGINS) is refused. With DNS
rebinding, an attacker's name resolves to 127.0.0.1 and the page's requests look same-origin to
the browser; they still carry the attacker's name in `Host`, so a daemon bound to loopback
answers only Host names that are loopback (or listed in `allowed_hosts`). Clients that are not
browsers (curl, the SDKs) send neither header and are not affected.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

# Sec-Fetch-Site values of requests a browser makes on a page's behalf for another site.
_CROSS_SITE = frozenset({"cross-site", "same-site"})


def browser_origin_refused(
    origin: str | None, fetch_site: str | None, allowed: Sequence[str], *, host: str | None = None
) -> str | None:
    """Why a browser-originated request is refused, or None when it is not (no browser said
    anything, the user navigated there themselves, the origin is allowed, or it is a page this
    daemon served: same-origin, its Origin naming `host`, the request's Host header)."""
    if origin is not None:
        if origin_allowed(origin, allowed) or same_origin(origin, fetch_site, host):
            return None
        return f"requests from the web origin {origin!r} are not allowed; the operator can allow it with --allowed-origins"
    if fetch_site is not None and fetch_site.strip().lower() in _CROSS_SITE:
        return "cross-site requests from a web page are not allowed; the operator can allow origins with --allowed-origins"
    return None


def origin_allowed(origin: str, allowed: Sequence[str]) -> bool:
    """`origin` matches an entry: `*`, an exact origin (`https://app.example`), or one with any
    port (`http://localhost:*`). Scheme and host compare case-insensitively."""
    origin = origin.strip().rstrip("/").lower()
    for entry in allowed:
        entry = entry.strip().rstrip("/").lower()
        if entry == "*" or entry == origin:
            return True
        if entry.endswith(":*"):
            base = entry[:-2]
            host, _, port = origin.rpartition(":")
            if (host == base and port.isdigit()) or origin == base:
                return True
    return False


def same_origin(origin: str, fetch_site: str | None, host: str | None) -> bool:
    """A request from a page of this server: the browser does not call it cross-site, and the
    Origin's host and port are the Host the request was sent to. (With DNS rebinding both name
    the attacker's host: loopback_host_refused refuses that Host on a loopback daemon, and a
    daemon reachable beyond loopback needs API keys anyway.)"""
    if host is None or (fetch_site is not None and fetch_site.strip().lower() != "same-origin"):
        return False
    scheme, separator, authority = origin.strip().lower().partition("://")
    if not separator or scheme not in _DEFAULT_PORTS:
        return False
    return _without_default_port(authority, scheme) == _without_default_port(host.strip().lower(), scheme)


_DEFAULT_PORTS = {"http": ":80", "https": ":443"}


def _without_default_port(authority: str, scheme: str) -> str:
    return authority.removesuffix(_DEFAULT_PORTS[scheme])


def loopback_host_refused(host_header: str | None, allowed_hosts: Sequence[str]) -> str | None:
    """Why a request to a loopback-bound daemon names a Host that is not loopback (DNS
    rebinding), or None. No Host header (HTTP/1.0) is accepted."""
    if host_header is None or not host_header.strip():
        return None
    name = _host_name(host_header.strip())
    if _is_loopback_name(name):
        return None
    if any(entry.strip() == "*" or entry.strip().lower() == name for entry in allowed_hosts):
        return None
    return (
        f"the Host {host_header[:100]!r} is not a name of this loopback address; "
        "use localhost or 127.0.0.1, or the operator can allow the name with --allowed-hosts"
    )


def _host_name(host: str) -> str:
    host = host.lower()
    if host.startswith("["):  # [::1]:8000
        return host[1 : host.find("]")] if "]" in host else host
    name, colon, port = host.rpartition(":")
    return name if colon and port.isdigit() else host


def _is_loopback_name(name: str) -> bool:
    if name == "localhost" or name.endswith(".localhost"):  # RFC 6761: always loopback
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
