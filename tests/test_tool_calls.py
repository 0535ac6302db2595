"""Tool-call markup of the model families beyond `<tool_call>` (butter/chat/tool_calls.py),
as the models write it (from each family's published format), through the streaming
markup parser: several calls, any split, values typed, broken markup left as content; and
calls that max_tokens cut short, read as far as they were written."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from butter.chat.markup import ContentDelta, Event, MarkupParser, ToolCall
from butter.chat.partial_json import read_prefix
from butter.chat.tool_calls import (
    FAMILIES,
    TOOL_CALL,
    CallSyntax,
    arguments_object,
    cut_json_call,
    cut_tool_call_body,
    family_syntax,
    syntax_named,
)

TOOLS = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}},
    "search": {"type": "object", "properties": {"query": {"type": "string"}}},
}
TWO_CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("search", {"query": "12"})]

# family → an answer with text first, then the two calls as that family writes them
ANSWERS = {
    "mistral": 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}'
               '[TOOL_CALLS]search[CALL_ID]a1b2c3d4e[ARGS]{"query": "12"}',
    "deepseek": 'Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>'
                'get_weather\n'
                '```json\n{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜>\n'
                '<｜tool▁call▁begin｜>search<｜tool▁sep｜>{"query": "12"}<｜tool▁call▁end｜>'
                '<｜tool▁calls▁end｜>',
    "deepseek-v3.2": 'Sure.<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
                     '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
                     '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
                     '</｜DSML｜invoke>\n<｜DSML｜invoke name="search">\n<｜DSML｜parameter '
                     'name="query" string="true">12</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
                     '</｜DSML｜function_calls>',
    "kimi": 'Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
            '<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|>'
            '<|tool_call_begin|>functions.search:1<|tool_call_argument_begin|>{"query": "12"}'
            '<|tool_call_end|><|tool_calls_section_end|>',
    "command-r": 'Sure.<|START_ACTION|>[\n{"tool_call_id": "0", "tool_name": "get_weather", '
                 '"parameters": {"city": "Paris", "days": 3}},\n{"tool_call_id": "1", '
                 '"tool_name": "search", "parameters": {"query": "12"}}\n]<|END_ACTION|>',
    "solar": 'Sure.<|tool_calls|><|tool_call:begin|>c1<|tool_call:name|>get_weather'
             '<|tool_call:args|>{"city": "Paris", "days": 3}<|tool_call:end|>'
             '<|tool_call:begin|>c2<|tool_call:name|>search<|tool_call:args|>{"query": "12"}'
             '<|tool_call:end|><|calls|>',
    "gemma4": 'Sure.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>'
              '<|tool_call>call:search{query:<|"|>12<|"|>}<tool_call|>',
    "lfm2": "Sure.<|tool_call_start|>[get_weather(city='Paris', days=3), search(query='12')]"
            "<|tool_call_end|>",
    "granite": 'Sure.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", '
               '"days": 3}}, {"name": "search", "arguments": {"query": "12"}}]',
    "llama3": 'Sure.<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
              '"days": 3}}; {"name": "search", "parameters": {"query": "12"}}',
    "apertus": 'Sure.<|tools_prefix|>[{"get_weather": {"city": "Paris", "days": 3}}, '
               '{"search": {"query": "12"}}]<|tools_suffix|>',
    "nemotron": 'Sure.<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris", '
                '"days": 3}}, {"name": "search", "arguments": {"query": "12"}}]</TOOLCALL>',
    "tool_calls": 'Sure.<tool_calls>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                  '"days": 3}}\n{"name": "search", "arguments": {"query": "12"}}\n</tool_calls>',
    "minimax": 'Sure.<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">'
               'Paris</parameter>\n<parameter name="days">3</parameter>\n</invoke>\n<invoke '
               'name="search">\n<parameter name="query">12</parameter>\n</invoke>\n'
               '</minimax:tool_call>',
    "seed": "Sure.<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n"
            "<parameter=days>3</parameter>\n</function>\n<function=search>\n<parameter=query>"
            "12</parameter>\n</function>\n</seed:tool_call>",
    "hunyuan": "Sure.<tool_calls:opensource>\n<tool_call:opensource>get_weather"
               "<tool_sep:opensource>\n<arg_key:opensource>city</arg_key:opensource>\n"
               "<arg_value:opensource>Paris</arg_value:opensource>\n<arg_key:opensource>days"
               "</arg_key:opensource>\n<arg_value:opensource>3</arg_value:opensource>\n"
               "</tool_call:opensource>\n<tool_call:opensource>search<tool_sep:opensource>\n"
               "<arg_key:opensource>query</arg_key:opensource>\n<arg_value:opensource>12"
               "</arg_value:opensource>\n</tool_call:opensource>\n</tool_calls:opensource>",
    "muse": 'Sure.<atem:function_calls>\n<atem:invoke name="get_weather">\n<atem:parameter '
            'name="city">Paris</atem:parameter>\n<atem:parameter name="days">3'
            '</atem:parameter>\n</atem:invoke>\n<atem:invoke name="search">\n<atem:parameter '
            'name="query">12</atem:parameter>\n</atem:invoke>\n</atem:function_calls>',
    "command-r-plus": 'Sure.\nAction:\n```json\n[{"tool_name": "get_weather", "parameters": '
                      '{"city": "Paris", "days": 3}}, {"tool_name": "search", "parameters": '
                      '{"query": "12"}}]\n```',
}
# families that write one call per marker pair, or whose body holds one call
ONE_CALL = {
    "gigachat": 'Sure.<|function_call|>{"name": "get_weather", "arguments": {"city": "Paris", '
                '"days": 3}}',
    "functionary": 'Sure.<function=get_weather>{"city": "Paris", "days": 3}</function>',
    "minicpm": 'Sure.<function name="get_weather"><param name="city">Paris</param>'
               '<param name="days">3</param></function>',
    "firefunction": 'Sure.\n functools[{"name": "get_weather", "arguments": {"city": "Paris", '
                    '"days": 3}}]',
}


def parsed(syntax: CallSyntax, text: str, step: int) -> tuple[str, list[tuple[str, object]]]:
    parser = MarkupParser(TOOLS, syntaxes=(TOOL_CALL, syntax))
    events: list[Event] = []
    for start in range(0, len(text), step):
        events += parser.feed(text[start:start + step])
    events += parser.finish()
    content = "".join(event.text for event in events if isinstance(event, ContentDelta))
    calls = [(event.name, json.loads(event.arguments)) for event in events
             if isinstance(event, ToolCall)]
    assert [event.index for event in events if isinstance(event, ToolCall)] == list(
        range(len(calls)))
    return content, calls


def test_every_family_is_tested() -> None:
    # (below, tests/test_harmony.py and tests/test_recipients.py)
    others = {"deepseek-v4", "harmony", "functionary-v3.2"}
    assert {syntax.family for syntax in FAMILIES} == {*ANSWERS, *ONE_CALL, *others}


@pytest.mark.parametrize("step", [1, 2, 7, 10_000])
@pytest.mark.parametrize("family", sorted(ANSWERS))
def test_a_familys_calls_come_out_whole_in_any_split(family: str, step: int) -> None:
    syntax = syntax_named(family)
    assert syntax is not None
    content, calls = parsed(syntax, ANSWERS[family], step)
    assert content.strip() == "Sure." and calls == TWO_CALLS


@pytest.mark.parametrize("family", sorted(ONE_CALL))
def test_families_of_one_call_a_body(family: str) -> None:
    syntax = syntax_named(family)
    assert syntax is not None
    content, calls = parsed(syntax, ONE_CALL[family], 3)
    assert content.strip() == "Sure." and calls == TWO_CALLS[:1]


def test_the_v4_dsml_markup_shares_v3_2s_parser() -> None:
    syntax = syntax_named("deepseek-v4")
    assert syntax is not None
    text = ANSWERS["deepseek-v3.2"].replace("function_calls>", "tool_calls>")
    assert parsed(syntax, text, 5) == ("Sure.", TWO_CALLS)


@pytest.mark.parametrize("family", ["mistral", "kimi", "deepseek", "solar", "gemma4", "lfm2"])
def test_broken_markup_stays_content(family: str) -> None:
    """An unknown tool, or arguments that do not parse: no such call, and its text comes
    out as content (a family that writes one call per marker pair keeps the good one)."""
    syntax = syntax_named(family)
    assert syntax is not None
    for broken in (ANSWERS[family].replace("get_weather", "launch_rockets"),
                   ANSWERS[family].replace("3", "3,,", 1)):
        content, calls = parsed(syntax, broken, 4)
        assert [name for name, _ in calls] in ([], ["search"])
        assert ("launch_rockets" if "launch" in broken else "3,,") in content
        if not calls:
            assert content == broken


def test_a_closing_marker_never_reached_leaves_the_text_as_content() -> None:
    syntax = syntax_named("kimi")
    assert syntax is not None
    cut = ANSWERS["kimi"].removesuffix("<|tool_calls_section_end|>")
    assert parsed(syntax, cut, 3) == (cut, [])


@pytest.mark.parametrize("family", ["command-r-plus", "firefunction"])
def test_a_marker_that_is_an_ordinary_word_opens_a_call_only_at_a_line_start(
        family: str) -> None:
    """`Action:` in a sentence is text, and what follows it streams on as it comes."""
    syntax = syntax_named(family)
    assert syntax is not None
    parser = MarkupParser(TOOLS, syntaxes=(TOOL_CALL, syntax))
    text = f"The {syntax.open} is next, and so on."
    first = parser.feed(text[:len(text) // 2 + 4])
    assert first and all(isinstance(event, ContentDelta) for event in first)
    events = first + parser.feed(text[len(text) // 2 + 4:]) + parser.finish()
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == text


def test_odd_output_never_raises_and_stays_text() -> None:
    """Nesting too deep for JSON, Python literals that are not JSON, `**` arguments."""
    cases = {"mistral": "[TOOL_CALLS]" + "[" * 5000,
             "granite": "<|tool_call|>" + '{"a": ' * 3000,
             "lfm2": "<|tool_call_start|>[get_weather(city={1, 2})]<|tool_call_end|>",
             "gemma4": '<|tool_call>call:get_weather{city:' + "[" * 3000 + "}<tool_call|>"}
    for family, text in cases.items():
        syntax = syntax_named(family)
        assert syntax is not None
        assert parsed(syntax, text, 997) == (text, []), family
    lfm2 = syntax_named("lfm2")
    assert lfm2 is not None
    spread = "<|tool_call_start|>[get_weather(**{'city': 'Paris'})]<|tool_call_end|>"
    assert parsed(lfm2, spread, 5) == (spread, [])


def test_without_tools_the_markup_is_text() -> None:
    syntax = syntax_named("mistral")
    assert syntax is not None
    parser = MarkupParser(None, syntaxes=(TOOL_CALL, syntax))
    events = parser.feed(ANSWERS["mistral"]) + parser.finish()
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == ANSWERS["mistral"]


def test_tool_call_tags_still_work_beside_a_family() -> None:
    syntax = syntax_named("mistral")
    assert syntax is not None
    text = 'Ok <tool_call>{"name": "search", "arguments": {"query": "12"}}</tool_call>'
    assert parsed(syntax, text, 3) == ("Ok ", [("search", {"query": "12"})])


@settings(max_examples=200)
@given(st.sampled_from(sorted(ANSWERS)), st.lists(st.integers(1, 400), max_size=8))
def test_any_split_equals_the_whole(family: str, cuts: list[int]) -> None:
    syntax = syntax_named(family)
    assert syntax is not None
    text = ANSWERS[family]
    parser = MarkupParser(TOOLS, syntaxes=(TOOL_CALL, syntax))
    events: list[Event] = []
    points = sorted({min(cut, len(text)) for cut in cuts})
    for start, end in zip([0, *points], [*points, len(text)], strict=True):
        events += parser.feed(text[start:end])
    events += parser.finish()
    assert [(e.name, json.loads(e.arguments)) for e in events
            if isinstance(e, ToolCall)] == TWO_CALLS


def test_the_family_is_the_first_marker_a_template_writes_a_call_with() -> None:
    qwen3_coder = "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>"
    assert family_syntax(qwen3_coder, "") is None  # `<function=` inside `<tool_call>`
    functionary = '<function=f>{"x": 1}</function>'
    assert family_syntax(functionary, "<|python_tag|>") == syntax_named("functionary")
    assert family_syntax('{"name": "f"}', "{{ '<|python_tag|>' }}") == syntax_named("llama3")
    assert family_syntax("", "plain ChatML") is None


# ---------------------------------------------------------------- calls cut short

# JSON as models write it (escapes, unicode, nesting, every kind of scalar), read at every
# length as the start of a JSON text.
JSON_TEXTS = [
    '{"name": "get_weather", "arguments": {"city": "Par\\"is\\\\", "days": -3, '
    '"at": 1.5e+3, "tags": ["a", {"b": null}], "metric": true, "town": "Zürich 🙂 \\u00e9"}}',
    ' [1, 0, -0.25, [], {}, false, "", "x\\ny"] ',
    '{"deep": [[[{"k": [true, false, null]}]]], "n": 12345678901234567890}',
]


@pytest.mark.parametrize("text", JSON_TEXTS)
def test_a_json_prefix_reads_as_anthropics_sdk_reads_a_partial_input(text: str) -> None:
    """What read_prefix holds at every length is what jiter's partial mode (which the
    anthropic SDK reads a streamed tool input with) makes of it, and the whole text is
    complete only at its end."""
    jiter = pytest.importorskip("jiter")
    for length in range(len(text) + 1):
        prefix = text[:length]
        read = read_prefix(prefix)
        assert read is not None, prefix
        if not prefix.strip():
            assert read.empty and not read.complete
            continue
        assert read.value == jiter.from_json(prefix.encode(), partial_mode=True), prefix
        assert read.complete == (length >= len(text.rstrip())), prefix


@pytest.mark.parametrize("text", [
    '{"a" 1', "{a: 1", '{"a": tru e', "[1,]", '{"a": 01', '{"a": "x\\q"}', '{"a": 1,}',
    "{'a': 1}", '{"a": -x',
    # jiter's partial mode reads past these (the first value, brackets matched loosely):
    '{"a": 1}}', '{"a": 1}{', '{"a": [1}', '"text" 2',
])
def test_what_cannot_begin_a_json_text_is_refused(text: str) -> None:
    assert read_prefix(text) is None


def test_a_json_prefix_says_where_each_top_level_member_lies() -> None:
    text = '{"name": "f", "arguments": {"a": [1, 2]}, "x": 3, "y": {"z": "un'
    read = read_prefix(text)
    assert read is not None
    spans = {key: text[start:end] for key, (start, end) in read.members.items()}
    assert spans == {"name": '"f"', "arguments": '{"a": [1, 2]}', "x": "3",
                     "y": '{"z": "un'}  # (cut: to the end)
    assert read.value == {"name": "f", "arguments": {"a": [1, 2]}, "x": 3, "y": {}}
    cut = read_prefix('{"x": 3, "y": "a string cut')
    assert cut is not None and cut.value == {"x": 3}  # (not a value yet, but a member)
    assert cut.members == {"x": (6, 7), "y": (14, None)}


@pytest.mark.parametrize(("body", "expected"), [
    ('{"name": "get_weather", "arguments": {"city": "Pa',
     [("get_weather", '{"city": "Pa')]),
    ('{"name": "get_weather", "arguments": {"city": "Paris", "days": 1',
     [("get_weather", '{"city": "Paris", "days": 1')]),
    ('\n{"name": "get_weather", "arguments": {"city": "Paris"}',  # whole, the call not
     [("get_weather", '{"city": "Paris"}')]),
    ('{"arguments": {"days": 2}, "name": "get_weather"', [("get_weather", '{"days": 2}')]),
    ('{"name": "get_weather", "arguments": "{\\"city\\": \\"Pa',  # double-encoded
     [("get_weather", '{"city": "Pa')]),
    ('{"name": "get_weather", "argum', [("get_weather", "")]),  # not begun
    ('{"name": "get_weather", "parameters": ', [("get_weather", "")]),
    ('{"name": "get_wea', None),  # the name not finished
    ('{"arguments": {"city": "Paris"}, "na', None),
    ('{"name": "launch", "arguments": {"city": "Pa', None),  # not offered
    ('{"name": "get_weather", "arguments": [1, 2', None),  # not an object
    ('{"name": "get_weather", "arguments": {city: ', None),  # not JSON
    ('{"name": "get_weather", "arguments": "not json', None),
])
def test_a_json_call_cut_short(body: str, expected: list[tuple[str, str]] | None) -> None:
    assert cut_json_call(body, TOOLS) == expected
    assert cut_tool_call_body(body, TOOLS) == expected


@pytest.mark.parametrize(("body", "expected"), [
    ("<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n",
     [("get_weather", '{"city": "Paris"')]),
    ("<function=get_weather>\n<parameter=days>\n3\n</parameter>\n<param",
     [("get_weather", '{"days": 3')]),  # typed by the schema
    ("<function=get_weather>\n<parameter=ci", [("get_weather", "{")]),
    ("<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</func",
     [("get_weather", '{"days": 3')]),
    ("<function=search>\n<parameter=query>\nq\n</parameter>\n</function>\n<function=get_weather>",
     [("search", '{"query": "q"}'), ("get_weather", "{")]),
    ("<function=get_wea", None),
    ("<function=launch>\n<parameter=x>\n1\n</parameter>\n", None),
    ("<function=get_weather>\nwords\n<parameter=city>\nParis\n</parameter>\n", None),
    ("get_weather<arg_key>city</arg_key>", None),  # (key/value: no reader for a cut call)
])
def test_an_xml_call_cut_short(body: str, expected: list[tuple[str, str]] | None) -> None:
    assert cut_tool_call_body(body, TOOLS) == expected


@pytest.mark.parametrize(("arguments", "expected"), [
    ('{"city": "Paris", "days": 3}', {"city": "Paris", "days": 3}),
    ('{"city": "Paris", "days": 3', {"city": "Paris", "days": 3}),
    ('{"city": "Paris", "days": [1, 2], "town": "Ly', {"city": "Paris", "days": [1, 2]}),
    ("", {}), ("{", {}), ("[1, 2]", {}), ("{city: 1}", {}),
])
def test_arguments_as_an_object(arguments: str, expected: dict[str, object]) -> None:
    assert arguments_object(arguments) == expected
