"""The app: the guards every request passes (Host, Origin, API key, draining), errors in
each API's own shape, and the routes (butter/server/routes/, one module per API)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from prometheus_client.registry import Collector
from quart import Response, current_app, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, MethodNotAllowed

from butter.engine.engine import Engine
from butter.errors import ButterError, Forbidden, Overloaded, RequestTooLarge, Unauthorized
from butter.protocol import ollama as ollama_wire
from butter.server import routes
from butter.server.holders import ModelHolder
from butter.server.metrics import Metrics
from butter.server.readiness import Readiness
from butter.server.routes.common import (
    EXTENSION,
    HttpLimits,
    Served,
    json_response,
    prepare,
    served,
)
from butter.server.routes.ollama import PREFIX as OLLAMA_PREFIX
from butter.server.routes.pages import is_page_file
from butter.server.routes.probes import OPEN_PATHS
from butter.server.vllm_metrics import VllmCollector

__all__ = ["HttpLimits", "create_app", "prepare"]

log = logging.getLogger("butter")


def create_app(holder: ModelHolder, limits: HttpLimits | None = None, *,
               collectors: Sequence[Collector] = (),
               readiness: Readiness | None = None) -> QuartTrio:
    """`collectors`: more /metrics, from outside the app (the server's connections).
    `readiness`: what /ready answers and whether new work is refused (the server drains
    through it)."""
    limits = limits or HttpLimits()
    metrics = Metrics(lambda: _engine_of(holder), lambda: holder.swaps)
    for collector in collectors:
        metrics.registry.register(collector)
    metrics.registry.register(VllmCollector(lambda: holder.resident))
    app = QuartTrio("butter")
    app.config["MAX_CONTENT_LENGTH"] = limits.max_body_bytes
    app.config["RESPONSE_TIMEOUT"] = None  # generation may take long; disconnects cancel it
    app.config["BODY_TIMEOUT"] = limits.body_timeout
    app.extensions[EXTENSION] = Served(holder=holder, limits=limits, metrics=metrics,
                                       readiness=readiness or Readiness(holder))
    for guard in (check_host_and_origin, check_api_key, refuse_new_work_while_draining):
        app.before_request(guard)
    app.after_request(allow_cross_origin_reads)
    app.after_request(count_request)
    app.register_error_handler(ButterError, handle_butter_error)
    app.register_error_handler(HTTPException, handle_http_error)
    app.register_error_handler(Exception, handle_unexpected)
    routes.register(app)
    return app


def _engine_of(holder: ModelHolder) -> Engine | None:
    resident = holder.resident
    return None if resident is None else resident.engine


# ---- guards, before any route runs

async def check_host_and_origin() -> Response | None:
    """A page on another site, or one reached through DNS rebinding, must not drive the
    server (butter/server/access.py)."""
    if request.path in OPEN_PATHS:
        return None
    access = served().limits.access
    host = request.headers.get("Host")
    if not access.host_allowed(host):
        raise Forbidden(f"this server does not answer to the host name {host!r}; allow "
                        "it with --allowed-hosts")
    origin = request.headers.get("Origin")
    if origin is None:  # not a cross-site browser request: curl, the SDKs, routers
        return None
    if not access.origin_allowed(origin, host):
        raise Forbidden(f"requests from the web origin {origin!r} are not allowed; allow "
                        "it with --cors-origins")
    if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
        return Response(status=204, headers=access.preflight_headers(
            origin, request.headers.get("Access-Control-Request-Headers"),
            request.headers.get("Access-Control-Request-Private-Network") == "true"))
    return None


async def check_api_key() -> None:
    api_keys = served().limits.api_keys
    if not api_keys.required or request.path in OPEN_PATHS or is_page_file():
        return
    bearer = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
    given = bearer or request.headers.get("x-api-key", "")
    if not api_keys.accepts(given):
        raise Unauthorized("a valid API key is required (Authorization: Bearer <key> or "
                           "x-api-key: <key>)")


async def refuse_new_work_while_draining() -> None:
    """Scale-out: once draining, new work gets 503 (docs/scale-out.md)."""
    if request.method == "POST":
        served().readiness.refuse_new_work()


# ---- after every response

async def allow_cross_origin_reads(response: Response) -> Response:
    origin = request.headers.get("Origin")
    access = served().limits.access
    if (origin is not None and "Access-Control-Allow-Origin" not in response.headers
            and access.origin_allowed(origin, request.headers.get("Host"))):
        response.headers.update(access.cors_headers(origin))
    return response


async def count_request(response: Response) -> Response:
    rule = request.url_rule.rule if request.url_rule is not None else "unmatched"
    served().metrics.requests.labels(route=rule, status=str(response.status_code)).inc()
    return response


# ---- errors, in the shape of the API that was called

def error_response(error: ButterError) -> Response:
    if request.path.startswith(OLLAMA_PREFIX + "/"):
        return json_response(ollama_wire.error_body(error.message), status=error.status,
                             headers=error.headers())
    if not request.path.removeprefix(routes.API_PREFIX).startswith("/messages"):
        return json_response(error.openai_body(), status=error.status,
                             headers=error.headers())
    # Anthropic says 529 overloaded_error where OpenAI clients expect 503.
    status = 529 if isinstance(error, Overloaded) else error.status
    return json_response(error.anthropic_body(), status=status, headers=error.headers())


async def handle_butter_error(error: ButterError) -> Response:
    return error_response(error)


async def handle_unexpected(error: Exception) -> Response:
    log.exception("unexpected error on %s %s", request.method, request.path)
    return error_response(ButterError(f"internal error: {type(error).__name__}"))


async def handle_http_error(error: HTTPException) -> Response:
    status = error.code or 500
    if status == 413:
        return error_response(RequestTooLarge(
            f"the request body exceeds {served().limits.max_body_bytes} bytes"))
    if request.url_rule is None and status in (404, 405):  # no route took the request
        return error_response(unrouted(error))
    wrapped = ButterError(error.description or error.name)
    wrapped.status = status
    wrapped.openai_type = "invalid_request_error" if status < 500 else "server_error"
    wrapped.anthropic_type = "not_found_error" if status == 404 else "invalid_request_error"
    return error_response(wrapped)


# ---- requests no route takes: a path butter does not serve, or a method a route does not

class UnknownRoute(ButterError):
    status = 404
    openai_type = "invalid_request_error"
    anthropic_type = "not_found_error"
    code = "unknown_route"


class WrongMethod(ButterError):
    status = 405
    openai_type = "invalid_request_error"
    anthropic_type = "invalid_request_error"
    code = "method_not_allowed"

    def __init__(self, message: str, *, allowed: Sequence[str]):
        super().__init__(message)
        self.allowed = allowed

    def headers(self) -> dict[str, str]:
        return {"Allow": ", ".join(self.allowed)}


# OpenAI's Responses API: out of scope by design (openai-agents calls it by default).
RESPONSES_PATHS = (f"{routes.API_PREFIX}/responses", "/responses")
NOT_RESPONSES = (
    "butter does not serve OpenAI's Responses API ({method} {path}), by design: use Chat "
    "Completions, POST /v1/chat/completions. In openai-agents, call "
    'set_default_openai_api("chat_completions") before running an agent (or give it an '
    "OpenAIChatCompletionsModel).")
# Methods every route answers by itself; a 405 names the others.
_IMPLIED_METHODS = ("HEAD", "OPTIONS")


def unrouted(error: HTTPException) -> ButterError:
    """The error for a request no route takes, in words that say what to call instead: a
    405 names the methods the route answers, the Responses API says how to use Chat
    Completions, and any other path gets the list of the routes butter serves."""
    method, path = request.method, request.path
    if isinstance(error, MethodNotAllowed):
        allowed = sorted(error.valid_methods or ())
        answers = [name for name in allowed if name not in _IMPLIED_METHODS]
        return WrongMethod(f"{method} {path}: this route answers {' and '.join(answers)}",
                           allowed=allowed)
    if any(path == prefix or path.startswith(prefix + "/") for prefix in RESPONSES_PATHS):
        return UnknownRoute(NOT_RESPONSES.format(method=method, path=path))
    return UnknownRoute(f"butter serves no {method} {path}. Its routes: "
                        f"{', '.join(served_routes())} (each /v1 route also answers "
                        "without /v1)")


def served_routes() -> list[str]:
    """`METHOD /path` for every route of the app: the /v1 spelling where a route has both,
    the APIs first (/v1, then Ollama's /api), then the probes and the chat page."""
    rules = [rule for rule in current_app.url_map.iter_rules()
             if rule.endpoint != "static" and "<" not in rule.rule]
    paths = {rule.rule for rule in rules}
    listed = [(rule.rule, method) for rule in rules
              if f"{routes.API_PREFIX}{rule.rule}" not in paths
              for method in sorted(rule.methods or ()) if method not in _IMPLIED_METHODS]

    def group(path: str) -> int:
        if path.startswith(routes.API_PREFIX + "/"):
            return 0
        return 1 if path.startswith(OLLAMA_PREFIX + "/") else 2

    return [f"{method} {path}" for path, method in sorted(
        listed, key=lambda listed_route: group(listed_route[0]))]
