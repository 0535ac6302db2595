"""The chat page at `/`: static files shipped in the package (butter/server/ui/), served
as they are. No build step, nothing fetched from elsewhere; the page calls the same API
as every client, under the same Host, Origin and API-key rules."""

from __future__ import annotations

from functools import cache
from importlib import resources

# The page's files, by the name the page asks for under /ui/: nothing else is served.
ASSETS = {"ui.js": "text/javascript", "ui.css": "text/css"}
# The page runs only its own files and talks only to this server; nothing may frame it.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                               "form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


@cache
def read(name: str) -> bytes:
    return resources.files("butter.server").joinpath("ui", name).read_bytes()


def page() -> bytes:
    return read("index.html")


def asset(name: str) -> tuple[bytes, str] | None:
    """(content, mimetype) of a page file, None for any other name."""
    mimetype = ASSETS.get(name)
    return None if mimetype is None else (read(name), mimetype)
