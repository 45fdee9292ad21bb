"""The chat page at `/`: static files (flare/server/static/) that stream answers from
/v1/chat/completions in the browser.

No build step and no external URL, so it works offline; every URL it calls is relative, so it
works behind a reverse proxy under any path. The files are read once, when the app is built.
The page itself holds no secret and is public (no API key needed to load it); its API requests
carry the key the user types, which the page keeps in sessionStorage only. A strict Content
Security Policy allows nothing but this origin's own scripts, styles and requests.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib.resources import files

from aiohttp import web

# URL path -> (file under static/, media type). Relative URLs in chat.html name these files.
_FILES = {
    "/": ("chat.html", "text/html; charset=utf-8"),
    "/chat.css": ("chat.css", "text/css; charset=utf-8"),
    "/chat.js": ("chat.js", "text/javascript; charset=utf-8"),
}
PAGE_PATHS = frozenset(_FILES)
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    # A new daemon version serves new files: the browser asks again each time (they are small).
    "Cache-Control": "no-cache",
}


@dataclass(frozen=True)
class _PageFile:
    body: bytes
    content_type: str

    async def handle(self, request: web.Request) -> web.Response:
        return web.Response(body=self.body, headers={**PAGE_HEADERS, "Content-Type": self.content_type})


def chat_page_handlers() -> dict[str, Callable[[web.Request], Awaitable[web.Response]]]:
    """URL path -> the GET handler of its file; the route table (routes.py) registers them."""
    static = files("flare.server") / "static"
    return {
        path: _PageFile((static / name).read_bytes(), content_type).handle
        for path, (name, content_type) in _FILES.items()
    }
