"""Ollama's native API, for the apps that speak only it (butter/protocol/ollama.py)."""

from __future__ import annotations

from quart import Blueprint, Response

from butter.errors import ModelNotFound
from butter.pipeline.prepare import PreparedGeneration
from butter.pipeline.resident import ResidentModel
from butter.protocol import ollama as ollama_wire
from butter.server import ollama
from butter.server.routes.common import (
    json_body,
    json_response,
    prepare,
    resident_and_prepared,
    served,
    streamed,
)

PREFIX = "/api"
routes = Blueprint("ollama", __name__)


def _model_name(name: str | None) -> str | None:
    """Ollama clients may add the default tag to a listed name."""
    return name.removesuffix(":latest") if name else name


def _models(resident: ResidentModel) -> list[ollama_wire.ModelFacts]:
    return [ollama.model_facts(resident),
            *(ollama_wire.ModelFacts(id=model_id) for model_id in served().holder.swappable())]


async def _answer(resident: ResidentModel, prepared: PreparedGeneration, route: str,
                  shape: ollama.Shape, *, stream: bool) -> Response:
    server = served()
    watch = server.observer(route)
    if not stream:
        return json_response(await ollama.whole(resident, prepared, watch, shape))
    return streamed(resident, ollama.stream(resident, prepared, watch, shape,
                                            flush_interval=server.limits.stream_flush),
                    mimetype="application/x-ndjson")


@routes.get("/version")
async def version() -> Response:
    return json_response({"version": ollama_wire.API_VERSION})


@routes.get("/tags")
async def tags() -> Response:
    resident = await served().holder.resident_for(None)  # waits out a swap, never starts one
    return json_response({"models": [facts.tag() for facts in _models(resident)]})


@routes.get("/ps")
async def running() -> Response:
    resident = await served().holder.resident_for(None)
    return json_response({"models": [ollama.model_facts(resident).running()]})


@routes.post("/show")
async def show() -> Response:
    model = _model_name(ollama_wire.parse_model_request(await json_body()).id)
    resident = await served().holder.resident_for(None)
    found = next((facts for facts in _models(resident) if facts.id == model
                  or (facts.id == resident.model_id and model in resident.names)), None)
    if found is None:
        raise ModelNotFound(f"model {model!r} not found", param="model")
    return json_response(found.show())


@routes.post("/chat")
async def chat() -> Response:
    server = served()
    chat_request = ollama_wire.parse_chat_request(await json_body())
    server.check_messages(len(chat_request.messages))
    generation = ollama_wire.chat_generation(chat_request)
    server.check_images(generation.prompt)
    resident, prepared = await resident_and_prepared(_model_name(chat_request.model),
                                                     generation)
    return await _answer(resident, prepared, "/api/chat", ollama.CHAT,
                         stream=chat_request.stream)


@routes.post("/generate")
async def generate() -> Response:
    generate_request = ollama_wire.parse_generate_request(await json_body())
    if generate_request.images:  # (counted before a model swaps in)
        served().check_images(ollama_wire.generate_generation(generate_request).prompt,
                              "images")
    resident = await served().holder.resident_for(_model_name(generate_request.model))
    if not (generate_request.prompt or generate_request.images
            or generate_request.suffix is not None):
        # Ollama's way to load a model: an empty prompt, answered at once.
        return json_response(ollama_wire.generate_body(resident.model_id, "", done=True,
                                                       reason="load"))
    prepared = await prepare(resident, ollama_wire.generate_generation(generate_request))
    return await _answer(resident, prepared, "/api/generate", ollama.GENERATE,
                         stream=generate_request.stream)
