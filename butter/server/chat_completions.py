"""POST /v1/chat/completions: the pipeline's events as a chat.completion body or SSE chunks.

A request with `n` > 1 runs its choices side by side in the engine (prefilled once). The
body lists them by index; a stream sends each choice's chunks in turn, choice 0 first
(clients reassemble by `index`), while the later choices keep generating meanwhile."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import trio

from butter.chat.markup import ContentDelta, Event, ReasoningDelta, ToolCall
from butter.chat.request import FinishReason
from butter.engine.generation import Generation
from butter.errors import ButterError
from butter.pipeline.output import LogprobsDelta, OutputAssembler, OutputBlocks
from butter.pipeline.prepare import PreparedGeneration
from butter.pipeline.resident import ResidentModel
from butter.pipeline.run import (
    RequestObserver,
    finish_reason,
    generated_events,
    running_choices,
    timings,
    usage,
)
from butter.protocol import openai
from butter.protocol.sse import DONE, data_event
from butter.server.streaming import Flush, Frame, encoded


def new_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def _tool_call_body(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


async def complete(
    resident: ResidentModel, prepared: PreparedGeneration,
    observer: RequestObserver | None = None,
) -> dict[str, Any]:
    async with running_choices(resident, prepared, observer) as generations:
        choices: list[dict[str, Any]] = [{} for _ in generations]
        async with trio.open_nursery() as nursery:
            for index, generation in enumerate(generations):
                nursery.start_soon(_collect, prepared, generation, index, choices, observer)
    return openai.completion_body(
        completion_id=new_completion_id(), model=resident.model_id, created=openai.now(),
        choices=choices, usage=usage(*generations), timings=timings(generations[0]),
    )


async def _collect(
    prepared: PreparedGeneration, generation: Generation, index: int,
    choices: list[dict[str, Any]], observer: RequestObserver | None,
) -> None:
    """One choice, whole, into choices[index]."""
    assembler = OutputAssembler(prepared)
    answer = OutputBlocks()
    async for event in generated_events(generation, assembler, observer=observer):
        if event is not None:
            answer.add(event)
    calls = [_tool_call_body(call) for call in answer.calls]
    text = answer.text
    message = openai.message_body(None if calls and not text.strip() else text,
                                  answer.reasoning or None, calls or None)
    logprobs = answer.logprobs if prepared.params.logprobs is not None else None
    choices[index] = openai.choice_body(index, message, finish_reason(generation, assembler),
                                        logprobs)


def _deltas(event: Event) -> list[dict[str, Any]]:
    if isinstance(event, ContentDelta):
        return [{"content": event.text}]
    if isinstance(event, ReasoningDelta):
        return [{"reasoning_content": event.text, "reasoning": event.text}]
    # A call is two deltas: who is called, then its arguments (clients concatenate those).
    opening = {"index": event.index, "id": event.id, "type": "function",
               "function": {"name": event.name, "arguments": ""}}
    arguments = {"index": event.index, "function": {"arguments": event.arguments}}
    return [{"tool_calls": [opening]}, {"tool_calls": [arguments]}]


# With return_progress: how often a stream looks at its prompt's progress (seconds).
PROGRESS_POLL_SECONDS = 0.1


def _prompt_progress(generation: Generation) -> tuple[int, int]:
    """(positions of the prompt in the KV cache, milliseconds since it got a session)."""
    if generation.prompt_evaluated or generation.leased_at is None:
        done = generation.prompt_tokens if generation.prompt_evaluated else generation.cached_tokens
        return done, 0 if generation.leased_at is None else _since(generation.leased_at)
    return generation.prompt_tokens - len(generation.pending), _since(generation.leased_at)


def _since(start: float) -> int:
    return int((time.perf_counter() - start) * 1000)


class _Chunks:
    """One stream's chunks: its id and creation time, and the prompt progress it sent."""

    def __init__(self, model_id: str) -> None:
        self.model_id = model_id
        self.completion_id, self.created = new_completion_id(), openai.now()
        self._reported = -1  # the last progress sent (processed positions)

    def chunk(self, delta: dict[str, Any], index: int, reason: FinishReason | None = None,
              logprobs: LogprobsDelta | None = None,
              generation: Generation | None = None) -> bytes:
        return data_event(openai.chunk_body(
            completion_id=self.completion_id, model=self.model_id, created=self.created,
            delta=delta, finish_reason=reason, index=index,
            logprobs=None if logprobs is None else list(logprobs.entries),
            timings=None if generation is None else timings(generation),
        ))

    def progress(self, generation: Generation, *, final: bool = False) -> bytes:
        """The prompt's progress, if it moved since the last report."""
        processed, elapsed = _prompt_progress(generation)
        if final:
            processed = generation.prompt_tokens
        if processed == self._reported:
            return b""
        self._reported = processed
        return data_event(openai.progress_chunk_body(
            completion_id=self.completion_id, model=self.model_id, created=self.created,
            total=generation.prompt_tokens, cache=generation.cached_tokens,
            processed=processed, time_ms=elapsed))

    def usage(self, generations: list[Generation]) -> bytes:
        return data_event(openai.usage_chunk_body(
            completion_id=self.completion_id, model=self.model_id, created=self.created,
            usage=usage(*generations)))

    def failed(self, error: ButterError) -> bytes:
        return self.chunk({}, 0, "stop") + data_event(error.openai_body()) + DONE


def stream(
    resident: ResidentModel, prepared: PreparedGeneration, *, include_usage: bool,
    flush_interval: float = 0.0, observer: RequestObserver | None = None,
    return_progress: bool = False,
) -> AsyncIterator[bytes]:
    chunks = _Chunks(resident.model_id)
    frames = _frames(resident, prepared, chunks, include_usage=include_usage,
                     observer=observer, return_progress=return_progress)
    return encoded(frames, flush_interval=flush_interval, failed=chunks.failed)


async def _frames(
    resident: ResidentModel, prepared: PreparedGeneration, chunks: _Chunks, *,
    include_usage: bool, observer: RequestObserver | None, return_progress: bool,
) -> AsyncGenerator[Frame, None]:
    async with running_choices(resident, prepared, observer) as generations:
        for index, generation in enumerate(generations):
            yield Flush(chunks.chunk({"role": "assistant", "content": ""}, index))
            assembler = OutputAssembler(prepared)
            polling = return_progress and index == 0  # the prompt is evaluated once
            async for event in generated_events(
                    generation, assembler, observer=observer,
                    heartbeat=PROGRESS_POLL_SECONDS if polling else None):
                if event is None:  # (only while polling: no output yet)
                    yield Flush(chunks.progress(generation))
                    continue
                if polling:
                    polling = False
                    yield Flush(chunks.progress(generation, final=True))
                if isinstance(event, LogprobsDelta):
                    yield chunks.chunk({}, index, logprobs=event)
                else:
                    yield b"".join(chunks.chunk(delta, index) for delta in _deltas(event))
            yield chunks.chunk({}, index, finish_reason(generation, assembler),
                               generation=generation)
    yield (chunks.usage(generations) if include_usage else b"") + DONE
