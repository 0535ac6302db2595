"""End to end: a real `butter serve` on the demo GGUF, driven by the official openai SDK."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import ServerProcess

MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]


@pytest.fixture
def client(demo_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=demo_server.api, api_key="unused", max_retries=0, timeout=120)


def test_health_and_models(demo_server: ServerProcess, client: openai.OpenAI) -> None:
    assert httpx.get(f"{demo_server.base_url}/health").text == "ok"
    models = client.models.list().data
    assert models[0].id == "gemma-3-270m"  # the resident model first
    card = models[0].model_dump()
    assert card["loaded"] is True
    assert all(m.model_dump()["loaded"] is False for m in models[1:])  # what it may swap to
    assert "gemma-3-270m" not in [m.id for m in models[1:]]
    assert card["max_model_len"] == card["context_length"] > 0
    assert card["meta"]["chat_template"] == "builtin:gemma"  # the demo GGUF has none


def test_non_stream_completion(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model="gemma-3-270m", messages=MESSAGES, max_tokens=16, temperature=0.7, seed=3
    )
    choice = result.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert result.usage is not None
    assert result.usage.prompt_tokens > 5
    assert 0 < result.usage.completion_tokens <= 16
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens
    if choice.finish_reason == "length":
        assert result.usage.completion_tokens == 16


def test_stream_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="gemma-3-270m", messages=MESSAGES, max_tokens=24, seed=5, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    ids = {chunk.id for chunk in chunks}
    assert len(ids) == 1
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and
              c.choices[0].finish_reason]
    assert finish in (["stop"], ["length"])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None
    assert usage_chunk.usage.prompt_tokens_details is not None
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens is not None
    assert usage_chunk.usage.completion_tokens >= len(content_chunks) > 0


def test_cached_tokens_on_repeat(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "List three colours of the rainbow, please."}]
    first = client.chat.completions.create(
        model="gemma-3-270m", messages=messages, max_tokens=4, seed=1
    )
    second = client.chat.completions.create(
        model="gemma-3-270m", messages=messages, max_tokens=4, seed=1
    )
    assert first.usage and second.usage and second.usage.prompt_tokens_details
    # At most prompt - 1: one token is always evaluated to get logits.
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1


def test_same_seed_same_output(client: openai.OpenAI) -> None:
    def run(seed: int) -> str:
        result = client.chat.completions.create(
            model="gemma-3-270m", messages=MESSAGES, max_tokens=24, temperature=1.0, seed=seed
        )
        return result.choices[0].message.content or ""

    assert run(42) == run(42)
    outputs = {run(seed) for seed in (1, 2, 3)}
    assert len(outputs) > 1  # seeds matter at temperature 1


def test_stop_string_cuts_output(client: openai.OpenAI) -> None:
    base = client.chat.completions.create(
        model="gemma-3-270m", messages=MESSAGES, max_tokens=32, temperature=0, seed=0
    )
    text = base.choices[0].message.content or ""
    assert len(text) > 4
    stop = text[2:4]  # a stop string that certainly occurs, maybe across tokens
    cut = client.chat.completions.create(
        model="gemma-3-270m", messages=MESSAGES, max_tokens=32, temperature=0, seed=0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.index(stop)]
    streamed = client.chat.completions.create(
        model="gemma-3-270m", messages=MESSAGES, max_tokens=32, temperature=0, seed=0,
        stop=stop, stream=True,
    )
    pieces = [c.choices[0].delta.content or "" for c in streamed if c.choices]
    assert "".join(pieces) == text[: text.index(stop)]


def test_bad_requests_get_openai_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as empty:
        client.chat.completions.create(model="gemma-3-270m", messages=[])
    assert "messages" in empty.value.message
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert unknown.value.code == "model_not_found"
    # Only a prompt that alone fills the context is refused (a large max_tokens is clamped).
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(
            model="gemma-3-270m", messages=[{"role": "user", "content": "butter " * 9000}],
            max_tokens=1)
    assert too_long.value.code == "context_length_exceeded"
    assert "no room for a completion" in too_long.value.message


def test_malformed_bodies_name_the_problem(demo_server: ServerProcess) -> None:
    url = f"{demo_server.api}/chat/completions"
    cases = {
        b"{not json": "not valid JSON",
        b'{"messages": "hi"}': "messages",
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "12"}': "max_tokens",
        b'{"messages": [{"role": "robot", "content": "x"}]}': "role",
        b'{"messages": [{"role": "user", "content": "x"}], "temperature": 9}': "temperature",
        b"\xff\xfe": "UTF-8",
    }
    for body, needle in cases.items():
        response = httpx.post(url, content=body, headers={"content-type": "application/json"})
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert needle in error["message"], (body, error)
        assert error["type"] == "invalid_request_error"


def test_unknown_fields_and_authorization_are_ignored(demo_server: ServerProcess) -> None:
    response = httpx.post(
        f"{demo_server.api}/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 2, "some_vendor_field": {"x": 1}},
        headers={"Authorization": "Bearer whatever"}, timeout=60,
    )
    assert response.status_code == 200


def test_cache_hit_gives_the_same_greedy_tokens_as_cold(client: openai.OpenAI) -> None:
    """Sliding-window Gemma 3 with swa_full: reuse stays exact."""
    stem = "You are a meticulous assistant. " * 40  # ~280 tokens, well into the window
    cold_messages = [{"role": "system", "content": stem},
                     {"role": "user", "content": "Name a large mammal."}]
    cold = client.chat.completions.create(
        model="gemma-3-270m", messages=cold_messages, max_tokens=24, temperature=0
    )
    warm_messages = [{"role": "system", "content": stem},
                     {"role": "user", "content": "Name a large mammal."}]
    warm = client.chat.completions.create(
        model="gemma-3-270m", messages=warm_messages, max_tokens=24, temperature=0
    )
    assert warm.usage and warm.usage.prompt_tokens_details and cold.usage
    assert cold.usage.prompt_tokens_details is not None
    assert cold.usage.prompt_tokens_details.cached_tokens < 10  # only the turn header
    assert warm.usage.prompt_tokens_details.cached_tokens == cold.usage.prompt_tokens - 1
    assert warm.choices[0].message.content == cold.choices[0].message.content


def test_timings_as_llama_server_reports_them(demo_server: ServerProcess) -> None:
    body = {"messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 8,
            "temperature": 0}
    whole = httpx.post(f"{demo_server.api}/chat/completions", json=body, timeout=120).json()
    timings, usage = whole["timings"], whole["usage"]
    assert timings["predicted_n"] == usage["completion_tokens"] == 8
    assert timings["cache_n"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert timings["prompt_n"] + timings["cache_n"] == usage["prompt_tokens"]
    assert timings["predicted_ms"] > 0 and timings["predicted_per_second"] > 0
    assert timings["prompt_per_token_ms"] * timings["prompt_n"] == pytest.approx(
        timings["prompt_ms"])
    finals = []
    with httpx.stream("POST", f"{demo_server.api}/chat/completions", timeout=120,
                      json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line.removeprefix("data: "))
                if "timings" in chunk:
                    finals.append(chunk)
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"
    assert finals[0]["timings"]["predicted_n"] == 8
    assert finals[0]["timings"]["cache_n"] > 0  # the same prompt again, from the cache


def test_return_progress_reports_the_prompt_as_it_is_evaluated(
    demo_server: ServerProcess,
) -> None:
    """llama-server's `return_progress`: prompt_progress chunks before the first token,
    counting up to the whole prompt."""
    words = " ".join(f"item{index}" for index in range(300))  # a few prefill chunks
    body = {"messages": [{"role": "user", "content": f"Summarize: {words}"}],
            "max_tokens": 2, "stream": True, "return_progress": True}
    progress, content_seen_at = [], None
    with httpx.stream("POST", f"{demo_server.api}/chat/completions", json=body,
                      timeout=300) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "prompt_progress" in chunk:
                assert content_seen_at is None  # all of it before the answer
                progress.append(chunk["prompt_progress"])
            elif any(choice["delta"].get("content") for choice in chunk["choices"]):
                content_seen_at = len(progress)
    assert len(progress) >= 2, progress
    processed = [update["processed"] for update in progress]
    assert processed == sorted(processed) and len(set(processed)) == len(processed)
    assert progress[-1]["processed"] == progress[-1]["total"] > 300
    assert all(update["cache"] <= update["processed"] for update in progress)
    assert progress[-1]["time_ms"] >= progress[0]["time_ms"]


def test_tokenize_counts_the_tools_the_chat_request_describes(
        demo_server: ServerProcess, client: openai.OpenAI) -> None:
    """vLLM's /tokenize with `messages` and `tools`: the count is the chat request's
    usage.prompt_tokens for the same body. Gemma's template renders no tools, so they
    reach the prompt as butter's tools preamble, which /tokenize counts too."""
    tools: list[Any] = [{"type": "function", "function": {
        "name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}]
    counts = []
    for body in ({"messages": MESSAGES}, {"messages": MESSAGES, "tools": tools}):
        counted = httpx.post(f"{demo_server.base_url}/tokenize", json=body, timeout=60).json()
        chat = client.chat.completions.create(model="gemma-3-270m", max_tokens=1, **body)
        assert chat.usage is not None
        assert counted["count"] == len(counted["tokens"]) == chat.usage.prompt_tokens, body
        counts.append(counted["count"])
    assert counts[1] > counts[0] + 50  # the preamble and the tool's schema


def test_the_responses_api_is_a_404_that_names_chat_completions(
        demo_server: ServerProcess, client: openai.OpenAI) -> None:
    """butter serves no Responses API, by design: the SDK's call is a NotFoundError in
    OpenAI's error shape whose message names the way out (Chat Completions, and
    openai-agents' switch to it), not the web framework's text."""
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="gemma-3-270m", input="Hello")
    error = caught.value
    assert error.type == "invalid_request_error" and error.code == "unknown_route"
    assert isinstance(error.body, dict) and set(error.body) == {"message", "type", "param",
                                                                 "code"}
    message = error.body["message"]
    assert "Chat Completions" in message and "POST /v1/chat/completions" in message
    assert 'set_default_openai_api("chat_completions")' in message
    assert "requested URL" not in message  # (werkzeug's words)


def test_openai_agents_at_its_defaults_hears_how_to_switch_to_chat_completions(
        demo_server: ServerProcess) -> None:
    """openai-agents (from PyPI), as it runs by default (the Responses API): the run fails
    with butter's 404, which tells the switch; the same agent on Chat Completions answers."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    sdk = openai.AsyncOpenAI(base_url=demo_server.api, api_key="unused", max_retries=0)
    settings = agents.ModelSettings(max_tokens=4, temperature=0)
    by_default = agents.Agent(name="a", instructions="Be brief.", model_settings=settings,
                              model=agents.OpenAIResponsesModel("gemma-3-270m", sdk))
    with pytest.raises(openai.NotFoundError, match="set_default_openai_api"):
        agents.Runner.run_sync(by_default, "Hello", max_turns=1)
    switched = by_default.clone(
        model=agents.OpenAIChatCompletionsModel("gemma-3-270m", sdk))
    assert agents.Runner.run_sync(switched, "Hello", max_turns=1).final_output


def test_unknown_routes_and_methods_answer_in_each_apis_shape(
        demo_server: ServerProcess) -> None:
    """A path butter does not serve is a 404 that lists the routes it does; a route called
    with a method it does not answer is a 405 naming the one it does (and `Allow`); each
    in the shape of the API the path belongs to: OpenAI's, Anthropic's (/v1/messages...)
    or Ollama's (/api/...)."""
    base = demo_server.base_url
    embeddings = httpx.post(f"{base}/v1/embeddings", json={"input": "x"})
    assert embeddings.status_code == 404
    error = embeddings.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "unknown_route" and "POST /v1/embeddings" in error["message"]
    for served_route in ("POST /v1/chat/completions", "GET /v1/models", "POST /v1/messages",
                         "POST /v1/tokenize", "POST /api/chat", "GET /health"):
        assert served_route in error["message"], served_route
    assert "/static" not in error["message"] and "/ui/" not in error["message"]

    batches = httpx.post(f"{base}/v1/messages/batches", json={"requests": []})
    assert batches.status_code == 404
    assert batches.json()["type"] == "error"
    assert batches.json()["error"]["type"] == "not_found_error"
    assert "POST /v1/messages" in batches.json()["error"]["message"]
    pull = httpx.post(f"{base}/api/pull", json={"model": "x"})
    assert pull.status_code == 404 and set(pull.json()) == {"error"}
    assert "POST /api/chat" in pull.json()["error"]

    wrong = {("GET", "/v1/chat/completions"): ("POST", lambda body: body["error"]["message"]),
             ("GET", "/v1/messages"): ("POST", lambda body: body["error"]["message"]),
             ("POST", "/api/tags"): ("GET", lambda body: body["error"]),
             ("DELETE", "/v1/models"): ("GET", lambda body: body["error"]["message"])}
    for (method, path), (allowed, message_of) in wrong.items():
        answer = httpx.request(method, f"{base}{path}")
        assert answer.status_code == 405, (method, path, answer.text)
        assert allowed in answer.headers["allow"].split(", ")
        assert message_of(answer.json()) == (
            f"{method} {path}: this route answers {allowed}"), answer.text
    assert httpx.get(f"{base}/v1/messages").json()["type"] == "error"  # Anthropic's shape
