"""POST /v1/completions: raw prompts through the pipeline, legacy text_completion bodies.

Choices are numbered prompt by prompt: prompt i's `n` choices are i*n ... i*n + n-1.
Streams send each choice's chunks in turn (clients reassemble by `index`)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

import trio

from butter.chat.markup import ContentDelta
from butter.chat.request import Logprobs, TextPrompt, Usage
from butter.engine.generation import Generation
from butter.errors import ButterError
from butter.pipeline.output import LogprobsDelta, OutputAssembler
from butter.pipeline.prepare import PreparedGeneration
from butter.pipeline.resident import ResidentModel
from butter.pipeline.run import (
    RequestObserver,
    finish_reason,
    generated_events,
    running_choices,
    usage,
)
from butter.protocol import completions as wire
from butter.protocol import openai
from butter.protocol.sse import DONE, data_event
from butter.server.streaming import Flush, Frame, encoded


def new_completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def _echo(prepared: PreparedGeneration, echo: bool) -> str:
    prompt = prepared.request.prompt
    if not echo:
        return ""
    if isinstance(prompt, TextPrompt):
        return prompt.text
    return prepared.token_prompt_text or ""


async def complete(
    resident: ResidentModel, prepared: list[PreparedGeneration], *, echo: bool,
    observer: RequestObserver | None = None,
) -> dict[str, Any]:
    choices: list[dict[str, Any]] = []
    usages: list[Usage] = []
    async with trio.open_nursery() as nursery:
        for prompt_index, one in enumerate(prepared):
            nursery.start_soon(_complete_prompt, resident, one, prompt_index * one.request.n,
                               echo, observer, choices, usages)
    choices.sort(key=lambda choice: int(choice["index"]))
    return wire.completion_body(
        completion_id=new_completion_id(), model=resident.model_id, created=openai.now(),
        choices=choices, usage=_total(usages))


async def _complete_prompt(
    resident: ResidentModel, prepared: PreparedGeneration, first: int, echo: bool,
    observer: RequestObserver | None, choices: list[dict[str, Any]], usages: list[Usage],
) -> None:
    """One prompt's choices, numbered from `first`."""
    if prepared.max_tokens == 0 and prepared.request.score_prompt is None:  # echo only
        choices.append(wire.choice_body(first, _echo(prepared, echo), "length", None))
        usages.append(Usage(len(prepared.prompt), 0, 0))
        return
    async with running_choices(resident, prepared, observer) as generations:
        for offset, generation in enumerate(generations):
            choices.append(await _choice(prepared, generation, generations[0],
                                         first + offset, echo, observer))
    usages.append(usage(*generations))


async def _choice(prepared: PreparedGeneration, generation: Generation, scorer: Generation,
                  index: int, echo: bool, observer: RequestObserver | None
                  ) -> dict[str, Any]:
    assembler = OutputAssembler(prepared)
    text = [_echo(prepared, echo)]
    logprobs: list[Logprobs] = []
    async for event in generated_events(generation, assembler, observer=observer):
        if isinstance(event, LogprobsDelta):
            logprobs.extend(event.entries)
        elif isinstance(event, ContentDelta):  # (a raw prompt's output is text only)
            text.append(event.text)
    reason = finish_reason(generation, assembler)
    if prepared.params.logprobs is None:
        return wire.choice_body(index, "".join(text), reason, None)
    if prepared.request.score_prompt is None:
        return wire.choice_body(index, "".join(text), reason,
                                wire.logprobs_body(logprobs, len(text[0])))
    prompt = scorer.prompt_logprobs  # the echoed prompt's own, then the generated tokens'
    body = wire.logprobs_body([*prompt, *logprobs], 0,
                              first_token=wire.first_token_text(text[0], prompt))
    return wire.choice_body(index, "".join(text), reason, body)


def _total(usages: list[Usage]) -> Usage:
    return Usage(sum(u.prompt_tokens for u in usages),
                 sum(u.completion_tokens for u in usages),
                 sum(u.cached_tokens for u in usages))


class _Chunks:
    """One stream's chunks: its id and creation time."""

    def __init__(self, model_id: str) -> None:
        self.model_id = model_id
        self.completion_id, self.created = new_completion_id(), openai.now()

    def chunk(self, index: int, text: str, reason: Any = None,
              logprobs: dict[str, Any] | None = None) -> bytes:
        return data_event(wire.completion_body(
            completion_id=self.completion_id, model=self.model_id, created=self.created,
            choices=[wire.choice_body(index, text, reason, logprobs)], usage=None))

    def usage(self, usages: list[Usage]) -> bytes:
        return data_event(wire.completion_body(
            completion_id=self.completion_id, model=self.model_id, created=self.created,
            choices=[], usage=_total(usages)))

    def failed(self, error: ButterError) -> bytes:
        return data_event(error.openai_body()) + DONE


def stream(
    resident: ResidentModel, prepared: list[PreparedGeneration], *, echo: bool,
    include_usage: bool, flush_interval: float = 0.0,
    observer: RequestObserver | None = None,
) -> AsyncIterator[bytes]:
    chunks = _Chunks(resident.model_id)
    frames = _frames(resident, prepared, chunks, echo=echo, include_usage=include_usage,
                     observer=observer)
    return encoded(frames, flush_interval=flush_interval, failed=chunks.failed)


async def _frames(
    resident: ResidentModel, prepared: list[PreparedGeneration], chunks: _Chunks, *,
    echo: bool, include_usage: bool, observer: RequestObserver | None,
) -> AsyncGenerator[Frame, None]:
    usages: list[Usage] = []
    for prompt_index, one in enumerate(prepared):
        first = prompt_index * one.request.n
        if one.max_tokens == 0 and one.request.score_prompt is None:
            yield Flush(chunks.chunk(first, _echo(one, echo), "length"))
            usages.append(Usage(len(one.prompt), 0, 0))
            continue
        async with running_choices(resident, one, observer) as generations:
            for offset, generation in enumerate(generations):
                choice = _choice_frames(one, generation, generations[0], chunks,
                                        first + offset, echo, observer)
                async with aclosing(choice):
                    async for frame in choice:
                        yield frame
        usages.append(usage(*generations))
    yield (chunks.usage(usages) if include_usage else b"") + DONE


async def _choice_frames(
    prepared: PreparedGeneration, generation: Generation, scorer: Generation,
    chunks: _Chunks, index: int, echo: bool, observer: RequestObserver | None,
) -> AsyncGenerator[Frame, None]:
    """One choice's chunks: the echoed prompt (once its scores are known), the text and
    its logprobs, the finish reason."""
    written = len(_echo(prepared, echo))
    logged = written  # where the tokens of the next logprobs begin
    echoed = not echo
    assembler = OutputAssembler(prepared)
    async for event in generated_events(generation, assembler, observer=observer):
        if not echoed:  # (the prompt's scores are known from here on)
            echoed = True
            yield Flush(_echo_chunk(chunks, index, prepared, scorer))
        if isinstance(event, LogprobsDelta):
            yield chunks.chunk(index, "", logprobs=wire.logprobs_body(list(event.entries),
                                                                      logged))
            logged = written
        elif isinstance(event, ContentDelta):
            yield chunks.chunk(index, event.text)
            written += len(event.text)
    if not echoed:
        yield _echo_chunk(chunks, index, prepared, scorer)
    yield chunks.chunk(index, "", finish_reason(generation, assembler))


def _echo_chunk(chunks: _Chunks, index: int, prepared: PreparedGeneration,
                scorer: Generation) -> bytes:
    """The echoed prompt, with its own logprobs when they were asked for."""
    text = _echo(prepared, True)
    if prepared.request.score_prompt is None:
        return chunks.chunk(index, text)
    prompt = scorer.prompt_logprobs
    return chunks.chunk(index, text, logprobs=wire.logprobs_body(
        prompt, 0, first_token=wire.first_token_text(text, prompt)))
