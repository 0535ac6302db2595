"""Ollama's /api/chat and /api/generate: the pipeline's events as NDJSON lines (or one
body), in Ollama's words (butter/protocol/ollama.py)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import attrs

from butter.chat.markup import Event
from butter.pipeline.answer import Answer, answering
from butter.pipeline.output import OutputBlocks
from butter.pipeline.prepare import PreparedGeneration
from butter.pipeline.resident import ResidentModel
from butter.pipeline.run import RequestObserver
from butter.protocol import ollama
from butter.server.streaming import Frame, encoded


@attrs.frozen
class Ending:
    reason: str
    timings: ollama.Timings


def _ending(answer: Answer) -> Ending:
    spent, usage = answer.durations(), answer.usage
    return Ending(ollama.done_reason(answer.first.finish_reason), ollama.Timings(
        total=_ns(spent.total), prompt_eval=_ns(spent.prompt), eval=_ns(spent.answer),
        prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens))


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


# How one route words an answer: a streamed part (no ending: its events so far), or the
# last (or only) body, with its ending.
Shape = Callable[[str, OutputBlocks, Ending | None], dict[str, Any]]


def _chat(model: str, answer: OutputBlocks, ending: Ending | None) -> dict[str, Any]:
    message = ollama.chat_message(answer.text, answer.reasoning, tuple(answer.calls))
    return ollama.chat_body(model, message, **_done(ending))


def _generate(model: str, answer: OutputBlocks, ending: Ending | None) -> dict[str, Any]:
    return ollama.generate_body(model, answer.text, thinking=answer.reasoning,
                                **_done(ending))


def _done(ending: Ending | None) -> dict[str, Any]:
    if ending is None:
        return {"done": False}
    return {"done": True, "reason": ending.reason, "timings": ending.timings}


CHAT: Shape = _chat
GENERATE: Shape = _generate


async def whole(resident: ResidentModel, prepared: PreparedGeneration,
                observer: RequestObserver, shape: Shape) -> dict[str, Any]:
    async with answering(resident, prepared, observer) as answer:
        blocks = await answer.first.whole()
    return shape(resident.model_id, blocks, _ending(answer))


def stream(resident: ResidentModel, prepared: PreparedGeneration, observer: RequestObserver,
           shape: Shape, *, flush_interval: float = 0.0) -> AsyncIterator[bytes]:
    """NDJSON lines; the last one carries the counts, not the text again."""
    return encoded(_lines(resident, prepared, observer, shape), flush_interval=flush_interval,
                   failed=lambda error: ollama.line(ollama.error_body(error.message)))


async def _lines(resident: ResidentModel, prepared: PreparedGeneration,
                 observer: RequestObserver, shape: Shape) -> AsyncGenerator[Frame, None]:
    model = resident.model_id
    async with answering(resident, prepared, observer) as answer:
        async for event in answer.first.events():
            if isinstance(event, Event):  # (Ollama has no logprobs)
                yield ollama.line(shape(model, _part(event), None))
    yield ollama.line(shape(model, OutputBlocks(), _ending(answer)))


def _part(event: Event) -> OutputBlocks:
    part = OutputBlocks()
    part.add(event)
    return part


def model_facts(resident: ResidentModel) -> ollama.ModelFacts:
    meta = resident.metadata()
    description = str(meta["description"])  # e.g. "llama 135M Q4_1"
    words = description.split()
    capabilities = ["completion", "tools"]  # tools: any template, through the preamble
    if resident.template.capabilities.reasoning or "enable_thinking" in resident.template.source:
        capabilities.append("thinking")
    if resident.backend.vision:  # a projector is loaded (--mmproj)
        capabilities.append("vision")
    return ollama.ModelFacts(
        id=resident.model_id, size=int(meta["size_bytes"] or 0),
        architecture=str(meta["architecture"]),
        quantization=words[-1] if len(words) >= 3 else "",
        parameter_size=words[-2] if len(words) >= 3 else "",
        context_length=resident.max_context, template=resident.template.source,
        capabilities=tuple(capabilities))
