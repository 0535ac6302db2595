"""A request's answer, as every encoder reads it: each choice's events as they come, then
why it ended, what it cost and how long it took. The encoders (butter/server) only put
these in their API's words; what they mean is decided here, once."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable
from contextlib import aclosing, asynccontextmanager

import attrs

from butter.chat.markup import Event
from butter.chat.request import FinishReason, Logprobs, Timings, Usage
from butter.engine.generation import Generation
from butter.errors import ButterError, ModelReplaced
from butter.pipeline.output import LogprobsDelta, OutputAssembler, OutputBlocks
from butter.pipeline.prepare import PreparedGeneration
from butter.pipeline.resident import ResidentModel
from butter.pipeline.run import RequestObserver, generated_events, running_choices


class GenerationFailed(ButterError):
    """The engine failed the generation (its error says how)."""

    status = 500


# With prompt progress asked for: how often a choice looks at its prompt (seconds).
PROGRESS_POLL_SECONDS = 0.1


@attrs.frozen
class Heartbeat:
    """No output for a while (a long prefill): a stream may write a keep-alive."""


@attrs.frozen
class PromptProgress:
    """How far the prompt's evaluation has come (llama-server's `prompt_progress`)."""

    total: int  # the prompt's tokens
    cached: int  # of them, reused from the cache
    processed: int  # in the KV cache so far, the cached ones too
    elapsed_ms: int  # since the prompt got its session (0 while it waits for one)


# What a choice yields: its output, the logprobs of the tokens behind it, keep-alives and
# prompt progress (each only where asked for). A LogprobsDelta comes just before the event
# it goes with (a stream puts both on one chunk); one after the last event goes with the
# finish (Choice.events says which tokens ride where).
AnswerEvent = Event | LogprobsDelta | Heartbeat | PromptProgress


@attrs.frozen
class Durations:
    """Wall-clock seconds as the client saw them, queueing included (Ollama reports these;
    llama-server's `timings` leave the queue out)."""

    total: float  # from the request's arrival to now
    prompt: float  # from its arrival to its first output
    answer: float  # from its first output to now


class Choice:
    """One choice of an answer: one generation in the engine, its output parsed."""

    def __init__(self, generation: Generation, prepared: PreparedGeneration,
                 observer: RequestObserver, call_id_prefix: str) -> None:
        self._generation = generation
        self._assembler = OutputAssembler(prepared, call_id_prefix=call_id_prefix)
        self._observer = observer
        self._reported = -1  # the last progress reported (processed positions)
        self._scored = prepared.params.logprobs is not None  # the request asked for logprobs

    async def events(self, *, heartbeat: float | None = None,
                     progress: bool = False) -> AsyncIterator[AnswerEvent]:
        """Output events and, when the request asked, the logprobs of their tokens; read
        once. Each LogprobsDelta comes just before the event it goes with: the last event
        of the step (the engine's batch of tokens) that made those tokens. A step whose
        text is all held back (part of a UTF-8 character, what may begin a stop string or
        markup) passes its logprobs on to the next event; those left after the last event
        (the end token, a matched stop string) come last, for the finish.
        `heartbeat`: a Heartbeat whenever that many seconds pass with no output.
        `progress`: PromptProgress while the prompt is evaluated, as llama-server reports
        it: first once the prompt has its session (its cached part known, `processed`
        equal to it), then each advance (looked at every PROGRESS_POLL_SECONDS, a
        Heartbeat when none), and the whole prompt before the first output."""
        reporting = progress
        held: Event | None = None  # the step's last event so far: its logprobs follow it
        carried: list[Logprobs] = []  # logprobs not yet paired with an event
        output = generated_events(
            self._generation, self._assembler, observer=self._observer,
            heartbeat=PROGRESS_POLL_SECONDS if progress else heartbeat)
        async with aclosing(output):
            async for event in output:
                if event is None:
                    if held is not None:  # (a step without logprobs: it goes out now)
                        yield held
                        held = None
                    reports = self._reports(evaluated=False) if reporting else []
                    for report in reports:
                        yield report
                    if not reports:
                        yield Heartbeat()
                    continue
                if reporting:  # anything out means the whole prompt is in the cache
                    reporting = False
                    for report in self._reports(evaluated=True):
                        yield report
                if not self._scored:
                    yield event
                elif isinstance(event, LogprobsDelta):  # (the end of a step)
                    carried.extend(event.entries)
                    if held is not None:
                        yield LogprobsDelta(tuple(carried))
                        yield held
                        held, carried = None, []
                else:
                    if held is not None:
                        yield held
                    held = event
        if held is not None:  # (the answer's last event: what it finished with)
            if carried:
                yield LogprobsDelta(tuple(carried))
                carried = []
            yield held
        if reporting and self._generation.prompt_evaluated:  # (it output no text at all)
            for report in self._reports(evaluated=True):
                yield report
        if carried:
            yield LogprobsDelta(tuple(carried))

    async def whole(self) -> OutputBlocks:
        """Every event, put together (the answer's blocks and logprobs), once it ended."""
        blocks = OutputBlocks()
        async for event in self.events():
            if not isinstance(event, Heartbeat | PromptProgress):
                blocks.add(event)
        return blocks

    async def cache_known(self) -> None:
        """Wait until the cached part of the prompt is known: `usage` counts it from here."""
        await self._generation.attached.wait()

    @property
    def finish_reason(self) -> FinishReason:
        """Why it ended; raises if it ended by an error (GenerationFailed) or an unload
        (ModelReplaced)."""
        generation, assembler = self._generation, self._assembler
        if generation.finish_reason == "aborted":
            raise ModelReplaced(generation.error or "the model was unloaded")
        if generation.finish_reason == "error":
            raise GenerationFailed(generation.error or "generation failed")
        if assembler.tool_calls:
            return "tool_calls"
        if assembler.stopped:
            return "stop"
        return "length" if generation.finish_reason == "length" else "stop"

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended it, if one did."""
        return self._assembler.matched_stop

    @property
    def prompt_logprobs(self) -> list[Logprobs]:
        """The prompt's own logprobs (tokens 1 .. n-1) where it was scored (score_prompt),
        which only the first choice does: known once it has output anything, or ended."""
        return self._generation.prompt_logprobs

    @property
    def usage(self) -> Usage:
        """Its tokens so far: the prompt (and its cached part), its own completion."""
        generation = self._generation
        return Usage(prompt_tokens=generation.prompt_tokens,
                     completion_tokens=generation.completion_tokens,
                     cached_tokens=generation.cached_tokens)

    @property
    def timings(self) -> Timings:
        """llama-server's: the prompt from its session to the first token, the answer from
        there to its end (or now); zeros for a generation that never got a session."""
        generation = self._generation
        leased, first = generation.leased_at, generation.first_token_at
        end = generation.finished_at or time.perf_counter()
        return Timings(
            cached_tokens=generation.cached_tokens,
            prompt_tokens=generation.prompt_tokens - generation.cached_tokens,
            prompt_ms=0.0 if leased is None or first is None else (first - leased) * 1000,
            predicted_tokens=generation.completion_tokens,
            predicted_ms=0.0 if first is None else (end - first) * 1000)

    def progress(self) -> PromptProgress:
        """The prompt's evaluation now: cached positions while it waits for a session, then
        the positions evaluated, then all of them once it has sampled."""
        generation = self._generation
        leased = generation.leased_at
        if generation.prompt_evaluated:
            processed = generation.prompt_tokens
        elif leased is None:
            processed = generation.cached_tokens
        else:
            processed = generation.prompt_tokens - len(generation.pending)
        return PromptProgress(
            total=generation.prompt_tokens, cached=generation.cached_tokens,
            processed=processed, elapsed_ms=0 if leased is None else _ms_since(leased))

    def _reports(self, *, evaluated: bool) -> list[PromptProgress]:
        """The progress reports due now, none before the cached part is known: the first
        (`processed` == `cached`: where the evaluation starts), then the current one if it
        moved on (`evaluated`: the whole prompt)."""
        if not self._generation.attached.is_set():
            return []
        now = self.progress()
        if evaluated:
            now = attrs.evolve(now, processed=self._generation.prompt_tokens)
        reports = []
        if self._reported < 0:
            reports.append(attrs.evolve(now, processed=now.cached))
            self._reported = now.cached
        if now.processed > self._reported:
            reports.append(now)
            self._reported = now.processed
        return reports


class Answer:
    """A request's choices (one, unless it asked for `n`), running in the engine."""

    def __init__(self, choices: list[Choice], observer: RequestObserver) -> None:
        self.choices = choices
        self._observer = observer

    @property
    def first(self) -> Choice:
        """The first choice: the one that evaluates the prompt (the only one for APIs
        without `n`)."""
        return self.choices[0]

    @property
    def usage(self) -> Usage:
        """The prompt once (its cached part as the first choice found it), the completion
        tokens of every choice."""
        return attrs.evolve(self.first.usage, completion_tokens=sum(
            choice.usage.completion_tokens for choice in self.choices))

    @property
    def timings(self) -> Timings:
        return self.first.timings  # (the one that evaluated the prompt)

    def durations(self) -> Durations:
        started, end = self._observer.started, time.perf_counter()
        first = self._observer.first_output or end
        return Durations(total=end - started, prompt=first - started, answer=end - first)


@asynccontextmanager
async def answering(
    resident: ResidentModel, prepared: PreparedGeneration,
    observer: RequestObserver | None = None, *, call_id_prefix: str = "call_",
) -> AsyncIterator[Answer]:
    """The request's answer, its choices admitted together and always released on leaving.
    `call_id_prefix`: how its tool calls' ids begin (the API's convention)."""
    if observer is None:  # (a request nobody logs still has its `durations`)
        observer = RequestObserver(route="")
    async with running_choices(resident, prepared, observer) as generations:
        yield Answer([Choice(generation, prepared, observer, call_id_prefix)
                      for generation in generations], observer)


@attrs.frozen
class PromptAlone:
    """The answer to a request that generates and scores nothing (max_tokens 0: a
    completion that only echoes its prompt): the engine is never asked."""

    usage: Usage
    finish_reason: FinishReason = "length"


def prompt_alone(prepared: PreparedGeneration) -> PromptAlone | None:
    """The answer without the engine, where the request needs none; else None."""
    if prepared.max_tokens != 0 or prepared.request.score_prompt is not None:
        return None
    return PromptAlone(Usage(prompt_tokens=len(prepared.prompt), completion_tokens=0,
                             cached_tokens=0))


def total_usage(usages: Iterable[Usage]) -> Usage:
    """Several prompts' answers (a completions request with a list of prompts): every
    prompt counts, unlike an answer's choices, which share theirs."""
    usages = list(usages)
    return Usage(prompt_tokens=sum(usage.prompt_tokens for usage in usages),
                 completion_tokens=sum(usage.completion_tokens for usage in usages),
                 cached_tokens=sum(usage.cached_tokens for usage in usages))


def _ms_since(start: float) -> int:
    return int((time.perf_counter() - start) * 1000)
