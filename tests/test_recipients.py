"""Functionary v3.2's addressed answers (butter/chat/recipients.py): `all` is the answer,
any other recipient a tool call, in any split, with no `>>>` left in the text; and
answers that max_tokens cut short."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from butter.chat.answers import MessagesOrCall, answer_parser
from butter.chat.markup import ContentDelta, ToolCall
from butter.chat.recipients import RecipientParser
from butter.chat.tool_calls import TOOL_CALL, arguments_object, syntax_named
from tests.splits import fed_in_pieces

TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}}}
MIXED = 'all\nLet me check.>>>get_weather\n{"city": "Paris"}>>>get_weather\n{"city": "Oslo"}'


def parsed(text: str, cuts: list[int] | None = None) -> tuple[str, list[tuple[str, object]]]:
    events = fed_in_pieces(RecipientParser(TOOLS), text, cuts or [])
    return ("".join(e.text for e in events if isinstance(e, ContentDelta)),
            [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCall)])


def test_an_answer_to_the_user() -> None:
    assert parsed("all\nHello there!\nTwo lines.") == ("Hello there!\nTwo lines.", [])


def test_text_then_calls() -> None:
    assert parsed(MIXED) == ("Let me check.", [("get_weather", {"city": "Paris"}),
                                               ("get_weather", {"city": "Oslo"})])


def test_a_call_of_no_offered_tool_is_text() -> None:
    assert parsed('launch\n{"n": 1}') == ('launch\n{"n": 1}', [])


def test_an_answer_without_a_recipient_is_content() -> None:
    assert parsed("Sure, here it is: 2 + 2 = 4") == ("Sure, here it is: 2 + 2 = 4", [])
    assert parsed("all") == ("", [])


@settings(max_examples=300)
@given(st.lists(st.integers(0, 120), max_size=10))
def test_any_split_equals_the_whole(cuts: list[int]) -> None:
    assert parsed(MIXED, cuts) == parsed(MIXED)


def test_the_answer_parser_is_this_one_for_functionary_v3_2() -> None:
    family = syntax_named("functionary-v3.2")
    assert family is not None
    parser = answer_parser(TOOLS, syntaxes=(TOOL_CALL, family))
    assert isinstance(parser, MessagesOrCall) and isinstance(parser.messages, RecipientParser)


def test_an_arrow_in_the_text_stays_text() -> None:
    """`>>>` in an answer (a doctest, a shift) that addresses no offered function."""
    for text in ("all\nuse x >>> 2\nreturn y", "all\nIn Python:\n>>> print(1)\n1",
                 "all\na >>>b"):
        assert parsed(text) == (text.removeprefix("all\n"), []), text
        assert parsed(text, [9, 12, 13]) == parsed(text), text


# ---------------------------------------------------------------- cut by max_tokens

Answer = tuple[str, list[tuple[str, str]]]


def cut_at(text: str, step: int, tools: Any = TOOLS) -> tuple[Answer, bool]:
    """`text` fed `step` characters at a time, then ended by max_tokens: the answer's
    content and calls (name, arguments as written), and cut_inside_call."""
    parser = RecipientParser(tools)
    events = [event for start in range(0, len(text), step)
              for event in parser.feed(text[start:start + step])]
    events += parser.finish(cut=True)
    return (("".join(e.text for e in events if isinstance(e, ContentDelta)),
             [(e.name, e.arguments) for e in events if isinstance(e, ToolCall)]),
            parser.cut_inside_call)


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_calls_cut_anywhere_come_back_as_far_as_they_were_written(step: int) -> None:
    """MIXED cut at every length: the text as far as it went, never a `>`; the calls
    completed before the cut whole; the one cut, once its recipient's line is complete,
    with the arguments written so far; before that, nothing of it."""
    first, second = (MIXED.index("get_weather\n"), MIXED.rindex("get_weather\n"))
    named = (first + len("get_weather\n"), second + len("get_weather\n"))
    ends = (MIXED.index("}") + 1, len(MIXED))
    for length in range(1, len(MIXED)):
        (content, calls), inside = cut_at(MIXED[:length], step)
        assert (content, calls) == cut_at(MIXED[:length], len(MIXED))[0], length
        assert ">" not in content, (length, content)
        assert "Let me check.".startswith(content) or MIXED.startswith(content), length
        begun = [i for i in (0, 1) if length >= named[i]]
        assert [name for name, _ in calls] == ["get_weather"] * len(begun), length
        for i, (_, arguments) in zip(begun, calls, strict=True):
            if length < ends[i]:
                assert arguments == MIXED[named[i]:length].rstrip(), length
            else:
                assert json.loads(arguments) == [{"city": "Paris"}, {"city": "Oslo"}][i]
            assert arguments_object(arguments).items() <= {"city": "Paris"}.items() or (
                arguments_object(arguments).items() <= {"city": "Oslo"}.items())
        # (From the first `>`, a call was begun; at the end of the first, it is whole.)
        assert inside == (length > MIXED.index(">") and length != ends[0]), length


@pytest.mark.parametrize(("text", "tools", "answer", "inside"), [
    ("get_wea", TOOLS, ("", []), True),  # may still name get_weather
    ("get_weather", TOOLS, ("", []), True),  # (may still go on)
    ("get_weather\n", TOOLS, ("", [("get_weather", "")]), True),
    ("all\nHi>>>get", TOOLS, ("Hi", []), True),
    ("all\nHi>>>", TOOLS, ("Hi", []), True),
    ("all\nHi >>", TOOLS, ("Hi ", []), True),  # a `>>>` begun: left out
    ("Sure", TOOLS, ("Sure", []), False),  # names no offered function: text
    ("al", TOOLS, ("al", []), False),
    ("all", TOOLS, ("", []), False),
    ("get_wea", None, ("get_wea", []), False),
    ('get_weather\n"Paris', TOOLS, ("", []), True),  # arguments that are not an object
    ('launch\n{"n": 1', TOOLS, ('launch\n{"n": 1', []), False),  # no offered function
])
def test_a_cut_answer(text: str, tools: Any, answer: Answer, inside: bool) -> None:
    for step in (1, 3, len(text)):
        assert cut_at(text, step, tools) == (answer, inside), step


def test_a_cut_answer_through_the_answer_parser() -> None:
    family = syntax_named("functionary-v3.2")
    assert family is not None
    parser = answer_parser(TOOLS, syntaxes=(TOOL_CALL, family))
    events = parser.feed('all\nOK>>>get_weather\n{"city": "Pa') + parser.finish(cut=True)
    assert [(e.name, e.arguments) for e in events if isinstance(e, ToolCall)] == [
        ("get_weather", '{"city": "Pa')]
    assert parser.cut_inside_call and parser.tool_calls == 1


@settings(max_examples=300)
@given(st.integers(0, len(MIXED)), st.lists(st.integers(0, 120), max_size=10))
def test_a_cut_answer_is_the_same_in_any_split(length: int, cuts: list[int]) -> None:
    text = MIXED[:length]
    parser = RecipientParser(TOOLS)
    points = sorted({min(cut, len(text)) for cut in cuts})
    events = [event for start, end in zip([0, *points], [*points, len(text)], strict=True)
              for event in parser.feed(text[start:end])] + parser.finish(cut=True)
    assert (("".join(e.text for e in events if isinstance(e, ContentDelta)),
             [(e.name, e.arguments) for e in events if isinstance(e, ToolCall)]),
            parser.cut_inside_call) == cut_at(text, len(text) or 1)
