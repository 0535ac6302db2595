"""A step that fails after a stream began: each API says so in its own format, the request's
session and reservation are released, and the server keeps serving.

The fault is injected into the real llama.cpp backend (tiny GGUF) under the real engine and
routes; the clients are the official SDKs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import trio

import butter
from butter.backends.base import BackendError, KvOp, Sampled, SeqWork

MESSAGES = [{"role": "user", "content": "Tell me about the sea"}]
FAIL_AT_DECODE = 4  # the stream has sent tokens by then


class FaultyStep:
    """Wraps a backend's step: the Nth decode-only step raises, once."""

    def __init__(self, step: Callable[[list[KvOp], list[SeqWork]], list[Sampled]]) -> None:
        self._step = step
        self.decodes = 0
        self.armed = False

    def __call__(self, ops: list[KvOp], works: list[SeqWork]) -> list[Sampled]:
        if self.armed and works and not any(work.prompt for work in works):
            self.decodes += 1
            if self.decodes == FAIL_AT_DECODE:
                self.armed = False
                self._step(ops, [])  # the step's cache edits still happen
                raise BackendError("injected: llama_decode failed with status -3")
        return self._step(ops, works)


@pytest.fixture
async def served(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
                 ) -> AsyncIterator[tuple[str, butter.Model, FaultyStep]]:
    model = await butter.Model.load(str(tiny_gguf), parallel=2, max_context=1024)
    backend = model.resident.backend
    fault = FaultyStep(backend._step)  # what runs on the backend's thread, however called
    monkeypatch.setattr(backend, "_step", fault)
    server = butter.ServeServer(host="127.0.0.1", port=0,
                                holder=butter.FixedHolder(model=model, model_id="tiny"))
    try:
        async with trio.open_nursery() as nursery:
            host, port = await nursery.start(server.serve)
            yield f"http://{host}:{port}", model, fault
            nursery.cancel_scope.cancel()
    finally:
        await model.aclose()


async def _settled(model: butter.Model) -> None:
    stats = model.resident.engine.stats()
    assert stats.active == 0 and stats.reserved_cells == 0


async def _still_serves(base: str) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        reply = await client.post(f"{base}/v1/chat/completions", json={
            "model": "tiny", "messages": MESSAGES, "max_tokens": 4})
    assert reply.status_code == 200


async def test_openai_stream_ends_with_an_error_event(
        served: tuple[str, butter.Model, FaultyStep]) -> None:
    base, model, fault = served

    def consume() -> tuple[str, Any]:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        text = ""
        with pytest.raises(openai.APIError) as caught:
            for chunk in client.chat.completions.create(
                    model="tiny", messages=MESSAGES, max_tokens=64, stream=True):
                text += (chunk.choices[0].delta.content or "") if chunk.choices else ""
        return text, caught.value

    fault.armed = True
    text, error = await trio.to_thread.run_sync(consume)
    assert text  # tokens arrived before the failure...
    assert "llama_decode failed" in str(error.body or error.message)  # ...then the reason
    await _settled(model)
    await _still_serves(base)


async def test_anthropic_stream_ends_with_an_error_event(
        served: tuple[str, butter.Model, FaultyStep]) -> None:
    base, model, fault = served

    def consume() -> tuple[list[str], Any]:
        client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
        kinds: list[str] = []
        with pytest.raises(anthropic.APIStatusError) as caught:
            with client.messages.stream(model="tiny", messages=MESSAGES,  # type: ignore[arg-type]
                                        max_tokens=64) as stream:
                kinds.extend(event.type for event in stream)
        return kinds, caught.value

    fault.armed = True
    kinds, error = await trio.to_thread.run_sync(consume)
    assert kinds[0] == "message_start" and "content_block_delta" in kinds
    assert kinds[-1] == "content_block_stop"  # the open block was closed before the error
    assert "llama_decode failed" in str(error.body)
    await _settled(model)
    await _still_serves(base)


async def test_non_stream_failure_is_a_500_in_openai_shape(
        served: tuple[str, butter.Model, FaultyStep]) -> None:
    base, model, fault = served
    fault.armed = True
    async with httpx.AsyncClient(timeout=30) as client:
        reply = await client.post(f"{base}/v1/chat/completions", json={
            "model": "tiny", "messages": MESSAGES, "max_tokens": 64})
    assert reply.status_code == 500
    assert "llama_decode failed" in reply.json()["error"]["message"]
    await _settled(model)
    await _still_serves(base)
