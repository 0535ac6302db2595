"""POST /v1/messages (Anthropic): the pipeline's events as a message body or SSE events."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from butter.chat.markup import Event, ReasoningDelta, ToolCall
from butter.errors import ButterError
from butter.pipeline.answer import Choice, Heartbeat, answering
from butter.pipeline.output import ReasoningBlock, TextBlock
from butter.pipeline.prepare import PreparedGeneration
from butter.pipeline.resident import ResidentModel
from butter.pipeline.run import RequestObserver
from butter.protocol import anthropic
from butter.protocol.sse import named_event
from butter.server.streaming import Flush, Frame, encoded

# While a long prompt is prefilled, a ping keeps proxies and clients from timing out.
PING_INTERVAL_SECONDS = 1.0
TOOL_USE_ID_PREFIX = "toolu_"


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


async def create(
    resident: ResidentModel, prepared: PreparedGeneration,
    observer: RequestObserver | None = None, *, show_thinking: bool = True,
) -> dict[str, Any]:
    async with answering(resident, prepared, observer,
                         call_id_prefix=TOOL_USE_ID_PREFIX) as answer:
        whole = await answer.first.whole()
    return anthropic.message_body(
        message_id=new_message_id(), model=resident.model_id,
        content=[_content_block(block, show_thinking) for block in whole.blocks],
        stop=_stop_reason(answer.first), stop_sequence=answer.first.matched_stop,
        usage=answer.usage,
    )


def _stop_reason(choice: Choice) -> anthropic.StopReason:
    return anthropic.stop_reason(choice.finish_reason, choice.matched_stop)


def _content_block(block: TextBlock | ReasoningBlock | ToolCall, show_thinking: bool
                   ) -> dict[str, Any]:
    if isinstance(block, TextBlock):
        return {"type": "text", "text": block.text}
    if isinstance(block, ReasoningBlock):
        return {"type": "thinking", "thinking": block.text if show_thinking else "",
                "signature": ""}
    return anthropic.tool_use_block(block.id, block.name, block.arguments)


class _StreamBlocks:
    """Tracks the open content block of a stream and emits start/delta/stop events."""

    def __init__(self, show_thinking: bool = True) -> None:
        self._index = -1
        self._open: str | None = None
        # False (thinking.display "omitted"): thinking blocks open and close, empty.
        self._show_thinking = show_thinking

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
        if kind == "thinking":
            if self._show_thinking:
                frames.append(self._delta({"type": "thinking_delta", "thinking": event.text}))
        else:
            frames.append(self._delta({"type": "text_delta", "text": event.text}))
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


def stream(
    resident: ResidentModel, prepared: PreparedGeneration, *, flush_interval: float = 0.0,
    observer: RequestObserver | None = None, show_thinking: bool = True,
) -> AsyncIterator[bytes]:
    blocks = _StreamBlocks(show_thinking)

    def failed(error: ButterError) -> bytes:  # close the open block, then an error event
        return b"".join([*blocks.close(), named_event("error", error.anthropic_body())])

    return encoded(_frames(resident, prepared, blocks, observer),
                   flush_interval=flush_interval, failed=failed)


async def _frames(resident: ResidentModel, prepared: PreparedGeneration,
                  blocks: _StreamBlocks, observer: RequestObserver | None
                  ) -> AsyncGenerator[Frame, None]:
    async with answering(resident, prepared, observer,
                         call_id_prefix=TOOL_USE_ID_PREFIX) as answer:
        choice = answer.first
        await choice.cache_known()
        start = anthropic.message_body(
            message_id=new_message_id(), model=resident.model_id, content=[], stop=None,
            stop_sequence=None, usage=answer.usage,
        )
        yield Flush(named_event("message_start", {"type": "message_start", "message": start}))
        async for event in choice.events(heartbeat=PING_INTERVAL_SECONDS):
            if isinstance(event, Heartbeat):
                yield named_event("ping", {"type": "ping"})
            elif isinstance(event, Event):  # (the Messages API has no logprobs)
                yield b"".join(blocks.on(event))
    delta = {
        "type": "message_delta",
        "delta": {"stop_reason": _stop_reason(choice), "stop_sequence": choice.matched_stop},
        "usage": anthropic.usage_body(answer.usage),
    }
    yield b"".join([*blocks.close(), named_event("message_delta", delta),
                    named_event("message_stop", {"type": "message_stop"})])
