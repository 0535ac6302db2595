"""The answer parser's seam (butter/chat/answers.py) for the families whose answers are
addressed messages (gpt-oss's harmony, Functionary v3.2): a forced call, which the grammar
writes as one `<tool_call>` whatever the family, is a call, whole or cut by max_tokens at
any length, in any split; an answer of the family's messages is read as before."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from butter.chat.answers import AnswerParser, answer_parser
from butter.chat.markup import ContentDelta, Event, ReasoningDelta, ToolCall
from butter.chat.tool_calls import TOOL_CALL, arguments_object, syntax_named

TOOLS = {"get_weather": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}}
# As the forced tool_choice's grammar writes it (butter/backends/constraints.py).
FORCED = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
          "</tool_call>")
FAMILIES = ["harmony", "functionary-v3.2"]
Answer = tuple[str, str, list[tuple[str, str]]]


def parser_of(family: str) -> AnswerParser:
    syntax = syntax_named(family)
    assert syntax is not None
    return answer_parser(TOOLS, syntaxes=(TOOL_CALL, syntax))


def answer(events: list[Event]) -> Answer:
    return ("".join(e.text for e in events if isinstance(e, ContentDelta)),
            "".join(e.text for e in events if isinstance(e, ReasoningDelta)),
            [(e.name, e.arguments) for e in events if isinstance(e, ToolCall)])


def fed(family: str, text: str, points: list[int], *, cut: bool) -> tuple[Answer, AnswerParser]:
    """`text` fed split at `points`, then ended (by max_tokens where `cut`)."""
    parser = parser_of(family)
    points = sorted({min(point, len(text)) for point in points})
    events = [event for start, end in zip([0, *points], [*points, len(text)], strict=True)
              for event in parser.feed(text[start:end])]
    return answer(events + parser.finish(cut=cut)), parser


@pytest.mark.parametrize("family", FAMILIES)
def test_a_forced_call_is_a_call(family: str) -> None:
    for points in ([], list(range(len(FORCED))), [1, 5, 11, 12]):
        (content, reasoning, calls), parser = fed(family, FORCED, points, cut=False)
        assert (content, reasoning) == ("", ""), points
        assert [(name, json.loads(arguments)) for name, arguments in calls] == [
            ("get_weather", {"city": "Paris", "days": 3})]
        assert parser.tool_calls == 1 and not parser.cut_inside_call


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("step", [1, 4, 1000])
def test_a_forced_call_cut_anywhere_is_never_content(family: str, step: int) -> None:
    """Cut at every length, as MarkupParser does it: nothing until the function's name is
    complete, then the call, its arguments the text written so far."""
    name_end = FORCED.index('"get_weather"') + len('"get_weather"')
    arguments = FORCED.index('{"city"')
    arguments_end = FORCED.index("}}") + 1
    for length in range(1, len(FORCED)):
        text = FORCED[:length]
        (content, reasoning, calls), parser = fed(
            family, text, list(range(step, length, step)), cut=True)
        assert (content, reasoning) == ("", ""), (length, content, reasoning)
        assert parser.cut_inside_call, length
        if length < name_end:
            assert calls == [], length
            continue
        written = FORCED[arguments:max(arguments, min(length, arguments_end))].rstrip()
        assert calls == [("get_weather", written)], length
        assert arguments_object(written).items() <= {"city": "Paris", "days": 3}.items()


@pytest.mark.parametrize(("family", "text", "expected"), [
    ("harmony", "<|channel|>final<|message|>Hi<|return|>", ("Hi", "", [])),
    ("harmony", "<", ("<", "", [])),
    ("harmony", "<b>bold</b>", ("<b>bold</b>", "", [])),
    ("harmony", "<tool_call>\nnot json\n</tool_call>",  # the model's own broken markup
     ("<tool_call>\nnot json\n</tool_call>", "", [])),
    ("functionary-v3.2", "all\nHi", ("Hi", "", [])),
    ("functionary-v3.2", "  <tool", ("  <tool", "", [])),
])
def test_what_is_not_a_tool_call_reads_as_before(family: str, text: str,
                                                 expected: Answer) -> None:
    for points in ([], list(range(len(text)))):
        assert fed(family, text, points, cut=False)[0] == expected, points


@settings(max_examples=200)
@given(st.sampled_from(FAMILIES), st.integers(0, len(FORCED)),
       st.lists(st.integers(0, len(FORCED)), max_size=8), st.booleans())
def test_any_split_equals_the_whole(family: str, length: int, points: list[int],
                                    cut: bool) -> None:
    whole, parser = fed(family, FORCED[:length], [], cut=cut)
    split, other = fed(family, FORCED[:length], points, cut=cut)
    assert (split, other.tool_calls, other.cut_inside_call) == (
        whole, parser.tool_calls, parser.cut_inside_call)
