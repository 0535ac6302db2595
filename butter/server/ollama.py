"""Ollama's /api/chat and /api/generate: the pipeline's events as NDJSON lines (or one
body), in Ollama's words (butter/protocol/ollama.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import attrs

from butter.chat.markup import ContentDelta, ReasoningDelta, ToolCall
from butter.errors import ButterError
from butter.pipeline.output import OutputAssembler
from butter.pipeline.prepare import PreparedGeneration
from butter.pipeline.resident import ResidentModel
from butter.pipeline.run import RequestObserver, finish_reason, generated_events, running
from butter.protocol import ollama


@attrs.frozen
class Piece:
    """Part of an answer: text, thinking, or one complete tool call."""

    text: str = ""
    thinking: str = ""
    call: tuple[str, str, str] | None = None  # id, name, arguments (JSON text)


@attrs.frozen
class Ending:
    reason: str
    timings: ollama.Timings


async def _answer(resident: ResidentModel, prepared: PreparedGeneration,
                  observer: RequestObserver) -> AsyncIterator[Piece | Ending]:
    async with running(resident, prepared, observer) as generation:
        assembler = OutputAssembler(prepared)
        async for event in generated_events(generation, assembler, observer=observer):
            if isinstance(event, ContentDelta):
                yield Piece(text=event.text)
            elif isinstance(event, ReasoningDelta):
                yield Piece(thinking=event.text)
            elif isinstance(event, ToolCall):
                yield Piece(call=(event.id, event.name, event.arguments))
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


async def chat(resident: ResidentModel, prepared: PreparedGeneration,
               observer: RequestObserver) -> dict[str, Any]:
    text: list[str] = []
    thinking: list[str] = []
    calls: list[tuple[str, str, str]] = []
    async for piece in _answer(resident, prepared, observer):
        if isinstance(piece, Ending):
            message = ollama.chat_message("".join(text), "".join(thinking), tuple(calls))
            return ollama.chat_body(resident.model_id, message, done=True,
                                    reason=piece.reason, timings=piece.timings)
        text.append(piece.text)
        thinking.append(piece.thinking)
        if piece.call:
            calls.append(piece.call)
    raise AssertionError("an answer always ends")  # pragma: no cover


async def chat_stream(resident: ResidentModel, prepared: PreparedGeneration,
                      observer: RequestObserver) -> AsyncIterator[bytes]:
    model = resident.model_id
    try:
        async for piece in _answer(resident, prepared, observer):
            if isinstance(piece, Ending):
                yield ollama.line(ollama.chat_body(model, ollama.chat_message(""), done=True,
                                                   reason=piece.reason, timings=piece.timings))
                return
            calls = (piece.call,) if piece.call else ()
            message = ollama.chat_message(piece.text, piece.thinking, calls)
            yield ollama.line(ollama.chat_body(model, message, done=False))
    except ButterError as exc:  # after the headers went out: Ollama's error line
        yield ollama.line(ollama.error_body(exc.message))


async def generate(resident: ResidentModel, prepared: PreparedGeneration,
                   observer: RequestObserver) -> dict[str, Any]:
    text: list[str] = []
    thinking: list[str] = []
    async for piece in _answer(resident, prepared, observer):
        if isinstance(piece, Ending):
            return ollama.generate_body(resident.model_id, "".join(text),
                                        thinking="".join(thinking), done=True,
                                        reason=piece.reason, timings=piece.timings)
        text.append(piece.text)
        thinking.append(piece.thinking)
    raise AssertionError("an answer always ends")  # pragma: no cover


async def generate_stream(resident: ResidentModel, prepared: PreparedGeneration,
                          observer: RequestObserver) -> AsyncIterator[bytes]:
    model = resident.model_id
    try:
        async for piece in _answer(resident, prepared, observer):
            if isinstance(piece, Ending):
                yield ollama.line(ollama.generate_body(model, "", done=True, reason=piece.reason,
                                                       timings=piece.timings))
                return
            yield ollama.line(ollama.generate_body(model, piece.text, thinking=piece.thinking,
                                                   done=False))
    except ButterError as exc:
        yield ollama.line(ollama.error_body(exc.message))


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
