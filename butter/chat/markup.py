"""Incremental markup parser: think blocks and tool calls out of generated text (pure).

Text goes in as it is generated; events come out: content, reasoning, and complete tool
calls. A tag split across deltas (`<tool_` + `call>`) is held back until it can be
decided, so raw markup never leaks into content. Tool calls are recognised in each
syntax the parser is given (chat/tool_calls.py: `<tool_call>` always, and the model
family's own markup where its template writes another): the body is buffered until the
syntax's closing marker (or the end of the answer, where it has none) and parsed by that
family's parser.

With `bare_json_calls` (templates that write calls as bare JSON: Llama 3.x, Mistral Nemo),
an answer that begins with `{` or `[` is held to its end and becomes calls if it is one
call object, or an array of them, of tools offered (`name` with `arguments` or
`parameters`); else it is content.

Broken markup that the model ended (unclosed at its end of turn, invalid JSON, an unknown
function) degrades to plain content. An answer that max_tokens cut inside a call
(`finish(cut=True)`) never shows its markup: the call comes back as far as it was written
where its function's name is complete (its arguments the start of a JSON object, the text
the model wrote), else nothing of it does; `cut_inside_call` then says so. Feeding the
same text in any split gives the same events, merged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from butter.chat.tool_calls import (
    CALL_CLOSE,
    CALL_OPEN,
    TOOL_CALL,
    CallSyntax,
    ToolSchemas,
    cut_json_call,
    parse_bare_json_calls,
    parse_tool_call_body,
)

__all__ = [
    "CALL_CLOSE", "CALL_OPEN", "THINK_CLOSE", "THINK_OPEN", "ContentDelta", "Event",
    "MarkupParser", "ReasoningDelta", "ToolCall", "ToolSchemas", "earliest_tag",
    "parse_bare_json_calls", "parse_tool_call_body", "partial_tag_suffix",
]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@attrs.frozen
class ContentDelta:
    text: str


@attrs.frozen
class ReasoningDelta:
    text: str


@attrs.frozen
class ToolCall:
    index: int
    id: str
    name: str
    # A JSON object, as text; of a call cut short by max_tokens, the start of one, as far as
    # it was written (tool_calls.arguments_object reads it as an object).
    arguments: str


Event = ContentDelta | ReasoningDelta | ToolCall


class MarkupParser:
    def __init__(
        self,
        tools: ToolSchemas | None = None,
        *,
        start_in_reasoning: bool = False,
        new_call_id: Callable[[int], str] = lambda index: f"call_{index}",
        bare_json_calls: bool = False,
        syntaxes: Sequence[CallSyntax] = (TOOL_CALL,),
    ) -> None:
        self._tools = tools
        self._syntaxes = tuple(syntaxes)
        self._opens = {syntax.open: syntax for syntax in self._syntaxes}
        self._syntax = self._syntaxes[0]  # the open call's
        self._new_call_id = new_call_id
        self._mode = "reasoning" if start_in_reasoning else "content"
        # Until the answer's first visible character: may it be a bare JSON call?
        self._bare_possible = bare_json_calls and bool(tools)
        self._pending = ""
        self._body = ""  # the open tool call's text
        self._lstrip = start_in_reasoning  # drop whitespace right after a tag
        self._line_blank = True  # nothing but blanks emitted since the last newline
        self._calls = 0
        self._cut_inside_call = False

    @property
    def tool_calls(self) -> int:
        return self._calls

    @property
    def cut_inside_call(self) -> bool:
        """The answer was cut (finish(cut=True)) inside a call's markup, or where a call's
        marker may have begun: its last call, if any came back, is not whole."""
        return self._cut_inside_call

    def feed(self, text: str) -> list[Event]:
        if self._mode == "bare":
            self._body += text
            return []
        self._pending += text
        events: list[Event] = []
        if self._bare_possible and self._mode == "content":
            start = self._pending.lstrip()
            if not start:
                return events  # only whitespace so far: undecided
            self._bare_possible = False
            if start[0] in "{[":
                self._mode, self._body, self._pending = "bare", start, ""
                return events
        while True:
            tags = self._tags()
            found = earliest_tag(self._pending, tags)
            if found is None:
                keep = partial_tag_suffix(self._pending, tags)
                ready, self._pending = _split_at(self._pending, len(self._pending) - keep)
                self._emit(ready, events)
                return events
            index, tag = found
            if self._mode == "content" and tag in self._opens and self._opens[tag].line_start \
                    and not self._starts_a_line(self._pending[:index]):
                # An ordinary word (`Action:`) inside a line: text, not a call.
                self._emit(self._pending[:index + len(tag)], events)
                self._pending = self._pending[index + len(tag):]
                continue
            self._emit(self._pending[:index], events)
            self._pending = self._pending[index + len(tag):]
            self._switch(tag, events)

    def _starts_a_line(self, before: str) -> bool:
        """Text emitted so far and then `before` leave nothing but blanks on their line."""
        _, newline, last = before.rpartition("\n")
        return not last.strip(" \t") and bool(newline or self._line_blank)

    def finish(self, *, cut: bool = False) -> list[Event]:
        """End of generation: release held text. `cut`: max_tokens ended it (not the
        model), so a call it ended inside comes back as far as it was written, or not at
        all; else an unclosed call becomes content."""
        events: list[Event] = []
        pending, self._pending = self._pending, ""
        tools = self._tools or {}
        if self._mode == "bare":
            self._mode = "content"
            parsed = parse_bare_json_calls(self._body, tools)
            if parsed is None and cut:  # a call only if it names an offered tool
                parsed = cut_json_call(self._body, tools)
                self._cut_inside_call = parsed is not None
            calls = self._calls_from(parsed)
            if calls is None:
                self._emit(self._body, events)
            else:
                events.extend(calls)
            self._body = ""
            return events
        if self._mode == "tool":
            self._mode = "content"
            if cut:  # (a partial closing marker held in `pending` is markup too)
                body, self._body = self._body, ""
                parsed = self._syntax.parse(body, tools)
                self._cut_inside_call = self._syntax.close is not None or parsed is None
                if parsed is None and self._syntax.cut is not None:
                    parsed = self._syntax.cut(body, tools)
                events.extend(self._calls_from(parsed) or [])
                return events
            body, self._body = self._body + pending, ""
            calls = self._parse_body(body) if self._syntax.close is None else None
            if calls is None:  # unclosed: as it came
                self._lstrip = False
                self._emit(self._syntax.open + body, events)
            else:
                events.extend(calls)
        elif cut and self._mode == "content" and self._may_open_call(pending):
            self._cut_inside_call = True  # a call's marker, cut short: left out
        else:
            self._emit(pending, events)
        return events

    # ------------------------------------------------------------------ internals

    def _tags(self) -> tuple[str, ...]:
        if self._mode == "reasoning":
            return (THINK_CLOSE,)
        if self._mode == "tool":
            return (self._syntax.close,) if self._syntax.close else ()
        return (THINK_OPEN, *self._opens) if self._tools else (THINK_OPEN,)

    def _may_open_call(self, held: str) -> bool:
        """The held text at the end may be the start of a call's opening marker."""
        return bool(held) and any(
            syntax.open.startswith(held) and (not syntax.line_start or self._line_blank)
            for syntax in self._syntaxes) and bool(self._tools)

    def _emit(self, text: str, events: list[Event]) -> None:
        if self._mode == "tool":
            self._body += text
            return
        if self._lstrip:
            text = text.lstrip()
            if not text:
                return
            self._lstrip = False
        if not text:
            return
        if self._mode == "content":
            self._bare_possible = False  # the answer has begun: not a bare call
        _, newline, last = text.rpartition("\n")
        self._line_blank = not last.strip(" \t") and (bool(newline) or self._line_blank)
        event: Event = ReasoningDelta(text) if self._mode == "reasoning" else ContentDelta(text)
        events.append(event)

    def _switch(self, tag: str, events: list[Event]) -> None:
        if tag == THINK_OPEN:
            self._mode, self._lstrip = "reasoning", True
        elif tag == THINK_CLOSE:
            self._mode, self._lstrip = "content", True
        elif tag in self._opens:
            self._mode, self._body, self._syntax = "tool", "", self._opens[tag]
        else:  # the open call's close
            self._mode = "content"
            calls = self._parse_body(self._body)
            if calls is None:
                self._emit(self._syntax.open + self._body + tag, events)
            else:
                events.extend(calls)
                self._lstrip = True
            self._body = ""

    def _parse_body(self, body: str) -> list[ToolCall] | None:
        return self._calls_from(self._syntax.parse(body, self._tools or {}))

    def _calls_from(self, parsed: list[tuple[str, str]] | None) -> list[ToolCall] | None:
        if parsed is None:
            return None
        calls = []
        for name, arguments in parsed:
            calls.append(ToolCall(index=self._calls, id=self._new_call_id(self._calls),
                                  name=name, arguments=arguments))
            self._calls += 1
        return calls


def earliest_tag(text: str, tags: tuple[str, ...]) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for tag in tags:
        index = text.find(tag)
        if index >= 0 and (best is None or index < best[0]):
            best = (index, tag)
    return best


def partial_tag_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that could still grow into a tag."""
    longest = 0
    for tag in tags:
        for length in range(min(len(tag) - 1, len(text)), longest, -1):
            if text.endswith(tag[:length]):
                longest = length
                break
    return longest


def _split_at(text: str, index: int) -> tuple[str, str]:
    return text[:index], text[index:]
