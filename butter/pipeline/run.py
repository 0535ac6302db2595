"""Running a prepared generation on the resident engine: admission, events, the log's
outcome. (What encoders read of a running request is butter/pipeline/answer.py.)"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager

import attrs
import trio

from butter.chat.markup import Event
from butter.chat.request import Usage
from butter.engine.engine import EngineStopped
from butter.engine.generation import Generation
from butter.errors import ModelReplaced
from butter.pipeline.output import LogprobsDelta, OutputAssembler
from butter.pipeline.prepare import PreparedGeneration, choice_params
from butter.pipeline.resident import ResidentModel


@attrs.frozen
class Outcome:
    """How a request ended, as its log line says it: its first choice, as the engine saw
    it. The server logs this, never the engine's request itself."""

    # The engine's ending ("stop", "length", "error", "aborted"), "tool_calls" for a stop
    # that called tools; None: not ended yet (its client left).
    finish: str | None
    usage: Usage
    drafted_tokens: int
    accepted_tokens: int

    @classmethod
    def of(cls, generation: Generation, tool_calls: int) -> Outcome:
        finish = generation.finish_reason
        return cls(
            finish="tool_calls" if tool_calls and finish == "stop" else finish,
            usage=Usage(generation.prompt_tokens, generation.completion_tokens,
                        generation.cached_tokens),
            drafted_tokens=generation.drafted_tokens,
            accepted_tokens=generation.accepted_tokens)


def _unlogged(observer: RequestObserver, outcome: Outcome | None, cancelled: bool) -> None:
    """A request nobody logs (the library's)."""


@attrs.define
class RequestObserver:
    """Timing of one request, for metrics and its log line (the server makes one)."""

    route: str
    # Called once the request's generations are released: its outcome (None: it was never
    # admitted) and whether its client left.
    on_finish: Callable[[RequestObserver, Outcome | None, bool], None] = _unlogged
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
            checkpoint_hints=prepared.checkpoint_hints, images=prepared.images,
        ) as generations:
            yield generations
    except EngineStopped as exc:
        raise ModelReplaced(str(exc)) from None
    except (trio.Cancelled, GeneratorExit):  # GeneratorExit: a stream's reader went away
        cancelled = True                       # while its generator waited at a `yield`
        raise
    finally:
        if observer is not None:
            outcome = Outcome.of(generations[0], observer.tool_calls) if generations else None
            observer.on_finish(observer, outcome, cancelled)


async def generated_events(
    generation: Generation, assembler: OutputAssembler, *, heartbeat: float | None = None,
    observer: RequestObserver | None = None,
) -> AsyncGenerator[Event | LogprobsDelta | None, None]:
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
    for event in assembler.finish(cut=generation.finish_reason == "length"):
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
