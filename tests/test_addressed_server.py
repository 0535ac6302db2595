"""A real `butter serve` on gpt-oss's and Functionary v3.2's templates from llama.cpp's
collection, whose answers are addressed messages (butter/chat/harmony.py, recipients.py),
driven by the official openai SDK: a tool call cut off by max_tokens at every length is a
call as far as it went, or nothing, never content; streamed and not, the same.

The tiny random-weight model writes what a GBNF `grammar` says: the family's own call,
as gpt-oss and Functionary v3.2 write theirs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import ServerProcess
from tests.test_template_matrix import llama_cpp_templates

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# Each template, and an answer in its family's own messages: text (or reasoning), then a
# call, as the model writes it after the generation prompt.
ANSWERS = {
    "openai-gpt-oss-120b.jinja": (
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
        "<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}'),
    "meetkai-functionary-medium-v3.2.jinja": (
        'all\nLet me check.>>>get_weather\n{"city": "Paris"}'),
}


def gbnf(text: str) -> str:
    """A grammar that derives exactly `text`."""
    return "root ::= " + json.dumps(text)


@pytest.fixture(scope="module", params=sorted(ANSWERS))
def server(request: pytest.FixtureRequest, tiny_gguf: Path) -> Iterator[ServerProcess]:
    name = request.param
    template = next((path for path in llama_cpp_templates() if path.name == name), None)
    assert template is not None, f"{name} is not in llama.cpp's collection"
    process = ServerProcess(["--model", str(tiny_gguf), "--alias", "tiny",
                             "--chat-template", str(template), "--max-context", "2048"])
    process.template = name  # type: ignore[attr-defined]
    yield process
    process.stop()


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=120)


def _squeezed(text: str) -> str:
    return "".join(text.split())


def _answer(client: openai.OpenAI, ask: dict[str, Any], max_tokens: int
            ) -> tuple[str | None, str, list[tuple[str, str]]]:
    """Finish reason, content and calls (name, arguments), non-streamed; the streamed
    answer must be the same."""
    choice = client.chat.completions.create(**ask, max_tokens=max_tokens).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert all(c.id for c in choice.message.tool_calls or [])
    content, deltas, finish = "", [], None
    for chunk in client.chat.completions.create(**ask, max_tokens=max_tokens, stream=True):
        if chunk.choices:
            content += chunk.choices[0].delta.content or ""
            deltas += chunk.choices[0].delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
    streamed = [(d.function.name, "".join(e.function.arguments or "" for e in deltas
                                          if e.index == d.index and e.function))
                for d in deltas if d.id and d.function]
    assert (finish, content, streamed) == (
        choice.finish_reason, choice.message.content or "", calls), max_tokens
    return choice.finish_reason, choice.message.content or "", calls


def test_the_familys_call_cut_at_every_length(server: ServerProcess,
                                              client: openai.OpenAI) -> None:
    """Whole, the answer is the call (finish reason tool_calls). Cut at every token: finish
    reason length, no markup in the content (only the text before the call, as far as it
    went), and nothing of the call before its function's name was complete, then the call
    with its arguments a prefix of the whole call's."""
    text = ANSWERS[server.template]  # type: ignore[attr-defined]
    ask = {"model": "tiny", "messages": ASK, "tools": [WEATHER], "temperature": 0,
           "extra_body": {"grammar": gbnf(text)}}  # (the same tokens every time)
    finish, content, calls = _answer(client, ask, 400)
    assert (finish, calls) == ("tool_calls", [("get_weather", '{"city": "Paris"}')])
    assert content in ("", "Let me check.")
    whole = client.chat.completions.create(**ask, max_tokens=400)
    assert whole.usage is not None
    named = set()
    for max_tokens in range(1, whole.usage.completion_tokens):
        finish, content, calls = _answer(client, ask, max_tokens)
        assert finish == "length", max_tokens
        assert "Let me check.".startswith(content) or "all".startswith(content), (
            max_tokens, content)
        assert len(calls) <= 1, calls
        for name, arguments in calls:
            assert name == "get_weather" and '{"city":"Paris"}'.startswith(
                _squeezed(arguments)), (max_tokens, arguments)
        named.add(bool(calls))
    assert named == {False, True}  # cut before the name was complete, and after


def test_a_forced_call_is_a_call(client: openai.OpenAI) -> None:
    """tool_choice required writes `<tool_call>` markup (the grammar's), which these
    templates' answers are read for too: whole, a call; cut at every few tokens, never
    content."""
    ask = {"model": "tiny", "messages": ASK, "tools": [WEATHER], "tool_choice": "required",
           "temperature": 0}
    finish, content, calls = _answer(client, ask, 400)
    assert finish == "tool_calls" and content == "", content
    ((name, arguments),) = calls
    assert name == "get_weather" and set(json.loads(arguments)) == {"city"}
    whole = client.chat.completions.create(**ask, max_tokens=400)
    assert whole.usage is not None
    for max_tokens in range(1, whole.usage.completion_tokens, 3):
        finish, content, calls = _answer(client, ask, max_tokens)
        assert finish == "length" and content == "", (max_tokens, content)
        assert all(name == "get_weather" and (arguments == "" or arguments.startswith("{"))
                   for name, arguments in calls), calls
