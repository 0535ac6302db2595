"""Messages ⇄ the neutral request (pure), both ways."""

from __future__ import annotations

import json
from typing import Any

import pytest

from butter.chat import grammar as grammars
from butter.chat.request import GenerationRequest, Usage
from butter.errors import InvalidRequest
from butter.protocol import anthropic


def _convert(payload: dict[str, object]) -> GenerationRequest:
    return anthropic.generation_request(anthropic.parse_messages_request(payload))


def _messages(request: GenerationRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = request.prompt.messages  # type: ignore[union-attr]
    return messages


def test_system_blocks_sampling_and_stops() -> None:
    chat = _convert({
        "model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "A"},
                                                  {"type": "text", "text": "B"}],
        "messages": [{"role": "user", "content": "hi"}], "temperature": 0.5, "top_k": 3,
        "top_p": 0.9, "stop_sequences": ["END"], "metadata": {"user_id": "u"},
        "thinking": {"type": "enabled", "budget_tokens": 100},
    })
    assert _messages(chat)[0] == {"role": "system", "content": "A\n\nB"}
    sampling = chat.sampling
    assert (chat.max_tokens, sampling.temperature, sampling.top_k, sampling.top_p) == (
        5, 0.5, 3, 0.9)
    assert chat.stop == ("END",) and sampling.grammar is None
    assert chat.prompt.template_kwargs == {"enable_thinking": True}  # type: ignore[union-attr]


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
    messages = _messages(chat)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "user"]
    assistant = messages[1]
    assert assistant["content"] == "Checking."
    assert assistant["reasoning_content"] == "need a tool"
    assert assistant["tool_calls"][0]["function"] == {"name": "get_weather",
                                                      "arguments": {"city": "Paris"}}
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "toolu_1"}
    tools = [{"type": "function", "function": {"name": "get_weather",
                                                "parameters": {"type": "object"}}}]
    assert chat.prompt.tools == tools  # type: ignore[union-attr]
    assert chat.sampling.grammar == grammars.tool_call_grammar(tools, "get_weather")
    assert chat.tool_schemas == {"get_weather": {"type": "object"}}


@pytest.mark.parametrize(("choice", "offered", "forces"), [
    ({"type": "auto"}, True, False), ({"type": "any"}, True, True),
    ({"type": "none"}, False, False),
])
def test_tool_choice_mapping(choice: dict[str, str], offered: bool, forces: bool) -> None:
    chat = _convert({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
                     "tools": [{"name": "f", "input_schema": {}}, {"name": "g",
                                                                    "input_schema": {}}],
                     "tool_choice": choice})
    tools = chat.prompt.tools  # type: ignore[union-attr]
    assert (tools is not None, bool(chat.tool_schemas)) == (offered, offered)
    expected = grammars.tool_call_grammar(tools) if forces else None  # any of them
    assert chat.sampling.grammar == expected


def test_errors_in_anthropic_shape() -> None:
    with pytest.raises(InvalidRequest, match="max_tokens") as missing:
        anthropic.parse_messages_request({"messages": [{"role": "user", "content": "x"}]})
    assert missing.value.anthropic_body()["error"]["type"] == "invalid_request_error"
    with pytest.raises(InvalidRequest, match="role"):
        _convert({"max_tokens": 1, "messages": [{"role": "tool", "content": "x"}]})
    with pytest.raises(InvalidRequest, match=r"thinking\.type"):
        _convert({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
                  "thinking": {"type": "sometimes"}})
    with pytest.raises(InvalidRequest, match=r"output_config\.effort"):
        _convert({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
                  "output_config": {"effort": "extreme"}})
    with pytest.raises(InvalidRequest, match="image"):
        _convert({"max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {}}]}]})


@pytest.mark.parametrize(("fields", "param"), [
    ({"stop_sequences": [f"s{i}" for i in range(17)]}, "stop_sequences"),
    ({"top_k": -1}, "top_k"),
    ({"top_p": 1.5}, "top_p"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tool_choice": {"type": "tool", "name": "missing"},
      "tools": [{"name": "f", "input_schema": {}}]}, "tool_choice"),
])
def test_errors_name_anthropics_own_fields(fields: dict[str, Any], param: str) -> None:
    payload = {"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], **fields}
    with pytest.raises(InvalidRequest) as refused:
        _convert(payload)
    assert refused.value.param == param


def test_results_convert_back() -> None:
    usage = Usage(prompt_tokens=100, completion_tokens=7, cached_tokens=60)
    assert anthropic.usage_body(usage) == {"input_tokens": 40, "output_tokens": 7,
                                           "cache_read_input_tokens": 60,
                                           "cache_creation_input_tokens": 0}
    assert anthropic.stop_reason("tool_calls", None) == "tool_use"
    assert anthropic.stop_reason("length", None) == "max_tokens"
    assert anthropic.stop_reason("stop", "END") == "stop_sequence"
    assert anthropic.stop_reason("stop", None) == "end_turn"
    block = anthropic.tool_use_block("toolu_1", "f", json.dumps({"a": [1]}))
    assert block == {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": [1]}}


# ---------------------------------------------------------------- what Claude Code sends

BILLING = "x-anthropic-billing-header: cc_version=2.1.332.abc; cc_entrypoint=sdk-cli;"


def _claude_code_request(**overrides: Any) -> dict[str, Any]:
    """The shape of Claude Code 2.1's requests (read off the wire), trimmed."""
    request: dict[str, Any] = {
        "model": "gemma-3-270m", "max_tokens": 32000, "stream": True,
        "system": [
            {"type": "text", "text": BILLING},
            {"type": "text", "text": "You are Claude Code.",
             "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "system", "content": [{"type": "text", "text": "<reminder>today</reminder>"}]},
            {"role": "user", "content": [{"type": "text", "text": "and again",
                                          "cache_control": {"type": "ephemeral"}}]},
        ],
        "thinking": {"type": "adaptive", "display": "omitted"},
        "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "metadata": {"user_id": "user_abc_account__session_123"},
    }
    request.update(overrides)
    return request


def test_system_messages_inside_messages_stay_in_place_in_order() -> None:
    chat = _convert(_claude_code_request())
    roles = [(m["role"], m["content"]) for m in _messages(chat)]
    assert roles == [("system", "You are Claude Code."), ("user", "hi"),
                     ("system", "<reminder>today</reminder>"), ("user", "and again")]


def test_the_billing_header_never_reaches_the_prompt() -> None:
    first = _convert(_claude_code_request())
    other = _convert(_claude_code_request(system=[
        {"type": "text", "text": BILLING.replace("abc", "def")},
        {"type": "text", "text": "You are Claude Code."}]))
    assert _messages(first) == _messages(other)
    assert all("billing" not in (m["content"] or "") for m in _messages(first))
    # A system prompt that is only the billing header leaves no system message at all.
    alone = _convert(_claude_code_request(system=BILLING))
    assert [m["role"] for m in _messages(alone)] == ["user", "system", "user"]


def test_adaptive_thinking_and_effort_reach_the_template() -> None:
    chat = _convert(_claude_code_request())
    assert chat.prompt.template_kwargs == {  # type: ignore[union-attr]
        "enable_thinking": True, "reasoning_effort": "high"}
    off = _convert(_claude_code_request(thinking={"type": "disabled"},
                                        output_config={"effort": "max"}))
    assert off.prompt.template_kwargs == {  # type: ignore[union-attr]
        "enable_thinking": False, "reasoning_effort": "high"}
    assert not anthropic.shows_thinking(anthropic.parse_messages_request(_claude_code_request()))
    shown = _claude_code_request(thinking={"type": "enabled", "budget_tokens": 1024})
    assert anthropic.shows_thinking(anthropic.parse_messages_request(shown))


def test_count_tokens_takes_the_same_fields() -> None:
    payload = _claude_code_request()
    for name in ("max_tokens", "stream", "metadata", "context_management"):
        payload.pop(name)
    chat = anthropic.generation_request(anthropic.parse_count_tokens_request(payload))
    assert [m["role"] for m in _messages(chat)] == ["system", "user", "system", "user"]


def test_omitted_thinking_blocks_still_open_and_close_in_the_stream() -> None:
    from butter.chat.markup import ContentDelta, ReasoningDelta
    from butter.server.messages import _StreamBlocks

    def events(show: bool) -> list[dict[str, Any]]:
        blocks = _StreamBlocks(show_thinking=show)
        frames = [*blocks.on(ReasoningDelta("let me think")), *blocks.on(ContentDelta("Hi")),
                  *blocks.close()]
        return [json.loads(frame.split(b"data: ", 1)[1]) for frame in frames]

    omitted = events(False)
    assert [(e["type"], e.get("index")) for e in omitted] == [
        ("content_block_start", 0), ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1)]
    assert omitted[0]["content_block"]["type"] == "thinking"
    assert "let me think" not in json.dumps(omitted)
    shown = events(True)
    assert shown[1]["delta"] == {"type": "thinking_delta", "thinking": "let me think"}


def test_tool_search_results_and_deferred_tools() -> None:
    """Claude Code's ToolSearch: deferred tools are not offered until a search answers
    with a tool_reference (then the client sends the tool without defer_loading)."""
    read = {"name": "Read", "input_schema": {"type": "object"}}
    placeholder = {"name": "DeferredToolPlaceholder", "input_schema": {},
                   "defer_loading": True}
    chat = _convert(_claude_code_request(
        tools=[read, placeholder],
        messages=[
            {"role": "user", "content": "fetch it"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                               "name": "ToolSearch", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "tool_reference",
                                                       "tool_name": "WebFetch"}]}]},
        ]))
    tools = chat.prompt.tools or []  # type: ignore[union-attr]
    assert [tool["function"]["name"] for tool in tools] == ["Read"]
    tool_message = next(m for m in _messages(chat) if m["role"] == "tool")
    assert tool_message["content"] == "Tool loaded: WebFetch"


def test_every_effort_claude_code_sends_is_accepted() -> None:
    for effort, level in (("low", "low"), ("xhigh", "high"), ("max", "high")):
        chat = _convert(_claude_code_request(output_config={"effort": effort}))
        assert chat.prompt.template_kwargs["reasoning_effort"] == level  # type: ignore[union-attr]


def test_no_messages_is_the_system_prompt_alone() -> None:
    """As llama-server serves `messages: []`: the prompt is what the template renders of
    the system prompt (or of nothing); count_tokens takes it too."""
    chat = _convert({"max_tokens": 8, "system": "Answer in one word.", "messages": []})
    assert _messages(chat) == [{"role": "system", "content": "Answer in one word."}]
    assert _messages(_convert({"max_tokens": 8, "messages": []})) == []
    counted = anthropic.generation_request(anthropic.parse_count_tokens_request(
        {"system": [{"type": "text", "text": "Hi"}], "messages": []}))
    assert _messages(counted) == [{"role": "system", "content": "Hi"}]
    with pytest.raises(InvalidRequest) as refused:  # (the field itself is still required)
        _convert({"max_tokens": 8})
    assert refused.value.param == "messages"
