"""The tokenizer, as vLLM and llama-server serve it (lm-eval's remote tokenizer)."""

from __future__ import annotations

import functools

import trio
from quart import Blueprint, Response

from butter.pipeline import prepare as preparing
from butter.protocol import tokenizer as tokenizer_wire
from butter.server.routes.common import check_model, json_body, json_response, served

routes = Blueprint("tokenizer", __name__)


@routes.post("/tokenize")
async def tokenize() -> Response:
    tokenize_request = tokenizer_wire.parse_tokenize_request(await json_body())
    resident = await served().holder.resident_for(None)
    check_model(resident, tokenize_request.model)
    messages = (tokenizer_wire.chat_messages(tokenize_request)
                if tokenize_request.messages is not None else None)
    tokens, pieces = await trio.to_thread.run_sync(functools.partial(
        preparing.tokenize, resident, tokenize_request.text, messages,
        add_special=tokenize_request.adds_special,
        with_pieces=tokenize_request.with_pieces))
    return json_response(tokenizer_wire.tokenize_body(tokens, resident.max_context, pieces))


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
