"""POST /v1/chat/completions: the pipeline's events as a chat.completion body or SSE chunks."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from butter.chat.markup import ContentDelta, Event, ReasoningDelta, ToolCall
from butter.chat.request import FinishReason
from butter.errors import ButterError
from butter.pipeline.output import OutputAssembler, OutputBlocks
from butter.pipeline.prepare import PreparedGeneration
from butter.pipeline.resident import ResidentModel
from butter.pipeline.run import RequestObserver, finish_reason, generated_events, running, usage
from butter.protocol import openai
from butter.protocol.sse import DONE, data_event
from butter.server.coalesce import FrameCoalescer


def new_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def _tool_call_body(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


async def complete(
    resident: ResidentModel, prepared: PreparedGeneration,
    observer: RequestObserver | None = None,
) -> dict[str, Any]:
    assembler = OutputAssembler(prepared)
    answer = OutputBlocks()
    async with running(resident, prepared, observer) as generation:
        async for event in generated_events(generation, assembler, observer=observer):
            if event is not None:
                answer.add(event)
    calls = [_tool_call_body(call) for call in answer.calls]
    text = answer.text
    return openai.completion_body(
        completion_id=new_completion_id(), model=resident.model_id, created=openai.now(),
        content=None if calls and not text.strip() else text,
        reasoning_content=answer.reasoning or None, tool_calls=calls or None,
        finish_reason=finish_reason(generation, assembler), usage=usage(generation),
    )


def _deltas(event: Event) -> list[dict[str, Any]]:
    if isinstance(event, ContentDelta):
        return [{"content": event.text}]
    if isinstance(event, ReasoningDelta):
        return [{"reasoning_content": event.text}]
    # A call is two deltas: who is called, then its arguments (clients concatenate those).
    opening = {"index": event.index, "id": event.id, "type": "function",
               "function": {"name": event.name, "arguments": ""}}
    arguments = {"index": event.index, "function": {"arguments": event.arguments}}
    return [{"tool_calls": [opening]}, {"tool_calls": [arguments]}]


async def stream(
    resident: ResidentModel, prepared: PreparedGeneration, *, include_usage: bool,
    flush_interval: float = 0.0, observer: RequestObserver | None = None,
) -> AsyncIterator[bytes]:
    assembler = OutputAssembler(prepared)
    frames = FrameCoalescer(flush_interval)
    completion_id, created = new_completion_id(), openai.now()

    def chunk(delta: dict[str, Any], reason: FinishReason | None = None) -> bytes:
        return data_event(openai.chunk_body(
            completion_id=completion_id, model=resident.model_id, created=created,
            delta=delta, finish_reason=reason,
        ))

    try:
        async with running(resident, prepared, observer) as generation:
            yield chunk({"role": "assistant", "content": ""})
            async for event in generated_events(generation, assembler, observer=observer):
                if event is None:
                    continue
                ready = frames.add(b"".join(chunk(delta) for delta in _deltas(event)))
                if ready:
                    yield ready
        reason = finish_reason(generation, assembler)
    except ButterError as exc:  # after the headers went out: end cleanly, then say why
        yield frames.take() + chunk({}, "stop") + data_event(exc.openai_body()) + DONE
        return
    tail = frames.take() + chunk({}, reason)
    if include_usage:
        tail += data_event(openai.usage_chunk_body(
            completion_id=completion_id, model=resident.model_id, created=created,
            usage=usage(generation),
        ))
    yield tail + DONE
