"""Messages ⇄ chat conversion (pure), both ways."""

from __future__ import annotations

import json

import pytest

from butter.errors import InvalidRequest
from butter.protocol import anthropic, openai
from butter.protocol.openai import template_messages


def _convert(payload: dict[str, object]) -> openai.ChatCompletionRequest:
    return anthropic.to_chat_request(anthropic.parse_messages_request(payload))


def test_system_blocks_sampling_and_stops() -> None:
    chat = _convert({
        "model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "A"},
                                                  {"type": "text", "text": "B"}],
        "messages": [{"role": "user", "content": "hi"}], "temperature": 0.5, "top_k": 3,
        "top_p": 0.9, "stop_sequences": ["END"], "metadata": {"user_id": "u"},
        "thinking": {"type": "enabled", "budget_tokens": 100},
    })
    assert template_messages(chat)[0] == {"role": "system", "content": "A\n\nB"}
    assert (chat.max_tokens, chat.temperature, chat.top_k, chat.top_p) == (5, 0.5, 3, 0.9)
    assert chat.stop_strings == ("END",)
    assert chat.chat_template_kwargs == {"enable_thinking": True}


def test_tool_use_and_tool_result_round_trip() -> None:
    chat = _convert({
        "max_tokens": 5,
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "need a tool", "signature": "s"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "thanks"}]},
        ],
    })
    messages = template_messages(chat)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "user"]
    assistant = messages[1]
    assert assistant["content"] == "Checking."
    assert assistant["reasoning_content"] == "need a tool"
    assert assistant["tool_calls"][0]["function"] == {"name": "get_weather",
                                                      "arguments": {"city": "Paris"}}
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "toolu_1"}
    assert openai.forced_tool(chat) == "get_weather"
    assert chat.tools and chat.tools[0].function.parameters == {"type": "object"}


@pytest.mark.parametrize(("choice", "expected"), [
    ({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none"),
])
def test_tool_choice_mapping(choice: dict[str, str], expected: str) -> None:
    chat = _convert({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
                     "tools": [{"name": "f", "input_schema": {}}], "tool_choice": choice})
    assert chat.tool_choice == expected


def test_errors_in_anthropic_shape() -> None:
    with pytest.raises(InvalidRequest, match="max_tokens") as missing:
        anthropic.parse_messages_request({"messages": [{"role": "user", "content": "x"}]})
    assert missing.value.anthropic_body()["error"]["type"] == "invalid_request_error"
    with pytest.raises(InvalidRequest, match="role"):
        _convert({"max_tokens": 1, "messages": [{"role": "system", "content": "x"}]})
    with pytest.raises(InvalidRequest, match="image"):
        _convert({"max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {}}]}]})


def test_results_convert_back() -> None:
    usage = openai.Usage(prompt_tokens=100, completion_tokens=7, cached_tokens=60)
    assert anthropic.usage_body(usage) == {"input_tokens": 40, "output_tokens": 7,
                                           "cache_read_input_tokens": 60,
                                           "cache_creation_input_tokens": 0}
    assert anthropic.stop_reason("tool_calls", None) == "tool_use"
    assert anthropic.stop_reason("length", None) == "max_tokens"
    assert anthropic.stop_reason("stop", "END") == "stop_sequence"
    assert anthropic.stop_reason("stop", None) == "end_turn"
    block = anthropic.tool_use_block("toolu_1", "f", json.dumps({"a": [1]}))
    assert block == {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": [1]}}
