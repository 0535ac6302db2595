"""POST /v1/chat/completions: the pipeline's events as a chat.completion body or SSE chunks.

A request with `n` > 1 runs its choices side by side in the engine (prefilled once). The
body lists them by index; a stream sends each choice's chunks in turn, choice 0 first
(clients reassemble by `index`), while the later choices keep generating meanwhile."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import trio

from butter.chat.markup import ContentDelta, Event, ReasoningDelta, ToolCall
from butter.chat.request import FinishReason, Timings, Usage
from butter.errors import ButterError
from butter.pipeline.answer import Choice, Heartbeat, PromptProgress, answering
from butter.pipeline.output import LogprobsDelta
from butter.pipeline.prepare import PreparedGeneration
from butter.pipeline.resident import ResidentModel
from butter.pipeline.run import RequestObserver
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
    observer: RequestObserver | None = None, *, verbose_prompt: str | None = None,
) -> dict[str, Any]:
    """The whole answer's body; `verbose_prompt` (the prompt's text, for `"verbose":
    true`) adds llama-server's `__verbose`, of the first choice."""
    async with answering(resident, prepared, observer) as answer:
        choices: list[dict[str, Any]] = [{} for _ in answer.choices]
        async with trio.open_nursery() as nursery:
            for index, choice in enumerate(answer.choices):
                nursery.start_soon(_collect, prepared, choice, index, choices)
    body = openai.completion_body(
        completion_id=new_completion_id(), model=resident.model_id, created=openai.now(),
        choices=choices, usage=answer.usage, timings=answer.timings,
    )
    if verbose_prompt is not None:
        body["__verbose"] = _verbose(resident, answer.first, verbose_prompt,
                                     content=choices[0]["message"]["content"] or "")
    return body


def _verbose(resident: ResidentModel, choice: Choice, prompt: str, *, index: int = 0,
             content: str | None = None) -> dict[str, Any]:
    return openai.verbose_body(
        prompt=prompt, model=resident.model_id, usage=choice.usage, timings=choice.timings,
        finish_reason=choice.finish_reason, matched_stop=choice.matched_stop,
        content=content, index=index)


async def _collect(prepared: PreparedGeneration, choice: Choice, index: int,
                   choices: list[dict[str, Any]]) -> None:
    """One choice, whole, into choices[index]."""
    answer = await choice.whole()
    calls = [_tool_call_body(call) for call in answer.calls]
    text = answer.text
    message = openai.message_body(None if calls and not text.strip() else text,
                                  answer.reasoning or None, calls or None)
    logprobs = answer.logprobs if prepared.params.logprobs is not None else None
    choices[index] = openai.choice_body(index, message, choice.finish_reason, logprobs)


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


class _Chunks:
    """One stream's chunks: its id and creation time."""

    def __init__(self, model_id: str) -> None:
        self.model_id = model_id
        self.completion_id, self.created = new_completion_id(), openai.now()

    def chunk(self, delta: dict[str, Any], index: int, reason: FinishReason | None = None,
              logprobs: LogprobsDelta | None = None, timings: Timings | None = None,
              verbose: dict[str, Any] | None = None) -> bytes:
        body = openai.chunk_body(
            completion_id=self.completion_id, model=self.model_id, created=self.created,
            delta=delta, finish_reason=reason, index=index,
            logprobs=None if logprobs is None else list(logprobs.entries), timings=timings)
        if verbose is not None:
            body["__verbose"] = verbose
        return data_event(body)

    def frame(self, event: Event | Heartbeat | PromptProgress, index: int,
              timings: Timings | None = None, logprobs: LogprobsDelta | None = None) -> Frame:
        """An event's chunks; on the last, `logprobs` (of the tokens whose output it ends,
        as llama-server pairs them) and `timings` (llama-server's `timings_per_token`)."""
        if isinstance(event, PromptProgress):
            return Flush(self.progress(event))
        if isinstance(event, Heartbeat):  # (a quiet spell: what waits goes out)
            return Flush(b"")
        deltas = _deltas(event)
        last = len(deltas) - 1
        return b"".join(self.chunk(delta, index, timings=timings if at == last else None,
                                   logprobs=logprobs if at == last else None)
                        for at, delta in enumerate(deltas))

    def progress(self, progress: PromptProgress) -> bytes:
        return data_event(openai.progress_chunk_body(
            completion_id=self.completion_id, model=self.model_id, created=self.created,
            total=progress.total, cache=progress.cached, processed=progress.processed,
            time_ms=progress.elapsed_ms))

    def usage(self, usage: Usage, timings: Timings) -> bytes:
        return data_event(openai.usage_chunk_body(
            completion_id=self.completion_id, model=self.model_id, created=self.created,
            usage=usage, timings=timings))

    def failed(self, error: ButterError) -> bytes:
        return self.chunk({}, 0, "stop") + data_event(error.openai_body()) + DONE


def stream(
    resident: ResidentModel, prepared: PreparedGeneration, *, include_usage: bool,
    flush_interval: float = 0.0, observer: RequestObserver | None = None,
    return_progress: bool = False, timings_per_token: bool = False,
    verbose_prompt: str | None = None,
) -> AsyncIterator[bytes]:
    """The answer as SSE chunks. `timings_per_token`: llama-server's `timings` on every
    chunk after the first; `verbose_prompt`: its `__verbose` on each choice's last."""
    chunks = _Chunks(resident.model_id)
    frames = _frames(resident, prepared, chunks, include_usage=include_usage,
                     observer=observer, return_progress=return_progress,
                     timings_per_token=timings_per_token, verbose_prompt=verbose_prompt)
    return encoded(frames, flush_interval=flush_interval, failed=chunks.failed)


async def _frames(
    resident: ResidentModel, prepared: PreparedGeneration, chunks: _Chunks, *,
    include_usage: bool, observer: RequestObserver | None, return_progress: bool,
    timings_per_token: bool, verbose_prompt: str | None,
) -> AsyncGenerator[Frame, None]:
    async with answering(resident, prepared, observer) as answer:
        for index, choice in enumerate(answer.choices):
            # (content null, as llama-server sends it: its clients and its tests read that)
            yield Flush(chunks.chunk({"role": "assistant", "content": None}, index))
            # Logprobs ride on the chunk of the event they come just before (the same
            # chunk as their tokens' text), the ones left at the end on the finish chunk.
            logprobs: LogprobsDelta | None = None
            # (the prompt is evaluated once, by the first choice)
            async for event in choice.events(progress=return_progress and index == 0):
                if isinstance(event, LogprobsDelta):
                    logprobs = event
                    continue
                yield chunks.frame(event, index,
                                   choice.timings if timings_per_token else None, logprobs)
                if not isinstance(event, Heartbeat | PromptProgress):
                    logprobs = None
            verbose = (None if verbose_prompt is None
                       else _verbose(resident, choice, verbose_prompt, index=index))
            yield chunks.chunk({}, index, choice.finish_reason, timings=choice.timings,
                               verbose=verbose, logprobs=logprobs)
    # The last chunk carries the answer's timings, as llama-server's does.
    yield (chunks.usage(answer.usage, answer.timings) if include_usage else b"") + DONE
