"""gpt-oss's harmony answers (butter/chat/harmony.py): reasoning, answer and tool calls
from the channels of one stream, in any split, with no markup left in the text."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from butter.chat.answers import answer_parser
from butter.chat.harmony import HarmonyParser
from butter.chat.markup import ContentDelta, MarkupParser, ReasoningDelta, ToolCall
from butter.chat.tool_calls import TOOL_CALL, syntax_named
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
    assert isinstance(answer_parser(TOOLS, syntaxes=(TOOL_CALL, harmony)), HarmonyParser)
    assert isinstance(answer_parser(TOOLS), MarkupParser)


def test_text_before_a_marker_is_not_a_header() -> None:
    text = "Hello there <|message|>"
    assert parsed(text) == (text, "", [])
