"""POST /v1/chat/completions: request → prompt → engine → JSON body or SSE stream."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import attrs

from butter.chat.detokenize import IncrementalDetokenizer
from butter.chat.stops import StopMatcher
from butter.engine.engine import Generation
from butter.errors import ButterError, ContextLengthExceeded
from butter.protocol import openai
from butter.protocol.sse import DONE, data_event
from butter.server.resident import ResidentModel


class GenerationFailed(ButterError):
    status = 500


@attrs.frozen
class PreparedChat:
    request: openai.ChatCompletionRequest
    prompt: list[int]
    completion_id: str
    created: int


def prepare(resident: ResidentModel, request: openai.ChatCompletionRequest) -> PreparedChat:
    prompt = resident.render(
        openai.template_messages(request), openai.template_tools(request),
        request.chat_template_kwargs,
    )
    check_fits(len(prompt), request.requested_max_tokens, resident.max_context)
    return PreparedChat(
        request=request, prompt=prompt,
        completion_id=f"chatcmpl-{uuid.uuid4().hex}", created=openai.now(),
    )


def check_fits(prompt_tokens: int, max_tokens: int | None, max_context: int) -> None:
    wanted = prompt_tokens + (max_tokens or 1)
    if wanted > max_context:
        raise ContextLengthExceeded(
            f"this request needs {prompt_tokens} prompt tokens + {max_tokens or 1} completion "
            f"tokens = {wanted}, but the maximum context is {max_context} tokens",
            param="messages",
        )


class TextAssembler:
    """Token pieces → client text: UTF-8 safe, stop strings cut, never partially emitted."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._detokenizer = IncrementalDetokenizer()
        self._stops = StopMatcher(stops)

    @property
    def stopped(self) -> bool:
        return self._stops.matched is not None

    def feed(self, pieces: list[bytes]) -> str:
        return self._stops.feed(self._detokenizer.feed(b"".join(pieces)))

    def finish(self) -> str:
        return self._stops.feed(self._detokenizer.flush()) + self._stops.flush()


async def _generated_text(
    generation: Generation, assembler: TextAssembler
) -> AsyncIterator[str]:
    async for pieces in generation.pieces():
        text = assembler.feed(pieces)
        if text:
            yield text
        if assembler.stopped:
            generation.close()  # the engine drops it before the next step
            return
    tail = assembler.finish()
    if tail:
        yield tail


def finish_reason(generation: Generation, assembler: TextAssembler) -> openai.FinishReason:
    if generation.finish_reason == "error":
        raise GenerationFailed(generation.error or "generation failed")
    if assembler.stopped:
        return "stop"
    return "length" if generation.finish_reason == "length" else "stop"


def usage(generation: Generation) -> openai.Usage:
    return openai.Usage(
        prompt_tokens=generation.prompt_tokens,
        completion_tokens=generation.completion_tokens,
        cached_tokens=generation.cached_tokens,
    )


async def complete(resident: ResidentModel, chat: PreparedChat) -> dict[str, Any]:
    request = chat.request
    assembler = TextAssembler(request.stop_strings)
    async with resident.engine.generate(
        chat.prompt, openai.sampling_params(request), request.requested_max_tokens
    ) as generation:
        parts = [text async for text in _generated_text(generation, assembler)]
    return openai.completion_body(
        completion_id=chat.completion_id, model=resident.model_id, created=chat.created,
        content="".join(parts), finish_reason=finish_reason(generation, assembler),
        usage=usage(generation),
    )


async def stream(resident: ResidentModel, chat: PreparedChat) -> AsyncIterator[bytes]:
    request = chat.request
    assembler = TextAssembler(request.stop_strings)

    def chunk(delta: dict[str, Any], reason: openai.FinishReason | None = None) -> bytes:
        return data_event(openai.chunk_body(
            completion_id=chat.completion_id, model=resident.model_id, created=chat.created,
            delta=delta, finish_reason=reason,
        ))

    async with resident.engine.generate(
        chat.prompt, openai.sampling_params(request), request.requested_max_tokens,
    ) as generation:
        yield chunk({"role": "assistant", "content": ""})
        async for text in _generated_text(generation, assembler):
            yield chunk({"content": text})
    try:
        reason = finish_reason(generation, assembler)
    except ButterError as exc:
        yield data_event(exc.openai_body())
        yield DONE
        return
    yield chunk({}, reason)
    if request.include_usage:
        yield data_event(openai.usage_chunk_body(
            completion_id=chat.completion_id, model=resident.model_id, created=chat.created,
            usage=usage(generation),
        ))
    yield DONE
