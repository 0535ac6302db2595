"""gpt-oss's harmony answers (butter/chat/harmony.py): reasoning, answer and tool calls
from the channels of one stream, in any split, with no markup left in the text; and
answers that max_tokens cut short."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from butter.chat.answers import MessagesOrCall, answer_parser
from butter.chat.harmony import HarmonyParser
from butter.chat.markup import ContentDelta, MarkupParser, ReasoningDelta, ToolCall
from butter.chat.tool_calls import TOOL_CALL, arguments_object, syntax_named
from tests.splits import fed_in_pieces

TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}}}
ANSWER = ("<|channel|>analysis<|message|>They want a greeting.<|end|>"
          "<|start|>assistant<|channel|>final<|message|>Hello there!<|return|>")
CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}<|call|>')


def parsed(text: str, cuts: list[int] | None = None) -> tuple[str, str, list[tuple[str, object]]]:
    events = fed_in_pieces(HarmonyParser(TOOLS), text, cuts or [])
    return ("".join(e.text for e in events if isinstance(e, ContentDelta)),
            "".join(e.text for e in events if isinstance(e, ReasoningDelta)),
            [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCall)])


def test_reasoning_then_the_answer() -> None:
    assert parsed(ANSWER) == ("Hello there!", "They want a greeting.", [])


def test_reasoning_then_a_call() -> None:
    assert parsed(CALL) == ("", "Need the weather.", [("get_weather", {"city": "Paris"})])


def test_the_recipient_may_come_before_the_channel() -> None:
    text = ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}'
    assert parsed(text) == ("", "", [("get_weather", {"city": "Oslo"})])


def test_the_end_markers_may_never_come() -> None:
    """`<|return|>` and `<|call|>` end generation, so they may never reach the text."""
    assert parsed(ANSWER.removesuffix("<|return|>")) == parsed(ANSWER)
    assert parsed(CALL.removesuffix("<|call|>")) == parsed(CALL)


def test_commentary_to_no_one_is_part_of_the_answer() -> None:
    text = ("<|channel|>commentary<|message|>Checking now.<|end|><|start|>assistant"
            '<|channel|>commentary to=functions.get_weather<|message|>{"city": "Rome"}')
    assert parsed(text) == ("Checking now.", "", [("get_weather", {"city": "Rome"})])


def test_a_call_of_no_offered_tool_is_text() -> None:
    text = CALL.replace("get_weather", "launch")
    assert parsed(text) == ('{"city": "Paris"}', "Need the weather.", [])


def test_text_without_a_header_is_content() -> None:
    assert parsed("Just an answer, no channels.") == ("Just an answer, no channels.", "", [])
    assert parsed("assistant is a word too") == ("assistant is a word too", "", [])


def test_a_header_cut_short_leaves_nothing_behind() -> None:
    assert parsed("<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|chan") == (
        "", "Hm.", [])


@settings(max_examples=300)
@given(st.sampled_from([ANSWER, CALL]), st.lists(st.integers(0, 250), max_size=10))
def test_any_split_equals_the_whole(text: str, cuts: list[int]) -> None:
    assert parsed(text, cuts) == parsed(text)


def test_the_answer_parser_is_harmonys_for_gpt_oss_templates() -> None:
    harmony = syntax_named("harmony")
    assert harmony is not None
    parser = answer_parser(TOOLS, syntaxes=(TOOL_CALL, harmony))
    assert isinstance(parser, MessagesOrCall) and isinstance(parser.messages, HarmonyParser)
    assert isinstance(answer_parser(TOOLS), MarkupParser)


def test_text_before_a_marker_is_not_a_header() -> None:
    text = "Hello there <|message|>"
    assert parsed(text) == (text, "", [])


# ---------------------------------------------------------------- cut by max_tokens

def cut_at(text: str, step: int, tools: Any = TOOLS) -> tuple[Answer, bool]:
    """`text` fed `step` characters at a time, then ended by max_tokens: the answer's
    content, reasoning and calls (name, arguments as written), and cut_inside_call."""
    parser = HarmonyParser(tools)
    events = [event for start in range(0, len(text), step)
              for event in parser.feed(text[start:start + step])]
    events += parser.finish(cut=True)
    return ((("".join(e.text for e in events if isinstance(e, ContentDelta)),
               "".join(e.text for e in events if isinstance(e, ReasoningDelta)),
               [(e.name, e.arguments) for e in events if isinstance(e, ToolCall)])),
            parser.cut_inside_call)


Answer = tuple[str, str, list[tuple[str, str]]]


@pytest.mark.parametrize("step", [1, 7, 1000])
def test_a_call_cut_anywhere_comes_back_as_far_as_it_was_written(step: int) -> None:
    """Cut at every length: no markup and no content; the reasoning as far as it went;
    once the recipient `functions.get_weather` is complete (a space follows) the call,
    its arguments the text written so far, read as an object as far as it goes; before
    that, nothing of it."""
    name_end = CALL.index("get_weather ") + len("get_weather ")
    body = CALL.index('{"city"')
    body_end = CALL.index("}") + 1
    for length in range(1, len(CALL)):
        (content, reasoning, calls), inside = cut_at(CALL[:length], step)
        assert content == "" and "Need the weather.".startswith(reasoning), (length, content)
        assert (content, reasoning, calls) == cut_at(CALL[:length], len(CALL))[0], length
        if length < name_end:
            assert calls == [], length
            continue
        ((name, arguments),) = calls
        assert name == "get_weather", length
        if length < body_end:
            assert arguments == CALL[body:max(body, length)].rstrip(), length
            assert inside, length
        else:  # whole (only the `<|call|>` that ends it, which generation may not write)
            assert json.loads(arguments) == {"city": "Paris"}, length
            assert not inside or length > body_end, length
        assert arguments_object(arguments).items() <= {"city": "Paris"}.items(), length


@pytest.mark.parametrize(("text", "tools", "answer", "inside"), [
    # The recipient cut short, or whole: nothing, then the call with no arguments yet.
    (" to=functions.get_weath", TOOLS, ("", "", []), True),
    (" to=functions.get_weather", TOOLS, ("", "", []), True),  # (may still go on)
    (" to=functions.get_weather ", TOOLS, ("", "", [("get_weather", "")]), True),
    ("<|start|>assistant<|channel|>commentary to=functions.get_weather<|constrain|>js",
     TOOLS, ("", "", [("get_weather", "")]), True),
    ("<|channel|>commentary to=functions.get_weather<|message|>", TOOLS,
     ("", "", [("get_weather", "")]), True),
    # A header that may still become a call's: left out.
    ("<|channel|>commentary to=fun", TOOLS, ("", "", []), True),
    ("<|chan", TOOLS, ("", "", []), True),
    # Arguments that are not the start of a JSON object: nothing to call with.
    ("<|channel|>commentary to=functions.get_weather<|message|>Paris", TOOLS,
     ("", "", []), True),
    # A message to no offered tool, or with none offered, is what it is uncut.
    ('<|channel|>commentary to=functions.launch<|message|>{"n": 1', TOOLS,
     ('{"n": 1', "", []), False),
    (" to=functions.get_weather ", None, (" to=functions.get_weather ", "", []), False),
    # Text and reasoning stay; a marker cut halfway does not.
    ("<|channel|>final<|message|>Hello<|", TOOLS, ("Hello", "", []), True),
    ("<|channel|>final<|message|>Hello<|", None, ("Hello", "", []), False),
    ("<|channel|>final<|message|>Hello<|e", TOOLS, ("Hello", "", []), False),
    ("<|channel|>analysis<|message|>Hm", TOOLS, ("", "Hm", []), False),
    ("Plain text", TOOLS, ("Plain text", "", []), False),
])
def test_a_cut_answer(text: str, tools: Any, answer: Answer, inside: bool) -> None:
    for step in (1, 3, len(text)):
        assert cut_at(text, step, tools) == (answer, inside), step


def test_a_cut_answer_is_not_the_models_own_end() -> None:
    """Ended by the model, the same text is content as it was (not a call)."""
    assert parsed(" to=functions.get_weather ") == (" to=functions.get_weather ", "", [])
    assert parsed("<|channel|>commentary to=functions.get_weather<|message|>Paris") == (
        "Paris", "", [])


@settings(max_examples=300)
@given(st.sampled_from([ANSWER, CALL, CALL + ANSWER.replace("<|channel|>", "<|start|>"
                                                            "assistant<|channel|>", 1)]),
       st.integers(0, 400), st.lists(st.integers(0, 400), max_size=10))
def test_a_cut_answer_is_the_same_in_any_split(text: str, length: int,
                                               cuts: list[int]) -> None:
    """Cut anywhere and fed in any split, the same answer; never a marker in its text."""
    text = text[:length]
    parser = HarmonyParser(TOOLS)
    points = sorted({min(cut, len(text)) for cut in cuts})
    events = [event for start, end in zip([0, *points], [*points, len(text)], strict=True)
              for event in parser.feed(text[start:end])] + parser.finish(cut=True)
    whole, inside = cut_at(text, len(text) or 1)
    assert (("".join(e.text for e in events if isinstance(e, ContentDelta)),
             "".join(e.text for e in events if isinstance(e, ReasoningDelta)),
             [(e.name, e.arguments) for e in events if isinstance(e, ToolCall)]),
            parser.cut_inside_call) == (whole, inside)
    assert "<|" not in whole[0] + whole[1]


def test_the_answer_parser_ends_a_cut_harmony_answer_as_harmony() -> None:
    """The seam the pipeline uses: a cut harmony call through answer_parser."""
    harmony = syntax_named("harmony")
    assert harmony is not None
    parser = answer_parser(TOOLS, syntaxes=(TOOL_CALL, harmony))
    events = parser.feed(CALL[:CALL.index("Paris")]) + parser.finish(cut=True)
    assert [(e.name, e.arguments) for e in events if isinstance(e, ToolCall)] == [
        ("get_weather", '{"city": "')]
    assert parser.cut_inside_call and parser.tool_calls == 1
