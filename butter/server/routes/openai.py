"""OpenAI's API: the model list, Chat Completions and (legacy) Completions."""

from __future__ import annotations

import trio
from quart import Blueprint, Response

from butter.chat.request import ChatPrompt
from butter.pipeline import prepare as preparing
from butter.protocol import completions as completions_wire
from butter.protocol import openai as openai_wire
from butter.server import chat_completions, completions
from butter.server.routes.common import (
    check_model,
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
    generation = openai_wire.generation_request(chat_request)
    server.check_images(generation.prompt)
    resident, prepared = await resident_and_prepared(chat_request.model, generation)
    # llama-server's `__verbose` shows the prompt as the model saw it.
    prompt = (await trio.to_thread.run_sync(preparing.prompt_text, resident, prepared.prompt)
              if chat_request.verbose else None)
    watch = server.observer("/v1/chat/completions")
    if not chat_request.stream:
        return json_response(await chat_completions.complete(
            resident, prepared, watch, verbose_prompt=prompt))
    return streamed(resident, chat_completions.stream(
        resident, prepared, include_usage=chat_request.include_usage,
        flush_interval=server.limits.stream_flush, observer=watch,
        return_progress=chat_request.return_progress,
        timings_per_token=chat_request.timings_per_token, verbose_prompt=prompt))


@routes.post("/chat/completions/input_tokens")
async def chat_input_tokens() -> Response:
    """llama-server's: how many tokens a chat request's prompt has, without generating
    (never swaps: a named model must be the resident one)."""
    server = served()
    chat_request = openai_wire.parse_chat_request(await json_body())
    server.check_messages(len(chat_request.messages))
    prompt = openai_wire.generation_request(chat_request).prompt
    assert isinstance(prompt, ChatPrompt)
    server.check_images(prompt)
    resident = await server.holder.resident_for(None)  # waits out a swap
    check_model(resident, chat_request.model)
    tokens = await trio.to_thread.run_sync(preparing.chat_tokens, resident, prompt)
    return json_response({"object": "response.input_tokens", "input_tokens": len(tokens)})


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
