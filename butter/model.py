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
from typing import Any

import attrs
import trio

from butter.chat.markup import ContentDelta, ReasoningDelta, ToolCall
from butter.protocol import openai
from butter.server import chat_completions as chat
from butter.server.resident import ResidentModel
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
    finish_reason: str | None = None
    usage: openai.Usage | None = None


class Model:
    def __init__(self, resident: ResidentModel) -> None:
        """Use `await Model.load(...)`; this wraps an already loaded model."""
        self._resident = resident
        self._engine_scope = trio.CancelScope()
        self._engine_done = trio.Event()
        self._closed = False
        trio.lowlevel.spawn_system_task(self._run_engine, name=f"butter engine {self.id}")

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

    @classmethod
    async def from_settings(cls, settings: ServeSettings, model: str | None = None) -> Model:
        return cls(await ResidentModel.load(settings, model))

    @property
    def id(self) -> str:
        return self._resident.model_id

    @property
    def resident(self) -> ResidentModel:
        """The loaded model's parts (backend, engine, template), for servers."""
        return self._resident

    async def _run_engine(self) -> None:
        try:
            with self._engine_scope:
                await self._resident.engine.run()
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

    # ------------------------------------------------------------------ generation

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
        assembler = chat.OutputAssembler(prepared)
        async with chat.running(self._resident, prepared) as generation:
            async for event in chat.generated_events(generation, assembler):
                if isinstance(event, ContentDelta):
                    yield Piece(text=event.text)
                elif isinstance(event, ReasoningDelta):
                    yield Piece(reasoning=event.text)
                elif isinstance(event, ToolCall):
                    yield Piece(tool_call=event)
        yield Piece(finish_reason=chat.finish_reason(generation, assembler),
                    usage=chat.usage(generation))

    def _prepare(self, prompt: Prompt, options: Mapping[str, Any]) -> chat.PreparedChat:
        if isinstance(prompt, str):
            # Validate the options through the chat parser, then complete the raw text.
            request = openai.parse_chat_request(
                {"messages": [{"role": "user", "content": prompt}], **options}
            )
            tokens = self._resident.tokenize_prompt(prompt)
            return chat.prepare_tokens(self._resident, request, tokens)
        request = openai.parse_chat_request({"messages": list(prompt), **options})
        return chat.prepare(self._resident, request)


def generate(model: str, prompt: Prompt, **options: Any) -> str:
    """One-shot, synchronous: load `model`, generate, free it. For scripts."""

    async def once() -> str:
        loaded = await Model.load(model, parallel=1)
        try:
            return await loaded.generate(prompt, **options)
        finally:
            await loaded.aclose()

    return trio.run(once)
