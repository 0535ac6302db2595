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
from butter.chat.request import TextPrompt, Usage
from butter.errors import ButterError
from butter.pipeline.answer import Answer, Choice, answering, prompt_alone, total_usage
from butter.pipeline.output import LogprobsDelta
from butter.pipeline.prepare import PreparedGeneration
from butter.pipeline.resident import ResidentModel
from butter.pipeline.run import RequestObserver
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
        choices=choices, usage=total_usage(usages))


async def _complete_prompt(
    resident: ResidentModel, prepared: PreparedGeneration, first: int, echo: bool,
    observer: RequestObserver | None, choices: list[dict[str, Any]], usages: list[Usage],
) -> None:
    """One prompt's choices, numbered from `first`."""
    if alone := prompt_alone(prepared):  # (an echo alone)
        choices.append(wire.choice_body(first, _echo(prepared, echo), alone.finish_reason,
                                        None))
        usages.append(alone.usage)
        return
    async with answering(resident, prepared, observer) as answer:
        for offset, choice in enumerate(answer.choices):
            choices.append(await _choice(prepared, answer, choice, first + offset, echo))
    usages.append(answer.usage)


async def _choice(prepared: PreparedGeneration, answer: Answer, choice: Choice, index: int,
                  echo: bool) -> dict[str, Any]:
    echoed = _echo(prepared, echo)
    whole = await choice.whole()  # (a raw prompt's output is text only)
    text = echoed + whole.text
    if prepared.params.logprobs is None:
        return wire.choice_body(index, text, choice.finish_reason, None)
    if prepared.request.score_prompt is None:
        return wire.choice_body(index, text, choice.finish_reason,
                                wire.logprobs_body(whole.logprobs, len(echoed)))
    prompt = answer.first.prompt_logprobs  # the echoed prompt's own, then the answer's
    body = wire.logprobs_body([*prompt, *whole.logprobs], 0,
                              first_token=wire.first_token_text(echoed, prompt))
    return wire.choice_body(index, text, choice.finish_reason, body)


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

    def usage(self, usage: Usage) -> bytes:
        return data_event(wire.completion_body(
            completion_id=self.completion_id, model=self.model_id, created=self.created,
            choices=[], usage=usage))

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
        if alone := prompt_alone(one):
            yield Flush(chunks.chunk(first, _echo(one, echo), alone.finish_reason))
            usages.append(alone.usage)
            continue
        async with answering(resident, one, observer) as answer:
            for offset, choice in enumerate(answer.choices):
                frames = _choice_frames(one, answer, choice, chunks, first + offset, echo)
                async with aclosing(frames):
                    async for frame in frames:
                        yield frame
        usages.append(answer.usage)
    yield (chunks.usage(total_usage(usages)) if include_usage else b"") + DONE


async def _choice_frames(
    prepared: PreparedGeneration, answer: Answer, choice: Choice, chunks: _Chunks,
    index: int, echo: bool,
) -> AsyncGenerator[Frame, None]:
    """One choice's chunks: the echoed prompt (once its scores are known), the text with
    the logprobs of the tokens it ends (those left at the end on the finish chunk), the
    finish reason."""
    written = len(_echo(prepared, echo))
    logged = written  # where the tokens of the next logprobs begin
    echoed = not echo
    logprobs: LogprobsDelta | None = None  # (they go with the next text)

    def scored() -> dict[str, Any] | None:
        return None if logprobs is None else wire.logprobs_body(list(logprobs.entries),
                                                                logged)

    async for event in choice.events():
        if not echoed:  # (the prompt's scores are known from here on)
            echoed = True
            yield Flush(_echo_chunk(chunks, index, prepared, answer))
        if isinstance(event, LogprobsDelta):
            logprobs = event
        elif isinstance(event, ContentDelta):
            yield chunks.chunk(index, event.text, logprobs=scored())
            written += len(event.text)
            if logprobs is not None:
                logged, logprobs = written, None
    if not echoed:
        yield _echo_chunk(chunks, index, prepared, answer)
    yield chunks.chunk(index, "", choice.finish_reason, logprobs=scored())


def _echo_chunk(chunks: _Chunks, index: int, prepared: PreparedGeneration,
                answer: Answer) -> bytes:
    """The echoed prompt, with its own logprobs when they were asked for."""
    text = _echo(prepared, True)
    if prepared.request.score_prompt is None:
        return chunks.chunk(index, text)
    prompt = answer.first.prompt_logprobs
    return chunks.chunk(index, text, logprobs=wire.logprobs_body(
        prompt, 0, first_token=wire.first_token_text(text, prompt)))
