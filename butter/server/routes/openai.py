"""OpenAI's API: the model list, Chat Completions and (legacy) Completions."""

from __future__ import annotations

from quart import Blueprint, Response

from butter.protocol import completions as completions_wire
from butter.protocol import openai as openai_wire
from butter.server import chat_completions, completions
from butter.server.routes.common import (
    json_body,
    json_response,
    model_card,
    prepare,
    resident_and_prepared,
    served,
    streamed,
    unloaded_card,
)

routes = Blueprint("openai", __name__)


@routes.get("/models")
async def list_models() -> Response:
    holder = served().holder
    # During a swap this waits for it, in line with the requests (never starts one).
    resident = await holder.resident_for(None)
    others = [unloaded_card(model_id) for model_id in holder.swappable()]
    return json_response({"object": "list", "data": [model_card(resident), *others]})


@routes.post("/chat/completions")
async def chat() -> Response:
    server = served()
    chat_request = openai_wire.parse_chat_request(await json_body())
    server.check_messages(len(chat_request.messages))
    resident, prepared = await resident_and_prepared(
        chat_request.model, openai_wire.generation_request(chat_request))
    watch = server.observer("/v1/chat/completions")
    if not chat_request.stream:
        return json_response(await chat_completions.complete(resident, prepared, watch))
    return streamed(resident, chat_completions.stream(
        resident, prepared, include_usage=chat_request.include_usage,
        flush_interval=server.limits.stream_flush, observer=watch,
        return_progress=chat_request.return_progress))


@routes.post("/completions")
async def legacy_completion() -> Response:
    server = served()
    completion_request = completions_wire.parse_completion_request(await json_body())
    resident = await server.holder.resident_for(completion_request.model)
    prepared = [await prepare(resident, one)
                for one in completions_wire.generation_requests(completion_request)]
    watch = server.observer("/v1/completions")
    echo = completion_request.echo
    if not completion_request.stream:
        return json_response(await completions.complete(resident, prepared, echo=echo,
                                                        observer=watch))
    return streamed(resident, completions.stream(
        resident, prepared, echo=echo, include_usage=completion_request.include_usage,
        flush_interval=server.limits.stream_flush, observer=watch))
