"""The Messages API end to end with the official anthropic SDK against the demo GGUF."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from tests.conftest import ServerProcess

MODEL = "gemma-3-270m"
WEATHER = {"name": "get_weather", "description": "Current weather",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def client(demo_server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=demo_server.base_url, api_key="unused", max_retries=0,
                               timeout=120)


def test_plain_message(client: anthropic.Anthropic) -> None:
    message = client.messages.create(model=MODEL, max_tokens=12, system="Be brief.",
                                     messages=[{"role": "user", "content": "Hello"}])
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_")
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.content and message.content[0].type == "text"
    assert message.usage.output_tokens <= 12
    assert message.usage.input_tokens > 0


def test_stream_event_order(client: anthropic.Anthropic) -> None:
    with client.messages.stream(model=MODEL, max_tokens=16,
                                messages=[{"role": "user", "content": "Tell me a story"}]) as s:
        events = [event for event in s if event.type not in ("text", "input_json")]
        final = s.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start"
    assert kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) <= {"content_block_delta", "ping"}
    indices = {getattr(e, "index", 0) for e in events if e.type.startswith("content_block")}
    assert indices == {0}
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.output_tokens > 0


def test_any_tool_choice_returns_tool_use(client: anthropic.Anthropic) -> None:
    message = client.messages.create(model=MODEL, max_tokens=80, tools=[WEATHER],
                                     tool_choice={"type": "any"}, messages=ASK)
    assert message.stop_reason == "tool_use"
    tool_use = [b for b in message.content if b.type == "tool_use"]
    assert len(tool_use) == 1
    assert tool_use[0].name == "get_weather"
    assert isinstance(tool_use[0].input, dict) and isinstance(tool_use[0].input["city"], str)
    assert tool_use[0].id.startswith("toolu_")

    follow_up = client.messages.create(
        model=MODEL, max_tokens=16, tools=[WEATHER],
        messages=[*ASK, {"role": "assistant", "content": message.content},
                  {"role": "user", "content": [{"type": "tool_result",
                                                "tool_use_id": tool_use[0].id,
                                                "content": "Sunny, 21 °C"}]}],
    )
    assert follow_up.usage.cache_read_input_tokens and follow_up.usage.cache_read_input_tokens > 0


def test_streamed_tool_use_with_input_json_delta(client: anthropic.Anthropic) -> None:
    with client.messages.stream(model=MODEL, max_tokens=80, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"},
                                messages=ASK) as s:
        events = list(s)
        final = s.get_final_message()
    deltas = [e for e in events if e.type == "content_block_delta"]
    assert any(d.delta.type == "input_json_delta" for d in deltas)
    assert final.stop_reason == "tool_use"
    block = final.content[-1]
    assert block.type == "tool_use" and isinstance(block.input, dict)


def test_count_tokens(client: anthropic.Anthropic) -> None:
    short = client.messages.count_tokens(model=MODEL, messages=[{"role": "user",
                                                                 "content": "Hi"}])
    longer = client.messages.count_tokens(model=MODEL, messages=[
        {"role": "user", "content": "Hi there, how are you doing today?"}])
    assert 0 < short.input_tokens < longer.input_tokens


def test_error_shapes(client: anthropic.Anthropic, demo_server: ServerProcess) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing_model:
        client.messages.create(model="nope", max_tokens=4, messages=ASK)
    assert missing_model.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    response = httpx.post(f"{demo_server.base_url}/v1/messages",
                          json={"model": MODEL, "messages": ASK})
    assert response.status_code == 400
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]


def test_pings_while_a_long_prompt_is_prefilled(demo_server: ServerProcess) -> None:
    long_prompt = "Summarise the history of the sea. " * 300  # ~2400 tokens: seconds
    body = {"model": MODEL, "max_tokens": 2, "stream": True,
            "messages": [{"role": "user", "content": long_prompt}]}
    with httpx.stream("POST", f"{demo_server.base_url}/v1/messages", json=body,
                      timeout=120) as response:
        kinds = [line.removeprefix("event: ") for line in response.iter_lines()
                 if line.startswith("event: ")]
    assert kinds[0] == "message_start"
    assert "ping" in kinds
    assert kinds.index("ping") < kinds.index("content_block_start")
    assert kinds[-1] == "message_stop"


# ---------------------------------------------------------------- Claude Code's requests

SMALL_CONTEXT = 512
BILLING = "x-anthropic-billing-header: cc_version=2.1.332.{}; cc_entrypoint=sdk-cli;"


@pytest.fixture(scope="module")
def small_context_server(demo_gguf: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(["--model", str(demo_gguf), "--alias", MODEL, "--parallel", "2",
                            "--max-context", str(SMALL_CONTEXT)])
    yield server
    server.stop()


def _agent_request(build: str, question: str) -> dict[str, Any]:
    """What Claude Code sends (see DESIGN.md), with a long system prompt."""
    return {
        "model": MODEL, "max_tokens": 32000,
        "system": [{"type": "text", "text": BILLING.format(build)},
                   {"type": "text", "text": "You are a careful assistant. " * 40,
                    "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hello"}]},
            {"role": "system", "content": [{"type": "text", "text": "<reminder>Be kind."
                                                                    "</reminder>"}]},
            {"role": "user", "content": [{"type": "text", "text": question,
                                          "cache_control": {"type": "ephemeral"}}]},
        ],
        "extra_body": {"thinking": {"type": "adaptive", "display": "omitted"},
                       "output_config": {"effort": "high"},
                       "context_management": {"edits": []},
                       "metadata": {"user_id": "user_1_account__session_2"}},
    }


def test_claude_code_request_is_served_with_max_tokens_clamped(
    small_context_server: ServerProcess,
) -> None:
    client = anthropic.Anthropic(base_url=small_context_server.base_url, api_key="k",
                                 max_retries=0, timeout=120)
    with client.beta.messages.stream(**_agent_request("a", "Tell me a long story.")) as stream:
        final = stream.get_final_message()
    used = final.usage
    prompt = used.input_tokens + (used.cache_read_input_tokens or 0)
    assert prompt + used.output_tokens <= SMALL_CONTEXT
    if final.stop_reason == "max_tokens":  # the base model usually runs on: to the context
        assert prompt + used.output_tokens == SMALL_CONTEXT
    else:
        assert final.stop_reason == "end_turn"


def test_billing_header_changes_keep_the_whole_prefix_cached(
    small_context_server: ServerProcess,
) -> None:
    client = anthropic.Anthropic(base_url=small_context_server.base_url, api_key="k",
                                 max_retries=0, timeout=120)
    usages = []
    for build in ("first", "second"):
        request = _agent_request(build, "Say one word.")
        message = client.beta.messages.create(**{**request, "max_tokens": 2})
        usages.append(message.usage)
    first, second = usages
    prompt = first.input_tokens + (first.cache_read_input_tokens or 0)
    assert second.input_tokens + (second.cache_read_input_tokens or 0) == prompt
    assert (second.cache_read_input_tokens or 0) >= 0.9 * prompt


def test_base_url_answers_get_and_head(demo_server: ServerProcess) -> None:
    assert httpx.get(demo_server.base_url + "/", timeout=10).status_code == 200
    assert httpx.head(demo_server.base_url + "/", timeout=10).status_code == 200
