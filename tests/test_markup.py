"""The markup parser: recorded model outputs, partial tags, malformed input, any split."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from butter.chat.markup import (
    ContentDelta,
    Event,
    MarkupParser,
    ReasoningDelta,
    ToolCall,
)

TOOLS = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"},
        "metric": {"type": "boolean"}, "tags": {"type": "array"}}},
    "search": {"type": "object", "properties": {"query": {"type": "string"}}},
}

# Outputs written from the published chat formats of each family.
HERMES_QWEN = (
    "<think>\nThe user wants the weather.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
    "</tool_call>"
)
QWEN3_CODER = (
    "I'll check both.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n"
    "</parameter>\n<parameter=days>\n2\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
    '<parameter=tags>\n["a", "b"]\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n'
    "<function=search>\n<parameter=query>\n42\n</parameter>\n</function>\n</tool_call>"
)




def merged(events: list[Event]) -> tuple[str, str, list[tuple[str, dict[str, object]]]]:
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    calls = [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCall)]
    return content, reasoning, calls


def parse_whole(text: str, **kwargs: object) -> list[Event]:
    parser = MarkupParser(TOOLS, **kwargs)  # type: ignore[arg-type]
    return parser.feed(text) + parser.finish()


def parse_split(text: str, cuts: list[int], **kwargs: object) -> list[Event]:
    parser = MarkupParser(TOOLS, **kwargs)  # type: ignore[arg-type]
    points = sorted({min(c, len(text)) for c in cuts})
    events: list[Event] = []
    for a, b in zip([0, *points], [*points, len(text)], strict=True):
        events += parser.feed(text[a:b])
    return events + parser.finish()


def test_hermes_json_call_with_think_block() -> None:
    content, reasoning, calls = merged(parse_whole(HERMES_QWEN))
    assert content == ""
    assert reasoning == "The user wants the weather.\n"
    assert calls == [("get_weather", {"city": "Paris", "days": 3})]


def test_qwen3_coder_xml_calls_typed_by_schema() -> None:
    events = parse_whole(QWEN3_CODER)
    content, _, calls = merged(events)
    assert content == "I'll check both.\n"
    assert calls == [
        ("get_weather", {"city": "New York", "days": 2, "metric": True, "tags": ["a", "b"]}),
        ("search", {"query": "42"}),  # a string parameter stays a string
    ]
    ids = [e.id for e in events if isinstance(e, ToolCall)]
    assert len(set(ids)) == 2
    assert [e.index for e in events if isinstance(e, ToolCall)] == [0, 1]


def test_template_opened_think_block() -> None:
    content, reasoning, _ = merged(parse_whole("planning...</think>\n\nHello!",
                                               start_in_reasoning=True))
    assert (content, reasoning) == ("Hello!", "planning...")


def test_unclosed_think_at_end_is_reasoning() -> None:
    assert merged(parse_whole("<think>still thinking")) == ("", "still thinking", [])


def test_partial_tag_at_every_position_never_leaks() -> None:
    text = HERMES_QWEN
    for cut in range(len(text) + 1):
        parser = MarkupParser(TOOLS)
        first = parser.feed(text[:cut])
        for event in first:
            if isinstance(event, ContentDelta):
                assert "<" not in event.text, (cut, event)
        assert merged(first + parser.feed(text[cut:]) + parser.finish()) == merged(
            parse_whole(text))


def test_malformed_markup_degrades_to_content() -> None:
    cases = [
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "search", "arguments": "not an object"}\n</tool_call>',
        "<tool_call><function=nope><parameter=x>1</parameter></function></tool_call>",
        '<tool_call>\n{"name": "search", "arguments": {"query": "q"}',  # unclosed at the end
    ]
    for text in cases:
        content, reasoning, calls = merged(parse_whole(text))
        assert calls == [] and reasoning == ""
        assert content == text


def test_text_without_tools_is_left_alone() -> None:
    parser = MarkupParser(None)
    text = '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
    events = parser.feed(text) + parser.finish()
    assert merged(events) == (text, "", [])


def test_string_encoded_arguments_are_accepted() -> None:
    text = '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}</tool_call>'
    assert merged(parse_whole(text))[2] == [("search", {"query": "x"})]


SEGMENTS = st.sampled_from([
    "Hello ", "world. ", "a < b and c > d ", "<thi", "nk", "</", "tool", "\n", "  ",
    "<think>reasoning here</think>",
    '<tool_call>{"name": "search", "arguments": {"query": "cats"}}</tool_call>',
    "<tool_call><function=get_weather><parameter=city>Oslo</parameter></function></tool_call>",
    "<tool_call>broken</tool_call>", "<tool_call>", "</tool_call>", "<think>", "</think>",
    "日本語", "🙂",
])


@settings(max_examples=300)
@given(st.lists(SEGMENTS, max_size=12), st.lists(st.integers(0, 400), max_size=10),
       st.booleans())
def test_any_split_gives_the_non_stream_result(
    segments: list[str], cuts: list[int], in_reasoning: bool
) -> None:
    text = "".join(segments)
    whole = merged(parse_whole(text, start_in_reasoning=in_reasoning))
    assert merged(parse_split(text, cuts, start_in_reasoning=in_reasoning)) == whole


WEATHER_TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"},
                                                                  "days": {"type": "integer"}}}}


def _events_fed(text: str, step: int, **options: Any) -> list[Any]:
    parser = MarkupParser(WEATHER_TOOLS, **options)
    events = [event for start in range(0, len(text), step)
              for event in parser.feed(text[start:start + step])]
    return events + parser.finish()


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_key_value_calls_in_tool_call_tags(step: int) -> None:
    """GLM's form: the name, then <arg_key>/<arg_value> pairs typed by the schema."""
    text = ("Sure.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
            "</arg_value>\n<arg_key>days</arg_key><arg_value>3</arg_value>\n</tool_call>")
    events = _events_fed(text, step)
    calls = [event for event in events if isinstance(event, ToolCall)]
    assert [(call.name, json.loads(call.arguments)) for call in calls] == [
        ("get_weather", {"city": "Paris", "days": 3})]
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == "Sure."


@pytest.mark.parametrize("step", [1, 5, 1000])
@pytest.mark.parametrize(("text", "expected"), [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', [{"city": "Paris"}]),
    (' \n[{"name": "get_weather", "arguments": {"city": "Rome"}}, '
     '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}]',
     [{"city": "Rome"}, {"city": "Oslo", "days": 2}]),
])
def test_bare_json_calls(text: str, expected: list[dict[str, Any]], step: int) -> None:
    events = _events_fed(text, step, bare_json_calls=True)
    assert not [event for event in events if isinstance(event, ContentDelta)]
    assert [json.loads(event.arguments) for event in events] == expected


@pytest.mark.parametrize("text", [
    '{"answer": 42}',  # JSON, not a call
    '{"name": "send_mail", "parameters": {}}',  # a tool nobody offered
    '{"name": "get_weather", "parameters": ',  # cut off
    'The JSON is {"name": "get_weather", "parameters": {}}',  # text first: an answer
])
def test_bare_json_that_is_not_a_call_stays_content(text: str) -> None:
    events = _events_fed(text, 4, bare_json_calls=True)
    assert all(isinstance(event, ContentDelta) for event in events)
    assert "".join(event.text for event in events) == text.lstrip()


def test_bare_json_is_not_looked_for_unless_asked() -> None:
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert "".join(e.text for e in _events_fed(text, 7)) == text
