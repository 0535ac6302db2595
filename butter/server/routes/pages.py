"""The chat page at `/` and its files (butter/server/ui.py)."""

from __future__ import annotations

from quart import Blueprint, Response, request
from werkzeug.exceptions import NotFound

from butter.server import ui
from butter.server.routes.common import served
from butter.version import __version__

routes = Blueprint("pages", __name__)


def is_page_file() -> bool:
    """The chat page's static files: the same for every install, no data in them."""
    return request.method in ("GET", "HEAD") and (
        request.path == "/" or request.path.startswith("/ui/"))


@routes.get("/")
async def root() -> Response:
    """The chat page for browsers. API clients probe the base URL before their first
    request (Claude Code sends HEAD; Quart answers HEAD from the GET route) and get a line
    of text, as they always have."""
    wants_page = request.accept_mimetypes.best_match(["text/plain", "text/html"])
    if served().limits.ui and wants_page == "text/html":
        return Response(ui.page(), mimetype="text/html", headers=ui.PAGE_HEADERS)
    return Response(f"butter {__version__}", mimetype="text/plain")


@routes.get("/ui/<name>")
async def ui_file(name: str) -> Response:
    found = ui.asset(name) if served().limits.ui else None
    if found is None:
        raise NotFound()
    content, mimetype = found
    return Response(content, mimetype=mimetype, headers=ui.PAGE_HEADERS)
