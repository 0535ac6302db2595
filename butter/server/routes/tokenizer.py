"""The tokenizer, as vLLM and llama-server serve it (lm-eval's remote tokenizer)."""

from __future__ import annotations

import functools
from typing import Any

import trio
from quart import Blueprint, Response

from butter.chat.request import ChatPrompt
from butter.errors import InvalidRequest
from butter.pipeline import prepare as preparing
from butter.pipeline.resident import ResidentModel
from butter.protocol import openai as openai_wire
from butter.protocol import tokenizer as tokenizer_wire
from butter.server.routes.common import check_model, json_body, json_response, served

routes = Blueprint("tokenizer", __name__)


@routes.post("/tokenize")
async def tokenize() -> Response:
    """`prompt` (or `content`) as text, or `messages` as the prompt that a chat request
    with the same body would have: its `tools`, `chat_template_kwargs`,
    `reasoning_effort`, `add_generation_prompt` and `continue_final_message` included
    (vLLM's /tokenize renders them too)."""
    body = await json_body()
    tokenize_request = tokenizer_wire.parse_tokenize_request(body)
    chat = _chat_prompt(body) if tokenize_request.messages is not None else None
    resident = await served().holder.resident_for(None)
    check_model(resident, tokenize_request.model)
    tokens, pieces = await trio.to_thread.run_sync(functools.partial(
        _tokens, resident, tokenize_request, chat))
    return json_response(tokenizer_wire.tokenize_body(tokens, resident.max_context, pieces))


def _chat_prompt(body: Any) -> ChatPrompt:
    """The body read as a chat request, by the chat route's own parsing: its prompt."""
    chat_request = openai_wire.parse_chat_request(body)
    served().check_messages(len(chat_request.messages))
    prompt = openai_wire.generation_request(chat_request).prompt
    if not isinstance(prompt, ChatPrompt):  # (a chat request's prompt always is)
        raise TypeError(f"a chat request gave a {type(prompt).__name__}")
    served().check_images(prompt)
    if prompt.images():  # (their positions are no vocabulary's tokens)
        raise InvalidRequest("/tokenize takes no images: POST /v1/chat/completions/input_tokens "
                             "counts a prompt that holds images", param=prompt.images()[0].param)
    return prompt


def _tokens(resident: ResidentModel, request: tokenizer_wire.TokenizeRequest,
            chat: ChatPrompt | None) -> tuple[list[int], list[str] | None]:
    """Blocking. A chat prompt is rendered and tokenized as the pipeline prepares a chat
    request's (prepare.render, then the prompt's tokens with BOS where the model wants one
    and the template did not write it)."""
    text = request.text if chat is None else preparing.render(resident, chat)
    return preparing.tokenize(resident, text, None, add_special=(
        request.adds_special if chat is None else True), with_pieces=request.with_pieces)


@routes.post("/detokenize")
async def detokenize() -> Response:
    detokenize_request = tokenizer_wire.parse_detokenize_request(await json_body())
    resident = await served().holder.resident_for(None)
    check_model(resident, detokenize_request.model)
    preparing.checked_tokens(tuple(detokenize_request.tokens), resident.backend.info.n_vocab)
    text = await trio.to_thread.run_sync(resident.backend.detokenize, detokenize_request.tokens)
    return json_response(tokenizer_wire.detokenize_body(text))


@routes.get("/tokenizer_info")
async def tokenizer_info() -> Response:
    resident = await served().holder.resident_for(None)
    info = resident.backend.info
    return json_response(tokenizer_wire.tokenizer_info_body(
        model=resident.model_id, bos=info.bos_text, eos=info.eos_text, add_bos=info.add_bos,
        chat_template=resident.template.source, max_model_len=resident.max_context))
