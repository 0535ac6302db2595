"""Ollama's /api/chat and /api/generate: the pipeline's events as NDJSON lines (or one
body), in Ollama's words (butter/protocol/ollama.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import attrs

from butter.chat.markup import ContentDelta, ReasoningDelta, ToolCall
from butter.pipeline.output import OutputAssembler
from butter.pipeline.prepare import PreparedGeneration
from butter.pipeline.resident import ResidentModel
from butter.pipeline.run import RequestObserver, finish_reason, generated_events, running
from butter.protocol import ollama
from butter.server.streaming import Frame, encoded


@attrs.frozen
class Piece:
    """Part of an answer: text, thinking, or one complete tool call."""

    text: str = ""
    thinking: str = ""
    call: ToolCall | None = None


@attrs.frozen
class Ending:
    reason: str
    timings: ollama.Timings


async def _answer(resident: ResidentModel, prepared: PreparedGeneration,
                  observer: RequestObserver) -> AsyncGenerator[Piece | Ending, None]:
    async with running(resident, prepared, observer) as generation:
        assembler = OutputAssembler(prepared)
        async for event in generated_events(generation, assembler, observer=observer):
            if isinstance(event, ContentDelta):
                yield Piece(text=event.text)
            elif isinstance(event, ReasoningDelta):
                yield Piece(thinking=event.text)
            elif isinstance(event, ToolCall):
                yield Piece(call=event)
    reason = ollama.done_reason(finish_reason(generation, assembler))
    yield Ending(reason, _timings(observer, generation.prompt_tokens,
                                  generation.completion_tokens))


def _timings(observer: RequestObserver, prompt_tokens: int, completion_tokens: int
             ) -> ollama.Timings:
    end = time.perf_counter()
    first = observer.first_output or end
    return ollama.Timings(total=_ns(end - observer.started),
                          prompt_eval=_ns(first - observer.started), eval=_ns(end - first),
                          prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


@attrs.define
class Collected:
    """An answer so far: its text, its thinking, its complete tool calls."""

    text: list[str] = attrs.field(factory=list)
    thinking: list[str] = attrs.field(factory=list)
    calls: list[ToolCall] = attrs.field(factory=list)

    def add(self, piece: Piece) -> None:
        self.text.append(piece.text)
        self.thinking.append(piece.thinking)
        if piece.call:
            self.calls.append(piece.call)


@attrs.frozen
class Shape:
    """How one route words an answer: a streamed part, and the last (or only) body."""

    part: Callable[[str, Piece], dict[str, Any]]
    end: Callable[[str, Collected, Ending], dict[str, Any]]


CHAT = Shape(
    part=lambda model, piece: ollama.chat_body(model, ollama.chat_message(
        piece.text, piece.thinking, (piece.call,) if piece.call else ()), done=False),
    end=lambda model, answer, ending: ollama.chat_body(model, ollama.chat_message(
        "".join(answer.text), "".join(answer.thinking), tuple(answer.calls)), done=True,
        reason=ending.reason, timings=ending.timings),
)
GENERATE = Shape(
    part=lambda model, piece: ollama.generate_body(model, piece.text, thinking=piece.thinking,
                                                   done=False),
    end=lambda model, answer, ending: ollama.generate_body(
        model, "".join(answer.text), thinking="".join(answer.thinking), done=True,
        reason=ending.reason, timings=ending.timings),
)


async def whole(resident: ResidentModel, prepared: PreparedGeneration,
                observer: RequestObserver, shape: Shape) -> dict[str, Any]:
    answer = Collected()
    async with aclosing(_answer(resident, prepared, observer)) as pieces:
        async for piece in pieces:
            if isinstance(piece, Ending):
                return shape.end(resident.model_id, answer, piece)
            answer.add(piece)
    raise AssertionError("an answer always ends")  # pragma: no cover


def stream(resident: ResidentModel, prepared: PreparedGeneration, observer: RequestObserver,
           shape: Shape, *, flush_interval: float = 0.0) -> AsyncIterator[bytes]:
    """NDJSON lines; the last one carries the counts, not the text again."""
    return encoded(_lines(resident, prepared, observer, shape), flush_interval=flush_interval,
                   failed=lambda error: ollama.line(ollama.error_body(error.message)))


async def _lines(resident: ResidentModel, prepared: PreparedGeneration,
                 observer: RequestObserver, shape: Shape) -> AsyncGenerator[Frame, None]:
    model = resident.model_id
    answer = _answer(resident, prepared, observer)
    async with aclosing(answer):
        async for piece in answer:
            if isinstance(piece, Ending):
                yield ollama.line(shape.end(model, Collected(), piece))
            else:
                yield ollama.line(shape.part(model, piece))


def model_facts(resident: ResidentModel) -> ollama.ModelFacts:
    meta = resident.metadata()
    description = str(meta["description"])  # e.g. "llama 135M Q4_1"
    words = description.split()
    capabilities = ["completion", "tools"]  # tools: any template, through the preamble
    if resident.template.capabilities.reasoning or "enable_thinking" in resident.template.source:
        capabilities.append("thinking")
    return ollama.ModelFacts(
        id=resident.model_id, size=int(meta["size_bytes"] or 0),
        architecture=str(meta["architecture"]),
        quantization=words[-1] if len(words) >= 3 else "",
        parameter_size=words[-2] if len(words) >= 3 else "",
        context_length=resident.max_context, template=resident.template.source,
        capabilities=tuple(capabilities))
