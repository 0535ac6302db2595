"""POST /v1/chat/completions: request → prompt → engine → JSON body or SSE stream."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from butter.chat import grammar as grammars
from butter.chat.detokenize import IncrementalDetokenizer
from butter.chat.markup import (
    THINK_OPEN,
    ContentDelta,
    Event,
    MarkupParser,
    ReasoningDelta,
    ToolCall,
)
from butter.chat.stops import StopMatcher
from butter.engine.engine import EngineStopped, Generation
from butter.errors import ButterError, ContextLengthExceeded, InvalidRequest, ModelReplaced
from butter.protocol import openai
from butter.protocol.sse import DONE, data_event
from butter.sampling import SamplingParams
from butter.server.coalesce import FrameCoalescer
from butter.server.resident import ResidentModel


class GenerationFailed(ButterError):
    status = 500


@attrs.frozen
class PreparedChat:
    request: openai.ChatCompletionRequest
    prompt: list[int]
    params: SamplingParams
    starts_in_reasoning: bool  # the template opened a <think> block in the prompt
    completion_id: str
    created: int


def prepare(resident: ResidentModel, request: openai.ChatCompletionRequest) -> PreparedChat:
    """Render the messages with the chat template, tokenize, check, choose a grammar."""
    text = resident.template.render(
        openai.template_messages(request), tools=openai.template_tools(request),
        template_kwargs={**resident.template_defaults, **openai.template_kwargs(request)},
    )
    return prepare_tokens(resident, request, resident.tokenize_prompt(text),
                          starts_in_reasoning=text.rstrip().endswith(THINK_OPEN))


def prepare_tokens(
    resident: ResidentModel, request: openai.ChatCompletionRequest, prompt: list[int],
    *, starts_in_reasoning: bool = False,
) -> PreparedChat:
    """A request whose prompt tokens are already known (raw completions, too)."""
    check_fits(len(prompt), request.requested_max_tokens, resident.max_context)
    params = attrs.evolve(openai.sampling_params(request), grammar=output_grammar(request))
    try:
        resident.backend.check_sampling(params)
    except ValueError as exc:
        raise InvalidRequest(f"cannot serve this request: {exc}") from None
    return PreparedChat(
        request=request, prompt=prompt, params=params, starts_in_reasoning=starts_in_reasoning,
        completion_id=f"chatcmpl-{uuid.uuid4().hex}", created=openai.now(),
    )


def output_grammar(request: openai.ChatCompletionRequest) -> str | None:
    """A grammar for `tool_choice` required / named, or for `response_format` JSON."""
    forced = openai.forced_tool(request)
    wants_call = request.tool_choice == "required" or forced is not None
    response_format = request.response_format
    wants_json = response_format is not None and response_format.type != "text"
    if wants_call and wants_json:
        raise InvalidRequest("tool_choice that forces a call cannot be combined with a JSON "
                             "response_format", param="response_format")
    if wants_call:
        if not request.tools:
            raise InvalidRequest("tool_choice requires tools", param="tool_choice")
        tools = [openai.template_tool(tool) for tool in request.tools]
        return grammars.tool_call_grammar(tools, forced)
    if response_format is None or not wants_json:
        return None
    if response_format.type == "json_object":
        return grammars.json_object_grammar()
    return grammars.json_schema_grammar((response_format.json_schema or {})["schema"])


def check_fits(prompt_tokens: int, max_tokens: int | None, max_context: int) -> None:
    wanted = prompt_tokens + (max_tokens or 1)
    if wanted > max_context:
        raise ContextLengthExceeded(
            f"this request needs {prompt_tokens} prompt tokens + {max_tokens or 1} completion "
            f"tokens = {wanted}, but the maximum context is {max_context} tokens",
            param="messages",
        )


class OutputAssembler:
    """Token pieces → events: UTF-8 safe, stop strings cut, think blocks and tool calls
    recovered, never a partial tag or stop string emitted."""

    def __init__(self, chat: PreparedChat, *, call_id_prefix: str = "call_") -> None:
        self._detokenizer = IncrementalDetokenizer()
        self._stops = StopMatcher(chat.request.stop_strings)
        self._markup = MarkupParser(
            openai.tool_schemas(chat.request), start_in_reasoning=chat.starts_in_reasoning,
            new_call_id=lambda _: f"{call_id_prefix}{uuid.uuid4().hex[:24]}",
        )

    @property
    def stopped(self) -> bool:
        return self._stops.matched is not None

    @property
    def matched_stop(self) -> str | None:
        return self._stops.matched

    @property
    def tool_calls(self) -> int:
        return self._markup.tool_calls

    def feed(self, pieces: list[bytes]) -> list[Event]:
        return self._markup.feed(self._stops.feed(self._detokenizer.feed(b"".join(pieces))))

    def finish(self) -> list[Event]:
        tail = self._stops.feed(self._detokenizer.flush()) + self._stops.flush()
        return self._markup.feed(tail) + self._markup.finish()


async def generated_events(
    generation: Generation, assembler: OutputAssembler, *, heartbeat: float | None = None,
    observer: RequestObserver | None = None,
) -> AsyncIterator[Event | None]:
    """Parsed output events; None for a heartbeat (no output for `heartbeat` seconds)."""
    async for pieces in generation.pieces(heartbeat=heartbeat):
        if not pieces:
            yield None
            continue
        for event in assembler.feed(pieces):
            if observer is not None:
                observer.output()
            yield event
        if assembler.stopped:
            generation.close()  # the engine drops it before the next step
            break
    for event in assembler.finish():
        yield event


@attrs.define
class RequestObserver:
    """Timing of one request for metrics and its log line (the HTTP layer makes one)."""

    route: str
    on_finish: Callable[[RequestObserver, Generation | None, bool], None]
    started: float = attrs.field(factory=time.perf_counter)
    first_output: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_output is None else self.first_output - self.started

    def output(self) -> None:
        if self.first_output is None:
            self.first_output = time.perf_counter()


@asynccontextmanager
async def running(
    resident: ResidentModel, chat: PreparedChat, observer: RequestObserver | None = None
) -> AsyncIterator[Generation]:
    """The request's generation on the resident engine, admitted and always released."""
    generation: Generation | None = None
    cancelled = False
    try:
        async with resident.engine.generate(
            chat.prompt, chat.params, chat.request.requested_max_tokens
        ) as generation:
            yield generation
    except EngineStopped as exc:
        raise ModelReplaced(str(exc)) from None
    except trio.Cancelled:
        cancelled = True
        raise
    finally:
        if observer is not None:
            observer.on_finish(observer, generation, cancelled)


def finish_reason(generation: Generation, assembler: OutputAssembler) -> openai.FinishReason:
    if generation.finish_reason == "aborted":
        raise ModelReplaced(generation.error or "the model was unloaded")
    if generation.finish_reason == "error":
        raise GenerationFailed(generation.error or "generation failed")
    if assembler.tool_calls:
        return "tool_calls"
    if assembler.stopped:
        return "stop"
    return "length" if generation.finish_reason == "length" else "stop"


def usage(generation: Generation) -> openai.Usage:
    return openai.Usage(
        prompt_tokens=generation.prompt_tokens,
        completion_tokens=generation.completion_tokens,
        cached_tokens=generation.cached_tokens,
    )


def _tool_call_body(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


async def complete(
    resident: ResidentModel, chat: PreparedChat, observer: RequestObserver | None = None
) -> dict[str, Any]:
    assembler = OutputAssembler(chat)
    content: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    async with running(resident, chat, observer) as generation:
        async for event in generated_events(generation, assembler, observer=observer):
            if isinstance(event, ContentDelta):
                content.append(event.text)
            elif isinstance(event, ReasoningDelta):
                reasoning.append(event.text)
            elif isinstance(event, ToolCall):
                calls.append(_tool_call_body(event))
    text = "".join(content)
    return openai.completion_body(
        completion_id=chat.completion_id, model=resident.model_id, created=chat.created,
        content=None if calls and not text.strip() else text,
        reasoning_content="".join(reasoning) or None, tool_calls=calls or None,
        finish_reason=finish_reason(generation, assembler), usage=usage(generation),
    )


def _deltas(event: Event) -> list[dict[str, Any]]:
    if isinstance(event, ContentDelta):
        return [{"content": event.text}]
    if isinstance(event, ReasoningDelta):
        return [{"reasoning_content": event.text}]
    # A call is two deltas: who is called, then its arguments (clients concatenate those).
    opening = {"index": event.index, "id": event.id, "type": "function",
               "function": {"name": event.name, "arguments": ""}}
    arguments = {"index": event.index, "function": {"arguments": event.arguments}}
    return [{"tool_calls": [opening]}, {"tool_calls": [arguments]}]


async def stream(
    resident: ResidentModel, chat: PreparedChat, *, flush_interval: float = 0.0,
    observer: RequestObserver | None = None,
) -> AsyncIterator[bytes]:
    assembler = OutputAssembler(chat)
    frames = FrameCoalescer(flush_interval)

    def chunk(delta: dict[str, Any], reason: openai.FinishReason | None = None) -> bytes:
        return data_event(openai.chunk_body(
            completion_id=chat.completion_id, model=resident.model_id, created=chat.created,
            delta=delta, finish_reason=reason,
        ))

    try:
        async with running(resident, chat, observer) as generation:
            yield chunk({"role": "assistant", "content": ""})
            async for event in generated_events(generation, assembler, observer=observer):
                if event is None:
                    continue
                ready = frames.add(b"".join(chunk(delta) for delta in _deltas(event)))
                if ready:
                    yield ready
        reason = finish_reason(generation, assembler)
    except ButterError as exc:  # after the headers went out: end cleanly, then say why
        yield frames.take() + chunk({}, "stop") + data_event(exc.openai_body()) + DONE
        return
    tail = frames.take() + chunk({}, reason)
    if chat.request.include_usage:
        tail += data_event(openai.usage_chunk_body(
            completion_id=chat.completion_id, model=resident.model_id, created=chat.created,
            usage=usage(generation),
        ))
    yield tail + DONE
