"""The markup parser: recorded model outputs, partial tags, malformed input, any split, and
answers that max_tokens cut short."""

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
from butter.chat.tool_calls import arguments_object

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


# Qwen3.5 (its template, llama.cpp's models/templates/Qwen3.5-4B.jinja, teaches this form and
# opens `<think>\n` in the generation prompt): reasoning, then XML calls in `<tool_call>`, a
# string value over several lines as the template's own example has one.
QWEN35 = (
    "The user wants the weather.\n</think>\n\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=search>\n<parameter=query>\nweather in Paris\nnext 3 days\n"
    "</parameter>\n</function>\n</tool_call>"
)


@pytest.mark.parametrize("step", [None, 1, 2, 3, 5])
def test_qwen35_xml_calls_whole_and_streamed(step: int | None) -> None:
    if step is None:
        events = parse_whole(QWEN35, start_in_reasoning=True)
    else:
        events = parse_split(QWEN35, list(range(step, len(QWEN35), step)),
                             start_in_reasoning=True)
    content, reasoning, calls = merged(events)
    assert (content, reasoning.strip()) == ("", "The user wants the weather.")
    assert calls == [("get_weather", {"city": "Paris", "days": 3}),
                     ("search", {"query": "weather in Paris\nnext 3 days"})]
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


# ---------------------------------------------------------------- cut by max_tokens

# A forced call as the grammar writes it, and Qwen3-Coder's XML form.
FORCED = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
          "</tool_call>")
XML_FORCED = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
              "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


def cut_at(text: str, step: int, **kwargs: Any) -> tuple[list[Event], MarkupParser]:
    """`text` fed `step` characters at a time, then ended by max_tokens."""
    parser = MarkupParser(TOOLS, **kwargs)
    events = [event for start in range(0, len(text), step)
              for event in parser.feed(text[start:start + step])]
    return events + parser.finish(cut=True), parser


@pytest.mark.parametrize("step", [1, 7, 1000])
def test_a_json_call_cut_anywhere_comes_back_as_far_as_it_was_written(step: int) -> None:
    """Cut at every length: no markup (nor any content) comes out; once the function's
    name is complete the call does, its arguments the text written so far, read as an
    object as far as it goes; before that, nothing."""
    name_end = FORCED.index('"get_weather"') + len('"get_weather"')
    arguments = FORCED.index('{"city"')
    arguments_end = FORCED.index("}}") + 1
    for length in range(1, len(FORCED)):
        events, parser = cut_at(FORCED[:length], step)
        assert not [e for e in events if not isinstance(e, ToolCall)], (length, events)
        calls = [e for e in events if isinstance(e, ToolCall)]
        assert parser.cut_inside_call, length
        if length < name_end:
            assert calls == [], length
            continue
        assert [(c.index, c.name) for c in calls] == [(0, "get_weather")], length
        written = FORCED[arguments:max(arguments, min(length, arguments_end))].rstrip()
        assert calls[0].arguments == written, length
        whole = {"city": "Paris", "days": 3}
        assert arguments_object(written).items() <= whole.items(), length


@pytest.mark.parametrize("step", [1, 1000])
def test_an_xml_call_cut_short_keeps_its_complete_parameters(step: int) -> None:
    name_end = XML_FORCED.index("<function=get_weather>") + len("<function=get_weather>")
    seen = []
    for length in range(1, len(XML_FORCED)):
        events, parser = cut_at(XML_FORCED[:length], step)
        assert all(isinstance(e, ToolCall) for e in events), (length, events)
        assert parser.cut_inside_call
        if length < name_end:
            assert events == [], length
            continue
        (call,) = events
        assert isinstance(call, ToolCall) and call.name == "get_weather"
        seen.append(arguments_object(call.arguments))
    assert seen[0] == {} and seen[-1] == {"city": "Paris", "days": 3}
    assert {"city": "Paris"} in seen  # the first parameter alone, before the second ends


def test_a_cut_keeps_the_calls_before_it_and_drops_a_marker_begun() -> None:
    text = FORCED + "\nThen <tool_"
    events, parser = cut_at(text, 5)
    calls = [e for e in events if isinstance(e, ToolCall)]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3})]
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == "Then "
    assert parser.cut_inside_call and parser.tool_calls == 1
    # The model's own end (not max_tokens) leaves the text as it came, as before.
    assert merged(parse_whole(text))[0] == "Then <tool_"


@pytest.mark.parametrize(("text", "tools", "content"), [
    ("Hello <b", TOOLS, "Hello <b"),  # cannot begin a marker
    ("Hello <t", TOOLS, "Hello "),  # may begin <tool_call>
    ("Hello <t", None, "Hello <t"),  # no tools: no calls to begin
    ("<think>hm</thi", TOOLS, ""),  # reasoning: its own
])
def test_a_cut_answer_keeps_its_text(text: str, tools: Any, content: str) -> None:
    parser = MarkupParser(tools)
    events = parser.feed(text) + parser.finish(cut=True)
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == content
    assert parser.cut_inside_call == (text.endswith("<t") and tools is not None)


def test_a_call_closed_by_its_marker_is_whole_at_a_cut() -> None:
    events, parser = cut_at(FORCED, 3)
    assert [e.name for e in events if isinstance(e, ToolCall)] == ["get_weather"]
    assert not parser.cut_inside_call and parser.tool_calls == 1


@pytest.mark.parametrize(("text", "expected"), [
    ('{"name": "get_weather", "parameters": {"city": "Pa', ("get_weather", '{"city": "Pa')),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None),  # whole: a call
    ('{"answer": 4', None),  # JSON, not a call: content
    ('{"name": "get_wea', None),
])
def test_bare_json_cut_short(text: str, expected: tuple[str, str] | None) -> None:
    events, parser = cut_at(text, 4, bare_json_calls=True)
    calls = [(e.name, e.arguments) for e in events if isinstance(e, ToolCall)]
    assert parser.cut_inside_call == (expected is not None)
    if expected is not None:
        assert calls == [expected] and len(events) == 1
    elif calls:
        assert calls == [("get_weather", '{"city": "Paris"}')]
    else:
        assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == text


@settings(max_examples=300)
@given(st.lists(SEGMENTS, max_size=12), st.lists(st.integers(0, 400), max_size=10),
       st.integers(0, 400))
def test_a_cut_answer_is_the_same_in_any_split(segments: list[str], cuts: list[int],
                                              length: int) -> None:
    text = "".join(segments)[:length]
    parser = MarkupParser(TOOLS)
    whole = parser.feed(text) + parser.finish(cut=True)
    events, _ = cut_at(text, 1)
    described = [(type(e).__name__, getattr(e, "text", None), getattr(e, "name", None),
                  getattr(e, "arguments", None)) for e in events]
    merged_whole = [(type(e).__name__, getattr(e, "text", None), getattr(e, "name", None),
                     getattr(e, "arguments", None)) for e in whole]
    assert _merge_text(described) == _merge_text(merged_whole)


def _merge_text(events: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for event in events:
        if out and event[0] != "ToolCall" and out[-1][0] == event[0]:
            out[-1] = (event[0], out[-1][1] + event[1], None, None)
        else:
            out.append(event)
    return out
