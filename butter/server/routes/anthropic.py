"""Anthropic's Messages API and its token count."""

from __future__ import annotations

from quart import Blueprint, Response

from butter.protocol import anthropic as anthropic_wire
from butter.server import messages
from butter.server.routes.common import (
    check_model,
    json_body,
    json_response,
    prepare,
    resident_and_prepared,
    served,
    streamed,
)

routes = Blueprint("anthropic", __name__)


@routes.post("/messages")
async def create_message() -> Response:
    server = served()
    messages_request = anthropic_wire.parse_messages_request(await json_body())
    server.check_messages(len(messages_request.messages))
    generation = anthropic_wire.generation_request(messages_request)
    server.check_images(generation.prompt)
    resident, prepared = await resident_and_prepared(messages_request.model, generation)
    watch = server.observer("/v1/messages")
    show_thinking = anthropic_wire.shows_thinking(messages_request)
    if not messages_request.stream:
        return json_response(await messages.create(resident, prepared, watch,
                                                   show_thinking=show_thinking))
    return streamed(resident, messages.stream(
        resident, prepared, flush_interval=server.limits.stream_flush, observer=watch,
        show_thinking=show_thinking))


@routes.post("/messages/count_tokens")
async def count_tokens() -> Response:
    count_request = anthropic_wire.parse_count_tokens_request(await json_body())
    generation = anthropic_wire.generation_request(count_request)
    served().check_images(generation.prompt)
    resident = await served().holder.resident_for(None)  # waits out a swap, never starts one
    check_model(resident, count_request.model)
    prepared = await prepare(resident, generation)
    return json_response({"input_tokens": len(prepared.prompt)})
