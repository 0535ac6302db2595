"""Routes. Thin on purpose: parse, delegate, render; errors in each API's own shape."""

from __future__ import annotations

import json
from typing import Any

import attrs
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from butter import __version__
from butter.errors import ButterError, InvalidRequest, ModelNotFound, Overloaded, RequestTooLarge
from butter.protocol import anthropic, openai
from butter.server import chat_completions, messages
from butter.server.backends import ServeBackend
from butter.server.resident import ResidentModel

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def create_app(
    backend: ServeBackend, *, max_body_bytes: int, stream_flush: float = 0.0
) -> QuartTrio:
    app = QuartTrio("butter")
    app.config["MAX_CONTENT_LENGTH"] = max_body_bytes
    app.config["RESPONSE_TIMEOUT"] = None  # generation may take long; disconnects cancel it
    app.config["BODY_TIMEOUT"] = 60

    def is_anthropic() -> bool:
        return request.path.startswith("/v1/messages")

    def error_response(error: ButterError) -> Response:
        if not is_anthropic():
            return _json(error.openai_body(), status=error.status, headers=error.headers())
        # Anthropic says 529 overloaded_error where OpenAI clients expect 503.
        status = 529 if isinstance(error, Overloaded) else error.status
        return _json(error.anthropic_body(), status=status, headers=error.headers())

    @app.errorhandler(ButterError)
    async def handle_butter_error(error: ButterError) -> Response:
        return error_response(error)

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

    @app.get("/health")
    async def health() -> Response:
        return Response("ok", mimetype="text/plain")

    @app.get("/v1/models")
    async def list_models() -> Response:
        return _json({"object": "list", "data": [_model_card(backend.current)]})

    @app.get("/v1/server")
    async def server_info() -> Response:
        resident = backend.current
        return _json({
            "version": __version__,
            "model": _model_card(resident),
            "engine": attrs.asdict(resident.engine.stats()),
            "swaps": backend.swaps,
            "allow_swap": backend.allow_swap,
        })

    @app.post("/v1/chat/completions")
    async def chat() -> Response:
        chat_request = openai.parse_chat_request(await _json_body())
        resident = await backend.resident_for(chat_request.model)
        prepared = chat_completions.prepare(resident, chat_request)
        if not chat_request.stream:
            return _json(await chat_completions.complete(resident, prepared))
        resident.engine.admission.check_queue_room()
        return Response(
            chat_completions.stream(resident, prepared, flush_interval=stream_flush),
            mimetype="text/event-stream", headers=SSE_HEADERS,
        )

    @app.post("/v1/messages")
    async def create_message() -> Response:
        messages_request = anthropic.parse_messages_request(await _json_body())
        chat_request = anthropic.to_chat_request(messages_request)
        resident = await backend.resident_for(chat_request.model)
        prepared = chat_completions.prepare(resident, chat_request)
        if not messages_request.stream:
            return _json(await messages.create(resident, prepared))
        resident.engine.admission.check_queue_room()
        return Response(messages.stream(resident, prepared, flush_interval=stream_flush),
                        mimetype="text/event-stream", headers=SSE_HEADERS)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens() -> Response:
        chat_request = anthropic.to_chat_request(
            anthropic.parse_count_tokens_request(await _json_body())
        )
        resident = backend.current  # counting never swaps models
        _check_model(resident, chat_request.model)
        prepared = chat_completions.prepare(resident, chat_request)
        return _json({"input_tokens": len(prepared.prompt)})

    return app


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


def _model_card(resident: ResidentModel) -> dict[str, Any]:
    return {
        "id": resident.model_id,
        "object": "model",
        "created": 0,
        "owned_by": "butter",
        "max_model_len": resident.max_context,
        "context_length": resident.max_context,
        "meta": resident.metadata(),
    }


def _json(body: Any, *, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        json.dumps(body, ensure_ascii=False), status=status, headers=headers,
        mimetype="application/json",
    )
