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

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import attrs
import trio

from butter.chat.markup import ContentDelta, Event, ReasoningDelta, ToolCall
from butter.chat.request import FinishReason, TextPrompt, Usage
from butter.pipeline.answer import answering
from butter.pipeline.loaded import LoadedModel
from butter.pipeline.prepare import PreparedGeneration, prepare
from butter.protocol import openai
from butter.settings import ServeSettings, usable_cores

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


class Model(LoadedModel):
    """A loaded model with its engine running, and generation for trio code."""

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
