"""POST /v1/messages (Anthropic): the chat path underneath, Messages on the wire."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from butter.chat.markup import ContentDelta, Event, ReasoningDelta, ToolCall
from butter.errors import ButterError
from butter.protocol import anthropic
from butter.protocol.sse import named_event
from butter.server import chat_completions as chat
from butter.server.coalesce import FrameCoalescer
from butter.server.resident import ResidentModel

# While a long prompt is prefilled, a ping keeps proxies and clients from timing out.
PING_INTERVAL_SECONDS = 1.0
TOOL_USE_ID_PREFIX = "toolu_"


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


async def create(
    resident: ResidentModel, prepared: chat.PreparedChat,
    observer: chat.RequestObserver | None = None,
) -> dict[str, Any]:
    assembler = chat.OutputAssembler(prepared, call_id_prefix=TOOL_USE_ID_PREFIX)
    blocks = _BlockCollector()
    async with chat.running(resident, prepared, observer) as generation:
        async for event in chat.generated_events(generation, assembler, observer=observer):
            if event is not None:
                blocks.add(event)
    finish = chat.finish_reason(generation, assembler)
    return anthropic.message_body(
        message_id=new_message_id(), model=resident.model_id, content=blocks.blocks,
        stop=anthropic.stop_reason(finish, assembler.matched_stop),
        stop_sequence=assembler.matched_stop, usage=chat.usage(generation),
    )


class _BlockCollector:
    """Events → content blocks, merging consecutive text or thinking."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []

    def add(self, event: Event) -> None:
        last = self.blocks[-1] if self.blocks else None
        if isinstance(event, ContentDelta):
            if last is not None and last["type"] == "text":
                last["text"] += event.text
            else:
                self.blocks.append({"type": "text", "text": event.text})
        elif isinstance(event, ReasoningDelta):
            if last is not None and last["type"] == "thinking":
                last["thinking"] += event.text
            else:
                self.blocks.append({"type": "thinking", "thinking": event.text, "signature": ""})
        else:
            self.blocks.append(anthropic.tool_use_block(event.id, event.name, event.arguments))


class _StreamBlocks:
    """Tracks the open content block of a stream and emits start/delta/stop events."""

    def __init__(self) -> None:
        self._index = -1
        self._open: str | None = None

    def on(self, event: Event) -> list[bytes]:
        frames: list[bytes] = []
        if isinstance(event, ToolCall):
            frames += self.close()
            frames += self._start({"type": "tool_use", "id": event.id, "name": event.name,
                                   "input": {}})
            frames.append(self._delta({"type": "input_json_delta",
                                       "partial_json": event.arguments}))
            frames += self.close()
            return frames
        kind = "thinking" if isinstance(event, ReasoningDelta) else "text"
        if self._open != kind:
            frames += self.close()
            start = ({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                     else {"type": "text", "text": ""})
            frames += self._start(start)
            self._open = kind
        delta = ({"type": "thinking_delta", "thinking": event.text} if kind == "thinking"
                 else {"type": "text_delta", "text": event.text})
        frames.append(self._delta(delta))
        return frames

    def close(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        return [named_event("content_block_stop",
                            {"type": "content_block_stop", "index": self._index})]

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        self._index += 1
        self._open = block["type"]
        return [named_event("content_block_start", {
            "type": "content_block_start", "index": self._index, "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return named_event("content_block_delta",
                           {"type": "content_block_delta", "index": self._index, "delta": delta})


async def stream(
    resident: ResidentModel, prepared: chat.PreparedChat, *, flush_interval: float = 0.0,
    observer: chat.RequestObserver | None = None,
) -> AsyncIterator[bytes]:
    assembler = chat.OutputAssembler(prepared, call_id_prefix=TOOL_USE_ID_PREFIX)
    frames = FrameCoalescer(flush_interval)
    blocks = _StreamBlocks()
    message_id = new_message_id()
    try:
        async with chat.running(resident, prepared, observer) as generation:
            await generation.attached.wait()  # the cached prefix is known from here on
            start = anthropic.message_body(
                message_id=message_id, model=resident.model_id, content=[], stop=None,
                stop_sequence=None, usage=chat.usage(generation),
            )
            yield named_event("message_start", {"type": "message_start", "message": start})
            async for event in chat.generated_events(
                generation, assembler, heartbeat=PING_INTERVAL_SECONDS, observer=observer
            ):
                frame = named_event("ping", {"type": "ping"}) if event is None else b"".join(
                    blocks.on(event))
                ready = frames.add(frame)
                if ready:
                    yield ready
        finish = chat.finish_reason(generation, assembler)
    except ButterError as exc:  # after the headers went out: close blocks, then an error event
        yield b"".join([frames.take(), *blocks.close(),
                        named_event("error", exc.anthropic_body())])
        return
    delta = {
        "type": "message_delta",
        "delta": {"stop_reason": anthropic.stop_reason(finish, assembler.matched_stop),
                  "stop_sequence": assembler.matched_stop},
        "usage": anthropic.usage_body(chat.usage(generation)),
    }
    yield b"".join([frames.take(), *blocks.close(), named_event("message_delta", delta),
                    named_event("message_stop", {"type": "message_stop"})])
