"""Functionary v3.2's addressed answers (butter/chat/recipients.py): `all` is the answer,
any other recipient a tool call, in any split, with no `>>>` left in the text."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from butter.chat.answers import answer_parser
from butter.chat.markup import ContentDelta, ToolCall
from butter.chat.recipients import RecipientParser
from butter.chat.tool_calls import TOOL_CALL, syntax_named
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
    assert isinstance(answer_parser(TOOLS, syntaxes=(TOOL_CALL, family)), RecipientParser)


def test_an_arrow_in_the_text_stays_text() -> None:
    """`>>>` in an answer (a doctest, a shift) that addresses no offered function."""
    for text in ("all\nuse x >>> 2\nreturn y", "all\nIn Python:\n>>> print(1)\n1",
                 "all\na >>>b"):
        assert parsed(text) == (text.removeprefix("all\n"), []), text
        assert parsed(text, [9, 12, 13]) == parsed(text), text
