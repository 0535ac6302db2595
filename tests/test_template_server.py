"""A real `butter serve` on a real template of llama.cpp's collection (gpt-oss's, which
renders tools itself and reads `model_identity` and `reasoning_effort`), driven by the
official openai SDK and httpx: tools without the optional fields reach the model, and
/tokenize counts exactly the prompt that the chat request evaluates."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import ServerProcess
from tests.test_template_matrix import llama_cpp_templates

TEMPLATE = "openai-gpt-oss-120b.jinja"
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"]}
# As openai-agents and hand-written clients send them: no description, no strict.
MINIMAL_TOOL = {"type": "function", "function": {"name": "get_weather",
                                                 "parameters": PARAMETERS}}
NAME_ONLY_TOOL = {"type": "function", "function": {"name": "get_time"}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL_ROUND = [*QUESTION,
              {"role": "assistant", "content": None, "tool_calls": [{
                  "type": "function",
                  "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
              {"role": "tool", "content": "Sunny, 21 C"}]


@pytest.fixture(scope="module")
def server(tiny_gguf: Path) -> Iterator[ServerProcess]:
    template = next((path for path in llama_cpp_templates() if path.name == TEMPLATE), None)
    assert template is not None, f"{TEMPLATE} is not in llama.cpp's collection"
    process = ServerProcess(["--model", str(tiny_gguf), "--alias", "tiny",
                             "--chat-template", str(template), "--max-context", "2048"])
    yield process
    process.stop()


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=120)


def _tokenize(server: ServerProcess, body: dict[str, Any]) -> dict[str, Any]:
    answer = httpx.post(f"{server.base_url}/tokenize", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    result: dict[str, Any] = answer.json()
    return result


def test_tools_without_a_description_reach_the_model(
        server: ServerProcess, client: openai.OpenAI) -> None:
    """gpt-oss's template writes `"// " + tool.description`; a tool without one (and a
    call without an id, a result without a tool_call_id) is a 200, and the tools are in
    the prompt the model reads."""
    meta = client.models.list().data[0].model_dump()["meta"]
    assert meta["chat_template_capabilities"]["tools"] is True  # rendered by the template
    result = client.chat.completions.create(
        model="tiny", messages=TOOL_ROUND,  # type: ignore[arg-type]
        tools=[MINIMAL_TOOL, NAME_ONLY_TOOL], max_tokens=1)  # type: ignore[list-item]
    assert result.usage is not None and result.usage.prompt_tokens > 0
    pieces = _tokenize(server, {"messages": TOOL_ROUND, "tools": [MINIMAL_TOOL, NAME_ONLY_TOOL],
                                "with_pieces": True})["tokens"]
    prompt = "".join(piece["piece"] for piece in pieces)
    assert "type get_weather = (_: {" in prompt and "type get_time = () => any;" in prompt
    assert "Sunny, 21 C" in prompt


def test_tokenize_counts_the_prompt_the_chat_request_evaluates(
        server: ServerProcess, client: openai.OpenAI) -> None:
    """/tokenize with `messages` renders what the chat request renders: its tools, its
    chat_template_kwargs and reasoning_effort. Each body changes the prompt, and the count
    is the chat completion's usage.prompt_tokens every time."""
    bodies: list[dict[str, Any]] = [
        {"messages": QUESTION},
        {"messages": QUESTION, "tools": [MINIMAL_TOOL]},
        {"messages": QUESTION, "tools": [MINIMAL_TOOL, NAME_ONLY_TOOL]},
        {"messages": QUESTION, "tools": [MINIMAL_TOOL],
         "chat_template_kwargs": {"model_identity": "You are a terse weather bot."}},
        {"messages": QUESTION, "tools": [MINIMAL_TOOL], "reasoning_effort": "high"},
        {"messages": TOOL_ROUND, "tools": [MINIMAL_TOOL]},
    ]
    counts = []
    for body in bodies:
        counted = _tokenize(server, body)
        assert counted["count"] == len(counted["tokens"])
        sdk = {key: value for key, value in body.items() if key != "chat_template_kwargs"}
        chat = client.chat.completions.create(model="tiny", max_tokens=1, **sdk, extra_body={
            key: value for key, value in body.items() if key == "chat_template_kwargs"})
        assert chat.usage is not None
        assert counted["count"] == chat.usage.prompt_tokens, body
        counts.append(counted["count"])
    assert counts[0] < counts[1] < counts[2]  # the tools are counted
    assert counts[3] != counts[1]  # the identity the kwargs give replaces ChatGPT's
    text = "".join(piece["piece"] for piece in _tokenize(
        server, {**bodies[4], "with_pieces": True})["tokens"])
    assert "Reasoning: high" in text


def test_tokenize_refuses_what_the_chat_request_refuses(server: ServerProcess) -> None:
    """Read as a chat request, a bad chat body is the same 400 on /tokenize."""
    for body, param in (({"messages": QUESTION, "tools": [{"type": "function"}]}, "tools"),
                        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages")):
        answer = httpx.post(f"{server.base_url}/tokenize", json=body, timeout=60)
        chat = httpx.post(f"{server.api}/chat/completions",
                          json={**body, "max_tokens": 1}, timeout=60)
        assert answer.status_code == chat.status_code == 400, answer.text
        assert answer.json()["error"]["message"] == chat.json()["error"]["message"]
        assert param in answer.json()["error"]["message"] + str(answer.json()["error"]["param"])
