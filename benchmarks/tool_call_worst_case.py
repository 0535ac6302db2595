#!/usr/bin/env python3
"""The tool-call parsers on degenerate model output: every family's opening marker followed
by thousands of repeats of a marker fragment (closed and unclosed), through the streaming
parsers. Prints any case over 0.2 s and the worst one. The parsers run on the event loop's
thread, so this must stay linear (a backtracking regex once took 106 s on 5k characters).

    python benchmarks/tool_call_worst_case.py [REPEATS]
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

if not __package__:  # run as a file: the repository root, not benchmarks/, on sys.path
    import _repo_root  # noqa: F401

from butter.chat.answers import AnswerParser
from butter.chat.harmony import HarmonyParser
from butter.chat.markup import MarkupParser
from butter.chat.recipients import RecipientParser
from butter.chat.tool_calls import FAMILIES, TOOL_CALL

TOOLS = {"f": {"type": "object", "properties": {"x": {"type": "string"}}}}
FRAGMENTS = [
    "<function=f>", "<parameter=x>", "</parameter>", "<arg_key>a</arg_key>", "<arg_value>",
    '<invoke name="f">', '<parameter name="x">', '<｜DSML｜invoke name="f">',
    '<｜DSML｜parameter name="x" string="true">', "```", "```json", " ", "\n", "[", "{",
    "<tool_call>", '<param name="x">', "<|tool_call:name|>x<|tool_call:args|>",
    "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>", '<|"|>', "call:f{", "x:", "f(", "x=", "<|message|>", "to=functions.f",
    ">>>", "<tool_call:opensource>f<tool_sep:opensource>", ":",
]


def seconds(parser: AnswerParser, text: str) -> float:
    start = time.perf_counter()
    parser.feed(text)
    parser.finish()
    return time.perf_counter() - start


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    cases: list[tuple[str, Callable[[], AnswerParser], str]] = []
    for syntax in (TOOL_CALL, *FAMILIES):
        for fragment in FRAGMENTS:
            for close in ("", syntax.close or ""):
                cases.append((f"{syntax.family} {fragment!r} close={bool(close)}",
                              lambda syntax=syntax: MarkupParser(  # type: ignore[misc]
                                  TOOLS, syntaxes=(TOOL_CALL, syntax)),
                              syntax.open + fragment * repeats + close))
    for parser in (HarmonyParser, RecipientParser):
        for fragment in FRAGMENTS:
            cases.append((f"{parser.__name__} {fragment!r}",
                          lambda parser=parser: parser(TOOLS),  # type: ignore[misc]
                          fragment * repeats))
    worst = (0.0, "")
    for label, make, text in cases:
        took = seconds(make(), text)
        if took > 0.2:
            print(f"SLOW {took:.2f} s  {label}")
        worst = max(worst, (took, label))
    print(f"{len(cases)} cases of {repeats} repeats; worst {worst[0] * 1000:.1f} ms: {worst[1]}")


if __name__ == "__main__":
    main()
