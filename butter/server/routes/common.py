"""What every route module shares: the served model holder and the server's settings
(reached through the app, so routes stay plain functions), JSON in and out, and the
checks that read no wire format."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import attrs
import trio
from quart import Response, current_app, request

from butter.chat.images import DEFAULT_MAX_IMAGES, ImageLimits, check_image_count
from butter.chat.request import ChatPrompt, GenerationRequest, Prompt
from butter.errors import InvalidRequest, ModelNotFound
from butter.pipeline import prepare as preparing
from butter.pipeline.prepare import PreparedGeneration
from butter.pipeline.resident import ResidentModel
from butter.pipeline.run import Outcome, RequestObserver
from butter.server.access import AccessPolicy, ApiKeys
from butter.server.holders import ModelHolder
from butter.server.metrics import Metrics, log_request
from butter.server.readiness import Readiness
from butter.settings import (
    DEFAULT_BODY_TIMEOUT_SECONDS,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_MESSAGES,
)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
EXTENSION = "butter"  # the app's extensions key for `Served`


@attrs.frozen
class HttpLimits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_messages: int = DEFAULT_MAX_MESSAGES
    max_images: int = DEFAULT_MAX_IMAGES
    body_timeout: float = DEFAULT_BODY_TIMEOUT_SECONDS
    stream_flush: float = 0.0
    api_keys: ApiKeys = attrs.field(factory=ApiKeys)  # none: no key needed
    access: AccessPolicy = attrs.field(factory=AccessPolicy)  # Host and Origin rules
    ui: bool = True  # the chat page at / for browsers (butter/server/ui.py)


@attrs.frozen
class Served:
    """What one app serves and how: set on the app by create_app, read by every route."""

    holder: ModelHolder
    limits: HttpLimits
    metrics: Metrics
    readiness: Readiness

    def observer(self, route: str) -> RequestObserver:
        """Times one request for its metrics and its log line."""
        return RequestObserver(route=route, on_finish=_finish(self.metrics))

    def check_messages(self, count: int) -> None:
        if count > self.limits.max_messages:
            raise InvalidRequest(
                f"{count} messages exceed the limit of {self.limits.max_messages}",
                param="messages")

    def check_images(self, prompt: Prompt, param: str = "messages") -> None:
        """A chat prompt's images, counted as the request is read (before a model swaps
        in or any image is decoded)."""
        if isinstance(prompt, ChatPrompt):
            check_image_count(len(prompt.images()), ImageLimits(
                max_images=self.limits.max_images), param)


def served() -> Served:
    return cast(Served, current_app.extensions[EXTENSION])


async def prepare(resident: ResidentModel, request: GenerationRequest) -> PreparedGeneration:
    """Render, tokenize and check a request on a worker thread: long prompts, big tool
    schemas and grammar compilation would otherwise stall every stream on the event loop."""
    return await trio.to_thread.run_sync(preparing.prepare, resident, request)


async def resident_and_prepared(model: str | None, request: GenerationRequest
                                ) -> tuple[ResidentModel, PreparedGeneration]:
    """The model to answer with (swapped in if the request names another one) and the
    request prepared for it."""
    resident = await served().holder.resident_for(model)
    return resident, await prepare(resident, request)


def streamed(resident: ResidentModel, writes: AsyncIterator[bytes], *,
             mimetype: str = "text/event-stream") -> Response:
    """A streamed answer, or a 503 while a status can still be sent: a full queue refuses
    now rather than after the headers went out."""
    resident.engine.check_queue_room()
    return Response(writes, mimetype=mimetype, headers=SSE_HEADERS)


def check_model(resident: ResidentModel, model: str | None) -> None:
    """For routes that never swap: a named model must be the resident one."""
    if model and model not in resident.names:
        raise ModelNotFound(
            f"model {model!r} is not available; this server serves {resident.model_id!r}",
            param="model",
        )


async def json_body() -> Any:
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


def json_response(body: Any, *, status: int = 200,
                  headers: dict[str, str] | None = None) -> Response:
    return Response(
        json.dumps(body, ensure_ascii=False), status=status, headers=headers,
        mimetype="application/json",
    )


def unloaded_card(model_id: str) -> dict[str, Any]:
    """A model a request may name to swap it in (its context is known once loaded)."""
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "butter",
            "loaded": False}


def model_card(resident: ResidentModel) -> dict[str, Any]:
    vision = resident.backend.vision
    return {
        "id": resident.model_id,
        "object": "model",
        "created": 0,
        "owned_by": "butter",
        "loaded": True,
        "max_model_len": resident.max_context,
        "context_length": resident.max_context,
        # llama-server's: "multimodal" with a projector (its Ollama-shaped list); Ollama's
        # own word for it is "vision"; its router lists input_modalities.
        "capabilities": ["completion", "vision"] if vision else ["completion"],
        "architecture": {"input_modalities": ["text", "image"] if vision else ["text"],
                         "output_modalities": ["text"]},
        "meta": resident.metadata(),
    }


def _finish(metrics: Metrics) -> Callable[[RequestObserver, Outcome | None, bool], None]:
    def finish(watch: RequestObserver, outcome: Outcome | None, cancelled: bool) -> None:
        if cancelled:
            metrics.cancellations.inc()
        if watch.ttft is not None:
            metrics.ttft.observe(watch.ttft)
        log_request(watch.route, outcome, ttft=watch.ttft,
                    duration=time.perf_counter() - watch.started, cancelled=cancelled)

    return finish
