"""Routes. Thin on purpose: parse, delegate, render; errors in each API's own shape."""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs
import trio
from prometheus_client.registry import Collector
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, NotFound

from butter.chat.request import GenerationRequest
from butter.engine.engine import Engine, Generation
from butter.errors import (
    ButterError,
    Forbidden,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    RequestTooLarge,
    Unauthorized,
)
from butter.pipeline import prepare as preparing
from butter.pipeline.prepare import PreparedGeneration
from butter.pipeline.resident import ResidentModel
from butter.pipeline.run import RequestObserver
from butter.protocol import anthropic, openai
from butter.protocol import completions as completions_wire
from butter.protocol import ollama as ollama_wire
from butter.protocol import tokenizer as tokenizer_wire
from butter.server import chat_completions, completions, messages, ollama, ui
from butter.server.access import AccessPolicy, ApiKeys
from butter.server.backends import ServeBackend
from butter.server.metrics import Metrics
from butter.server.readiness import LIVE_PATH, READY_PATH, Readiness, current_load
from butter.server.vllm_metrics import VllmCollector
from butter.settings import (
    DEFAULT_BODY_TIMEOUT_SECONDS,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_MESSAGES,
)
from butter.version import __version__

log = logging.getLogger("butter")
request_log = logging.getLogger("butter.requests")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
API_PREFIX = "/v1"
OLLAMA_PREFIX = "/api/"  # Ollama's native API (butter/protocol/ollama.py)
RouteHandler = Callable[[], Awaitable[Response]]


@attrs.frozen
class HttpLimits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_messages: int = DEFAULT_MAX_MESSAGES
    body_timeout: float = DEFAULT_BODY_TIMEOUT_SECONDS
    stream_flush: float = 0.0
    api_keys: ApiKeys = attrs.field(factory=ApiKeys)  # none: no key needed
    access: AccessPolicy = attrs.field(factory=AccessPolicy)  # Host and Origin rules
    ui: bool = True  # the chat page at / for browsers (butter/server/ui.py)


async def prepare(resident: ResidentModel, request: GenerationRequest) -> PreparedGeneration:
    """Render, tokenize and check a request on a worker thread: long prompts, big tool
    schemas and grammar compilation would otherwise stall every stream on the event loop."""
    return await trio.to_thread.run_sync(preparing.prepare, resident, request)


def create_app(backend: ServeBackend, limits: HttpLimits | None = None, *,
               collectors: Sequence[Collector] = (),
               readiness: Readiness | None = None) -> QuartTrio:
    """`collectors`: more /metrics, from outside the app (the server's connections).
    `readiness`: what /ready answers and whether new work is refused (the server drains
    through it)."""
    limits = limits or HttpLimits()
    readiness = readiness or Readiness(backend)
    max_body_bytes = limits.max_body_bytes
    stream_flush = limits.stream_flush
    metrics = Metrics(lambda: _engine_of(backend), lambda: backend.swaps)
    for collector in collectors:
        metrics.registry.register(collector)
    metrics.registry.register(VllmCollector(lambda: backend.resident))
    app = QuartTrio("butter")
    app.config["MAX_CONTENT_LENGTH"] = max_body_bytes
    app.config["RESPONSE_TIMEOUT"] = None  # generation may take long; disconnects cancel it
    app.config["BODY_TIMEOUT"] = limits.body_timeout

    def is_anthropic() -> bool:
        return request.path.removeprefix(API_PREFIX).startswith("/messages")

    def api(method: str, path: str) -> Callable[[RouteHandler], RouteHandler]:
        """Serve `path` under /v1 and without it: clients configured with the bare server
        URL call /chat/completions (llama-server answers both spellings too)."""
        def register(handler: RouteHandler) -> RouteHandler:
            app.route(API_PREFIX + path, methods=[method])(handler)
            return app.route(path, methods=[method])(handler)

        return register

    def error_response(error: ButterError) -> Response:
        if request.path.startswith(OLLAMA_PREFIX):
            return _json(ollama_wire.error_body(error.message), status=error.status,
                         headers=error.headers())
        if not is_anthropic():
            return _json(error.openai_body(), status=error.status, headers=error.headers())
        # Anthropic says 529 overloaded_error where OpenAI clients expect 503.
        status = 529 if isinstance(error, Overloaded) else error.status
        return _json(error.anthropic_body(), status=status, headers=error.headers())

    @app.errorhandler(ButterError)
    async def handle_butter_error(error: ButterError) -> Response:
        return error_response(error)

    @app.errorhandler(Exception)
    async def handle_unexpected(error: Exception) -> Response:
        log.exception("unexpected error on %s %s", request.method, request.path)
        return error_response(ButterError(f"internal error: {type(error).__name__}"))

    access = limits.access
    api_keys = limits.api_keys
    probes = (LIVE_PATH, READY_PATH)  # open to every caller: load balancers, kubelets

    @app.before_request
    async def check_host_and_origin() -> Response | None:
        """Before anything runs: a page on another site, or one reached through DNS
        rebinding, must not drive the server (butter/server/access.py)."""
        if request.path in probes:
            return None
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

    @app.after_request
    async def allow_cross_origin_reads(response: Response) -> Response:
        origin = request.headers.get("Origin")
        if (origin is not None and "Access-Control-Allow-Origin" not in response.headers
                and access.origin_allowed(origin, request.headers.get("Host"))):
            response.headers.update(access.cors_headers(origin))
        return response

    def is_page_file() -> bool:
        """The chat page's static files: the same for every install, no data in them."""
        return request.method in ("GET", "HEAD") and (
            request.path == "/" or request.path.startswith("/ui/"))

    @app.before_request
    async def check_api_key() -> None:
        if not api_keys.required or request.path in probes or is_page_file():
            return
        bearer = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        given = bearer or request.headers.get("x-api-key", "")
        if not api_keys.accepts(given):
            raise Unauthorized("a valid API key is required (Authorization: Bearer <key> or "
                               "x-api-key: <key>)")

    @app.after_request
    async def count_request(response: Response) -> Response:
        rule = request.url_rule.rule if request.url_rule is not None else "unmatched"
        metrics.requests.labels(route=rule, status=str(response.status_code)).inc()
        return response

    def observer(route: str) -> RequestObserver:
        return RequestObserver(route=route, on_finish=_finish(metrics))

    def check_messages(count: int) -> None:
        if count > limits.max_messages:
            raise InvalidRequest(f"{count} messages exceed the limit of {limits.max_messages}",
                                 param="messages")

    @app.errorhandler(HTTPException)
    async def handle_http_error(error: HTTPException) -> Response:
        status = error.code or 500
        if status == 413:
            return error_response(
                RequestTooLarge(f"the request body exceeds {max_body_bytes} bytes")
            )
        wrapped = ButterError(error.description or error.name)
        wrapped.status = status
        wrapped.openai_type = "invalid_request_error" if status < 500 else "server_error"
        wrapped.anthropic_type = "not_found_error" if status == 404 else "invalid_request_error"
        return error_response(wrapped)

    @app.get(LIVE_PATH)
    async def health() -> Response:
        return Response("ok", mimetype="text/plain")

    # ---- scale-out: readiness, drain and load, for routers (docs/scale-out.md)

    @app.before_request
    async def refuse_new_work_while_draining() -> None:
        if request.method == "POST":
            readiness.refuse_new_work()

    @app.get(READY_PATH)
    async def ready() -> Response:
        state = readiness.state()
        return _json(state.body(), status=200 if state.ready else 503)

    @app.get("/get_load")
    async def get_load() -> Response:
        """vllm-router's power_of_two polls this for each replica's load."""
        return _json({"load": current_load(backend)})

    @app.get("/")
    async def root() -> Response:
        """The chat page for browsers. API clients probe the base URL before their first
        request (Claude Code sends HEAD; Quart answers HEAD from the GET route) and get a
        line of text, as they always have."""
        wants_page = request.accept_mimetypes.best_match(["text/plain", "text/html"])
        if limits.ui and wants_page == "text/html":
            return Response(ui.page(), mimetype="text/html", headers=ui.PAGE_HEADERS)
        return Response(f"butter {__version__}", mimetype="text/plain")

    @app.get("/ui/<name>")
    async def ui_file(name: str) -> Response:
        found = ui.asset(name) if limits.ui else None
        if found is None:
            raise NotFound()
        content, mimetype = found
        return Response(content, mimetype=mimetype, headers=ui.PAGE_HEADERS)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), mimetype="text/plain; version=0.0.4")

    @api("GET", "/models")
    async def list_models() -> Response:
        # During a swap this waits for it, in line with the requests (never starts one).
        resident = await backend.resident_for(None)
        others = [_unloaded_card(model_id) for model_id in backend.swappable()]
        return _json({"object": "list", "data": [_model_card(resident), *others]})

    @api("GET", "/server")
    async def server_info() -> Response:
        # Answers at once, a swap or not: between its unload and load no model is resident.
        resident = backend.resident
        return _json({
            "version": __version__,
            "model": _model_card(resident) if resident else None,
            "engine": attrs.asdict(resident.engine.stats()) if resident else None,
            "prefix_cache": resident.prefix_cache_info() if resident else None,
            "speculation": resident.speculation_info() if resident else None,
            "swapping": backend.swapping,
            "swaps": backend.swaps,
            "allow_swap": backend.allow_swap,
        })

    @api("POST", "/chat/completions")
    async def chat() -> Response:
        chat_request = openai.parse_chat_request(await _json_body())
        check_messages(len(chat_request.messages))
        generation = openai.generation_request(chat_request)
        resident = await backend.resident_for(chat_request.model)
        prepared = await prepare(resident, generation)
        watch = observer("/v1/chat/completions")
        if not chat_request.stream:
            return _json(await chat_completions.complete(resident, prepared, watch))
        resident.engine.check_queue_room()
        return Response(
            chat_completions.stream(resident, prepared, include_usage=chat_request.include_usage,
                                    flush_interval=stream_flush, observer=watch,
                                    return_progress=chat_request.return_progress),
            mimetype="text/event-stream", headers=SSE_HEADERS,
        )

    @api("POST", "/completions")
    async def legacy_completion() -> Response:
        completion_request = completions_wire.parse_completion_request(await _json_body())
        resident = await backend.resident_for(completion_request.model)
        prepared = [await prepare(resident, one)
                    for one in completions_wire.generation_requests(completion_request)]
        watch = observer("/v1/completions")
        echo = completion_request.echo
        if not completion_request.stream:
            return _json(await completions.complete(resident, prepared, echo=echo,
                                                    observer=watch))
        resident.engine.check_queue_room()
        return Response(
            completions.stream(resident, prepared, echo=echo,
                               include_usage=completion_request.include_usage,
                               flush_interval=stream_flush, observer=watch),
            mimetype="text/event-stream", headers=SSE_HEADERS,
        )

    @api("POST", "/messages")
    async def create_message() -> Response:
        messages_request = anthropic.parse_messages_request(await _json_body())
        check_messages(len(messages_request.messages))
        generation = anthropic.generation_request(messages_request)
        resident = await backend.resident_for(messages_request.model)
        prepared = await prepare(resident, generation)
        watch = observer("/v1/messages")
        show_thinking = anthropic.shows_thinking(messages_request)
        if not messages_request.stream:
            return _json(await messages.create(resident, prepared, watch,
                                               show_thinking=show_thinking))
        resident.engine.check_queue_room()
        return Response(messages.stream(resident, prepared, flush_interval=stream_flush,
                                        observer=watch, show_thinking=show_thinking),
                        mimetype="text/event-stream", headers=SSE_HEADERS)

    @api("POST", "/messages/count_tokens")
    async def count_tokens() -> Response:
        count_request = anthropic.parse_count_tokens_request(await _json_body())
        generation = anthropic.generation_request(count_request)
        resident = await backend.resident_for(None)  # waits out a swap, never starts one
        _check_model(resident, count_request.model)
        prepared = await prepare(resident, generation)
        return _json({"input_tokens": len(prepared.prompt)})

    # ---- the tokenizer, as vLLM and llama-server serve it (lm-eval's remote tokenizer)

    @api("POST", "/tokenize")
    async def tokenize() -> Response:
        tokenize_request = tokenizer_wire.parse_tokenize_request(await _json_body())
        resident = await backend.resident_for(None)
        _check_model(resident, tokenize_request.model)
        messages = (tokenizer_wire.chat_messages(tokenize_request)
                    if tokenize_request.messages is not None else None)
        tokens, pieces = await trio.to_thread.run_sync(functools.partial(
            preparing.tokenize, resident, tokenize_request.text, messages,
            add_special=tokenize_request.adds_special,
            with_pieces=tokenize_request.with_pieces))
        return _json(tokenizer_wire.tokenize_body(tokens, resident.max_context, pieces))

    @api("POST", "/detokenize")
    async def detokenize() -> Response:
        detokenize_request = tokenizer_wire.parse_detokenize_request(await _json_body())
        resident = await backend.resident_for(None)
        _check_model(resident, detokenize_request.model)
        preparing.checked_tokens(tuple(detokenize_request.tokens), resident.backend.info.n_vocab)
        text = await trio.to_thread.run_sync(resident.backend.detokenize,
                                             detokenize_request.tokens)
        return _json(tokenizer_wire.detokenize_body(text))

    @api("GET", "/tokenizer_info")
    async def tokenizer_info() -> Response:
        resident = await backend.resident_for(None)
        info = resident.backend.info
        return _json(tokenizer_wire.tokenizer_info_body(
            model=resident.model_id, bos=info.bos_text, eos=info.eos_text, add_bos=info.add_bos,
            chat_template=resident.template.source, max_model_len=resident.max_context))

    # ---- Ollama's native API, for the apps that speak only it

    def ollama_model(name: str | None) -> str | None:
        """Ollama clients may add the default tag to a listed name."""
        return name.removesuffix(":latest") if name else name

    def ollama_models(resident: ResidentModel) -> list[ollama_wire.ModelFacts]:
        return [ollama.model_facts(resident),
                *(ollama_wire.ModelFacts(id=model_id) for model_id in backend.swappable())]

    async def ollama_answer(resident: ResidentModel, prepared: PreparedGeneration, route: str,
                            shape: ollama.Shape, *, stream: bool) -> Response:
        watch = observer(route)
        if not stream:
            return _json(await ollama.whole(resident, prepared, watch, shape))
        resident.engine.check_queue_room()
        return Response(ollama.stream(resident, prepared, watch, shape),
                        mimetype="application/x-ndjson", headers=SSE_HEADERS)

    @app.get("/api/version")
    async def ollama_version() -> Response:
        return _json({"version": ollama_wire.API_VERSION})

    @app.get("/api/tags")
    async def ollama_tags() -> Response:
        resident = await backend.resident_for(None)  # waits out a swap, never starts one
        return _json({"models": [facts.tag() for facts in ollama_models(resident)]})

    @app.get("/api/ps")
    async def ollama_running() -> Response:
        resident = await backend.resident_for(None)
        return _json({"models": [ollama.model_facts(resident).running()]})

    @app.post("/api/show")
    async def ollama_show() -> Response:
        model = ollama_model(ollama_wire.parse_model_request(await _json_body()).id)
        resident = await backend.resident_for(None)
        found = next((facts for facts in ollama_models(resident) if facts.id == model
                      or (facts.id == resident.model_id and model in resident.names)), None)
        if found is None:
            raise ModelNotFound(f"model {model!r} not found", param="model")
        return _json(found.show())

    @app.post("/api/chat")
    async def ollama_chat() -> Response:
        chat_request = ollama_wire.parse_chat_request(await _json_body())
        check_messages(len(chat_request.messages))
        resident = await backend.resident_for(ollama_model(chat_request.model))
        prepared = await prepare(resident, ollama_wire.chat_generation(chat_request))
        return await ollama_answer(resident, prepared, "/api/chat", ollama.CHAT,
                                   stream=chat_request.stream)

    @app.post("/api/generate")
    async def ollama_generate() -> Response:
        generate_request = ollama_wire.parse_generate_request(await _json_body())
        resident = await backend.resident_for(ollama_model(generate_request.model))
        if not generate_request.prompt and generate_request.suffix is None:
            # Ollama's way to load a model: an empty prompt, answered at once.
            return _json(ollama_wire.generate_body(resident.model_id, "", done=True,
                                                   reason="load"))
        prepared = await prepare(resident, ollama_wire.generate_generation(generate_request))
        return await ollama_answer(resident, prepared, "/api/generate", ollama.GENERATE,
                                   stream=generate_request.stream)

    return app


def _engine_of(backend: ServeBackend) -> Engine | None:
    resident = backend.resident
    return None if resident is None else resident.engine


def _finish(
    metrics: Metrics,
) -> Callable[[RequestObserver, Generation | None, bool], None]:
    def finish(watch: RequestObserver, generation: Generation | None,
               cancelled: bool) -> None:
        if cancelled:
            metrics.cancellations.inc()
        if watch.ttft is not None:
            metrics.ttft.observe(watch.ttft)
        duration = time.perf_counter() - watch.started
        ttft = "-" if watch.ttft is None else f"{watch.ttft:.3f}"
        if generation is None:
            request_log.info("%s admission_failed duration=%.3f cancelled=%s", watch.route,
                             duration, cancelled)
            return
        request_log.info(
            "%s finish=%s prompt=%d cached=%d completion=%d drafts=%d/%d ttft=%s "
            "duration=%.3f cancelled=%s", watch.route, generation.finish_reason,
            generation.prompt_tokens, generation.cached_tokens, generation.completion_tokens,
            generation.accepted_tokens, generation.drafted_tokens, ttft, duration, cancelled,
        )

    return finish


def _check_model(resident: ResidentModel, model: str | None) -> None:
    if model and model not in resident.names:
        raise ModelNotFound(
            f"model {model!r} is not available; this server serves {resident.model_id!r}",
            param="model",
        )


async def _json_body() -> Any:
    raw = await request.get_data(cache=False)
    try:
        # Decode explicitly: json.loads(bytes) would guess UTF-16/32 from a BOM.
        return json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
    except UnicodeDecodeError:
        raise InvalidRequest("the request body is not valid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequest("the request body is nested too deeply") from None


def _unloaded_card(model_id: str) -> dict[str, Any]:
    """A model a request may name to swap it in (its context is known once loaded)."""
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "butter",
            "loaded": False}


def _model_card(resident: ResidentModel) -> dict[str, Any]:
    return {
        "id": resident.model_id,
        "object": "model",
        "created": 0,
        "owned_by": "butter",
        "loaded": True,
        "max_model_len": resident.max_context,
        "context_length": resident.max_context,
        "meta": resident.metadata(),
    }


def _json(body: Any, *, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        json.dumps(body, ensure_ascii=False), status=status, headers=headers,
        mimetype="application/json",
    )
