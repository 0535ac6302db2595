"""The library API: a model in-process, for trio applications.

    model = await butter.Model.load("gemma-3-270m")
    text = await model.generate("Write a haiku", max_tokens=32, seed=1)
    async for piece in model.generate_stream([{"role": "user", "content": "Hi"}]):
        print(piece.text, end="")

A Model owns its engine (a trio system task started by `load`), so in-process calls and
HTTP requests served from the same Model batch together under one admission queue.
Cancelling the calling scope cancels the generation at the next step, exactly like a
client disconnect.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import attrs
import trio

from butter.chat.markup import ContentDelta, Event, ReasoningDelta, ToolCall
from butter.chat.request import FinishReason, TextPrompt, Usage
from butter.pipeline.answer import answering
from butter.pipeline.prepare import PreparedGeneration, prepare
from butter.pipeline.resident import ResidentModel
from butter.protocol import openai
from butter.settings import ServeSettings, usable_cores

log = logging.getLogger("butter")

# The library's default session pool: the README example serves 8 concurrent requests.
DEFAULT_LIBRARY_PARALLEL = 8

Prompt = str | Sequence[Mapping[str, Any]]


@attrs.frozen
class Piece:
    """One piece of a stream: text, reasoning or a tool call; the last one has usage."""

    text: str = ""
    reasoning: str = ""
    tool_call: ToolCall | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None

    @classmethod
    def of(cls, event: Event) -> Piece:
        if isinstance(event, ContentDelta):
            return cls(text=event.text)
        if isinstance(event, ReasoningDelta):
            return cls(reasoning=event.text)
        return cls(tool_call=event)


class Model:
    """A loaded model (its ResidentModel) whose engine runs as a trio system task until
    `aclose`, and generation for trio code. What the library and the server both hold.

    A system task, so that the engine outlives whichever task loaded the model: in-process
    calls and HTTP requests of one model share one engine and one admission queue."""

    def __init__(self, resident: ResidentModel) -> None:
        """Use `await Model.load(...)` or `Model.from_settings(...)`; this wraps an already
        loaded model."""
        self._resident = resident
        self._engine_scope = trio.CancelScope()
        self._engine_done = trio.Event()
        self._closed = False
        trio.lowlevel.spawn_system_task(self._run_engine, name=f"butter engine {self.id}")

    @classmethod
    async def from_settings(cls, settings: ServeSettings, model: str | None = None,
                            path: Path | None = None) -> Self:
        """Load `model` (default: settings.model) in a worker thread; the trio loop keeps
        running meanwhile. `path`: the file `model` names, where resolved already."""
        return cls(await ResidentModel.load(settings, model, path))

    @property
    def id(self) -> str:
        return self._resident.model_id

    @property
    def resident(self) -> ResidentModel:
        """The loaded model's parts (backend, engine, template)."""
        return self._resident

    async def _run_engine(self) -> None:
        try:
            with self._engine_scope:
                await self._resident.engine.step_loop()
        except Exception:  # a bug must not take the whole trio run down with it
            log.exception("the engine of %r stopped", self.id)
        finally:
            self._engine_done.set()

    async def aclose(self, reason: str = "the model was unloaded") -> None:
        """End every request of this model, stop its engine and free its memory."""
        if self._closed:
            return
        self._closed = True
        self._resident.engine.abort_all(reason)
        self._engine_scope.cancel()
        await self._engine_done.wait()
        await trio.to_thread.run_sync(self._resident.close)

    @classmethod
    async def load(
        cls, model: str, *, parallel: int = DEFAULT_LIBRARY_PARALLEL,
        max_context: int | None = None, kv_pool: int | None = None,
        chat_template: str | None = None, threads: int | None = None,
        models_dir: str | None = None, alias: str | None = None,
    ) -> Model:
        """Load any id the CLI resolves (path, --models-dir name, HF cache, demo alias).

        The load runs in a worker thread, so the trio loop keeps running meanwhile.
        """
        settings = ServeSettings(
            model=model, parallel=parallel, max_context=max_context, kv_pool=kv_pool,
            chat_template=chat_template, threads=threads or usable_cores(),
            models_dir=models_dir, alias=alias,
        )
        return await cls.from_settings(settings)

    async def generate(self, prompt: Prompt, **options: Any) -> str:
        """The whole answer's text (see generate_stream for the options)."""
        parts = [piece.text async for piece in self.generate_stream(prompt, **options)]
        return "".join(parts)

    async def generate_stream(self, prompt: Prompt, **options: Any) -> AsyncIterator[Piece]:
        """Pieces as they are generated; the last carries finish_reason and usage.

        `prompt` is raw text (completed as is, no chat template) or chat messages
        (rendered with the model's template). Options are the chat API's request fields:
        max_tokens, temperature, top_p, top_k, min_p, seed, stop, presence_penalty,
        frequency_penalty, repeat_penalty, tools, tool_choice, response_format,
        chat_template_kwargs, reasoning_effort.
        """
        prepared = self._prepare(prompt, options)
        async with answering(self.resident, prepared) as answer:
            async for event in answer.first.events():
                if isinstance(event, Event):  # (not the logprobs)
                    yield Piece.of(event)
        yield Piece(finish_reason=answer.first.finish_reason, usage=answer.first.usage)

    def _prepare(self, prompt: Prompt, options: Mapping[str, Any]) -> PreparedGeneration:
        # Options are validated by the chat request's parser, as an HTTP client's would be.
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        request = openai.parse_chat_request({"messages": list(messages), **options})
        raw = TextPrompt(prompt) if isinstance(prompt, str) else None
        return prepare(self.resident, openai.generation_request(request, prompt=raw))


def generate(model: str, prompt: Prompt, **options: Any) -> str:
    """One-shot, synchronous: load `model`, generate, free it. For scripts."""

    async def once() -> str:
        loaded = await Model.load(model, parallel=1)
        try:
            return await loaded.generate(prompt, **options)
        finally:
            await loaded.aclose()

    return trio.run(once)
