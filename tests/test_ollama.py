"""Ollama's native API through the official `ollama` client from PyPI, against a real
`butter serve` on the instruct model: the model routes, chat (whole and streamed), a
generated tool call, generate, and errors in Ollama's shape."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import INSTRUCT_MODEL, ServerProcess, start_instruct_server

ollama = pytest.importorskip("ollama")
MODEL = INSTRUCT_MODEL
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    process = start_instruct_server("--max-context", "2048")
    yield process
    process.stop()


@pytest.fixture
def client(server: ServerProcess) -> Any:
    return ollama.Client(host=server.base_url, timeout=120)


def weather_history() -> list[dict[str, Any]]:
    """Earlier rounds in which the assistant answered weather questions by calling the
    tool, in Ollama's shapes (arguments as objects, tool results without ids): enough for
    the small model to call it again, greedily."""
    history: list[dict[str, Any]] = [{"role": "system", "content": (
        "You answer every question about weather by calling get_weather. "
        "Never answer in words.")}]
    for city, weather in (("London", "Rainy"), ("Berlin", "Cloudy"), ("Rome", "Hot")):
        history += [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": city}}}]},
            {"role": "tool", "content": weather, "tool_name": "get_weather"},
            {"role": "assistant", "content": f"{weather}."},
        ]
    return [*history, {"role": "user", "content": "What is the weather in Paris?"}]


def test_model_routes(client: Any, server: ServerProcess) -> None:
    assert httpx.get(f"{server.base_url}/api/version").json()["version"]
    listed = client.list().models
    assert listed[0].model == MODEL and listed[0].details.format == "gguf"
    assert listed[0].details.quantization_level == "Q4_1" and listed[0].size > 0
    shown = client.show(MODEL)
    assert "completion" in shown.capabilities and "tools" in shown.capabilities
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.template  # the model's own chat template
    running = client.ps().models
    assert [model.model for model in running] == [MODEL]
    assert running[0].context_length == 2048
    assert client.show(f"{MODEL}:latest").details.family == "llama"


def test_chat_whole_and_streamed(client: Any) -> None:
    messages = [{"role": "user", "content": "Write a haiku about butter."}]
    whole = client.chat(model=MODEL, messages=messages, options=GREEDY)
    assert whole.done and whole.done_reason == "stop"
    assert whole.message.role == "assistant" and whole.message.content.strip()
    assert whole.prompt_eval_count > 0 and whole.eval_count > 0
    assert whole.eval_duration > 0 and whole.total_duration >= whole.eval_duration
    parts = list(client.chat(model=MODEL, messages=messages, options=GREEDY, stream=True))
    assert [part.done for part in parts].count(True) == 1 and parts[-1].done
    assert len(parts) > 2
    assert "".join(part.message.content or "" for part in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count


def test_a_generated_tool_call(client: Any) -> None:
    whole = client.chat(model=MODEL, messages=weather_history(), tools=[WEATHER],
                        options=GREEDY)
    calls = whole.message.tool_calls or []
    assert [(call.function.name, dict(call.function.arguments)) for call in calls] == [
        ("get_weather", {"city": "Paris"})]
    assert "<tool_call>" not in (whole.message.content or "")
    streamed = [call for part in client.chat(model=MODEL, messages=weather_history(),
                                             tools=[WEATHER], options=GREEDY, stream=True)
                for call in part.message.tool_calls or []]
    assert [call.function.name for call in streamed] == ["get_weather"]


def test_generate(client: Any) -> None:
    answer = client.generate(model=MODEL, prompt="Why is the sky blue?",
                             options={"num_predict": 12, **GREEDY})
    assert answer.done and answer.done_reason == "length" and answer.eval_count == 12
    raw = client.generate(model=MODEL, prompt="The capital of France is", raw=True,
                          options={"num_predict": 4, **GREEDY}, stream=True)
    assert "".join(part.response for part in raw).strip()
    loaded = client.generate(model=MODEL, prompt="")  # Ollama's way to load a model
    assert loaded.done and loaded.done_reason == "load"


def test_errors_in_ollamas_shape(client: Any, server: ServerProcess) -> None:
    with pytest.raises(ollama.ResponseError) as missing:
        client.chat(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert missing.value.status_code == 404 and "not found" in missing.value.error
    bad = httpx.post(f"{server.base_url}/api/chat", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]})
    assert bad.status_code == 400 and "images" in bad.json()["error"]
    options = httpx.post(f"{server.base_url}/api/chat", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}],
        "options": {"temperature": "hot"}})
    assert options.status_code == 400 and set(options.json()) == {"error"}
    unknown = httpx.post(f"{server.base_url}/api/pull", json={"model": MODEL})
    assert unknown.status_code == 404 and set(unknown.json()) == {"error"}
