"""Running a prepared generation on the resident engine: admission, events, outcome."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import attrs
import trio

from butter.chat.markup import Event
from butter.chat.request import FinishReason, Timings, Usage
from butter.engine.engine import EngineStopped
from butter.engine.generation import Generation
from butter.errors import ButterError, ModelReplaced
from butter.pipeline.output import LogprobsDelta, OutputAssembler
from butter.pipeline.prepare import PreparedGeneration, choice_params
from butter.pipeline.resident import ResidentModel


class GenerationFailed(ButterError):
    status = 500


@attrs.define
class RequestObserver:
    """Timing of one request, for metrics and its log line (the server makes one)."""

    route: str
    on_finish: Callable[[RequestObserver, Generation | None, bool], None]
    started: float = attrs.field(factory=time.perf_counter)
    first_output: float | None = None
    tool_calls: int = 0  # parsed from the output (its finish reason says tool_calls)

    @property
    def ttft(self) -> float | None:
        return None if self.first_output is None else self.first_output - self.started

    def output(self) -> None:
        if self.first_output is None:
            self.first_output = time.perf_counter()


@asynccontextmanager
async def running(
    resident: ResidentModel, prepared: PreparedGeneration,
    observer: RequestObserver | None = None,
) -> AsyncIterator[Generation]:
    """The request's generation on the resident engine, admitted and always released."""
    async with running_choices(resident, prepared, observer) as (generation, *_):
        yield generation


@asynccontextmanager
async def running_choices(
    resident: ResidentModel, prepared: PreparedGeneration,
    observer: RequestObserver | None = None,
) -> AsyncIterator[list[Generation]]:
    """The request's `n` generations (one per choice), admitted together, prefilled once,
    always released."""
    generations: list[Generation] = []
    cancelled = False
    try:
        async with resident.engine.generate_choices(
            prepared.prompt, choice_params(prepared.params, prepared.request.n),
            prepared.max_tokens, prompt_top_logprobs=prepared.request.score_prompt,
        ) as generations:
            yield generations
    except EngineStopped as exc:
        raise ModelReplaced(str(exc)) from None
    except (trio.Cancelled, GeneratorExit):  # GeneratorExit: a stream's reader went away
        cancelled = True                       # while its generator waited at a `yield`
        raise
    finally:
        if observer is not None:
            observer.on_finish(observer, generations[0] if generations else None, cancelled)


async def generated_events(
    generation: Generation, assembler: OutputAssembler, *, heartbeat: float | None = None,
    observer: RequestObserver | None = None,
) -> AsyncIterator[Event | LogprobsDelta | None]:
    """Parsed output events, then the logprobs of the tokens they came from (when the
    request asked); None for a heartbeat (no output for `heartbeat` seconds)."""
    async for pieces in generation.pieces(heartbeat=heartbeat):
        if not pieces:
            yield None
            continue
        logprobs = generation.take_logprobs()  # (pushed with these pieces, one each)
        events, used = _feed_until_stop(assembler, pieces)
        if assembler.stopped:  # before any yield: the engine adds nothing more to it
            generation.stop_inside(unused=len(pieces) - used)
        for event in events:
            if observer is not None:
                observer.output()
            yield event
        if logprobs:
            yield LogprobsDelta(tuple(logprobs[:used]))
        if assembler.stopped:
            break  # the engine drops it before the next step
    for event in assembler.finish():
        yield event
    if observer is not None:
        observer.tool_calls += assembler.tool_calls


def _feed_until_stop(assembler: OutputAssembler, pieces: list[bytes]) -> tuple[list[Event], int]:
    """The events of the pieces up to the one that completes a stop string (all of them if
    none does), and how many pieces that took."""
    if not assembler.can_stop:  # (the common case: the batch at once)
        return assembler.feed(pieces), len(pieces)
    events: list[Event] = []
    for used, piece in enumerate(pieces, start=1):
        events += assembler.feed([piece])
        if assembler.stopped:
            return events, used
    return events, len(pieces)


def finish_reason(generation: Generation, assembler: OutputAssembler) -> FinishReason:
    """Why the answer ended; raises if it ended by an error or an unload."""
    if generation.finish_reason == "aborted":
        raise ModelReplaced(generation.error or "the model was unloaded")
    if generation.finish_reason == "error":
        raise GenerationFailed(generation.error or "generation failed")
    if assembler.tool_calls:
        return "tool_calls"
    if assembler.stopped:
        return "stop"
    return "length" if generation.finish_reason == "length" else "stop"


def usage(generation: Generation, *others: Generation) -> Usage:
    """The prompt once (and its cached part as the first choice found it), the completion
    tokens of every choice."""
    return Usage(
        prompt_tokens=generation.prompt_tokens,
        completion_tokens=sum(g.completion_tokens for g in (generation, *others)),
        cached_tokens=generation.cached_tokens,
    )


def timings(generation: Generation) -> Timings:
    """From the engine's timestamps (a generation that never got a session: zeros)."""
    leased = generation.leased_at
    first = generation.first_token_at
    end = generation.finished_at or time.perf_counter()
    prompt_ms = 0.0 if leased is None or first is None else (first - leased) * 1000
    predicted_ms = 0.0 if first is None else (end - first) * 1000
    return Timings(cached_tokens=generation.cached_tokens,
                   prompt_tokens=generation.prompt_tokens - generation.cached_tokens,
                   prompt_ms=prompt_ms, predicted_tokens=generation.completion_tokens,
                   predicted_ms=predicted_ms)
