"""Streamed logprobs ride on the chunk that carries their tokens' text (as llama-server and
OpenAI send them), and a stream's logprobs, put together, are the whole answer's: on a real
`butter serve` (SmolLM2 instruct), through the openai SDK."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.conftest import INSTRUCT_MODEL, ServerProcess, start_instruct_server

MESSAGES: list[Any] = [{"role": "system", "content": "Book"},
                       {"role": "user", "content": "What is the best book"}]


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    server: ServerProcess = start_instruct_server("--parallel", "1")
    try:
        yield openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0)
    finally:
        server.stop()


def _entries(logprobs: Any) -> list[tuple[str, list[int], list[str]]]:
    return [(entry.token, list(entry.bytes or []), [top.token for top in entry.top_logprobs])
            for entry in logprobs.content or []]


def _chat(client: openai.OpenAI, **extra: Any) -> tuple[Any, list[Any]]:
    whole = client.chat.completions.create(
        model=INSTRUCT_MODEL, messages=MESSAGES, temperature=0, logprobs=True,
        top_logprobs=2, **extra)
    chunks = list(client.chat.completions.create(
        model=INSTRUCT_MODEL, messages=MESSAGES, temperature=0, logprobs=True,
        top_logprobs=2, stream=True, **extra))
    return whole, chunks


def test_each_content_chunk_carries_the_logprobs_of_its_text(client: openai.OpenAI) -> None:
    """llama.cpp's test_logprobs_stream, and more: every chunk after the first (the role)
    and before the finish has content and its tokens' logprobs, their text exactly its
    content; all of them together are the non-streamed answer's."""
    whole, chunks = _chat(client, max_tokens=24)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content is None
    streamed: list[tuple[str, list[int], list[str]]] = []
    text = ""
    for chunk in chunks[1:]:
        choice = chunk.choices[0]
        if choice.finish_reason is None:
            assert choice.delta.content and choice.logprobs is not None
            assert "".join(entry.token for entry in choice.logprobs.content) \
                == choice.delta.content
            assert all(entry.logprob <= 0.0 and entry.top_logprobs
                       for entry in choice.logprobs.content)
            text += choice.delta.content
        if choice.logprobs is not None:
            streamed += _entries(choice.logprobs)
    assert text == whole.choices[0].message.content
    assert streamed == _entries(whole.choices[0].logprobs)


def test_a_stop_strings_tokens_ride_on_the_finish_chunk(client: openai.OpenAI) -> None:
    """Text held back (what may begin the stop string) goes out with its tokens' logprobs
    once released; the tokens of the stop string itself, which show no text, come on the
    finish chunk. Content never runs ahead of the tokens that made it, and every token
    comes once: the stream's logprobs are the whole answer's."""
    plain = client.chat.completions.create(
        model=INSTRUCT_MODEL, messages=MESSAGES, temperature=0, max_tokens=24)
    words = (plain.choices[0].message.content or "").split(" ")
    assert len(words) > 4
    stop = " " + words[3]
    whole, chunks = _chat(client, max_tokens=24, stop=[stop])
    assert whole.choices[0].finish_reason == "stop"
    tokens = text = ""
    streamed: list[tuple[str, list[int], list[str]]] = []
    for chunk in chunks[1:]:
        choice = chunk.choices[0]
        if choice.logprobs is not None:
            streamed += _entries(choice.logprobs)
            tokens += "".join(entry.token for entry in choice.logprobs.content)
        if choice.finish_reason is None:
            assert choice.delta.content and choice.logprobs is not None
            text += choice.delta.content
            assert tokens.startswith(text)
        else:
            assert choice.logprobs is not None  # the stop string's own tokens
            assert stop.strip() in "".join(
                entry.token for entry in choice.logprobs.content)
    assert text == whole.choices[0].message.content
    assert streamed == _entries(whole.choices[0].logprobs)


def test_completions_stream_text_with_its_logprobs(client: openai.OpenAI) -> None:
    """/v1/completions the same way: each text chunk carries its tokens, their offsets
    counted in the choice's text; the stream's tokens are the whole answer's."""
    args: dict[str, Any] = {"model": INSTRUCT_MODEL, "prompt": "The best book is",
                            "max_tokens": 16, "temperature": 0, "logprobs": 2}
    whole = client.completions.create(**args)
    text, tokens, offsets = "", [], []
    for chunk in client.completions.create(**args, stream=True):
        choice = chunk.choices[0]
        if choice.finish_reason is None:
            assert choice.text and choice.logprobs is not None
            assert "".join(choice.logprobs.tokens or []) == choice.text
            assert (choice.logprobs.text_offset or [])[0] == len(text)
            text += choice.text
        if choice.logprobs is not None:
            tokens += choice.logprobs.tokens or []
            offsets += choice.logprobs.text_offset or []
    expected = whole.choices[0].logprobs
    assert expected is not None
    assert text == whole.choices[0].text
    assert tokens == expected.tokens and offsets == expected.text_offset
