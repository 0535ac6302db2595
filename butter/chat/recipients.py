"""Functionary v3.2's answers (pure): messages addressed to a recipient, each
`>>>recipient` on a line of its own and then its text. The generation prompt ends with
`>>>`, so an answer opens with its first recipient:

    all
    Let me check.>>>get_weather
    {"city": "Paris"}

`all` is the answer to the user; any other recipient is a function, and the message's
text its arguments' JSON. An answer whose first line is no recipient is plain content.
Fed in any split, the events are the same.

Cut by max_tokens (`finish(cut=True)`), a message to an offered function is a call as far
as it was written once its recipient's line is complete, with the arguments written so
far; a recipient cut short that may still name an offered function is left out.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from butter.chat.addressed import AddressedMessages
from butter.chat.markup import ContentDelta, Event
from butter.chat.tool_calls import ToolSchemas

NEXT = ">>>"
TO_USER = "all"
_RECIPIENT = re.compile(r"\A[\w.-]{1,64}\Z")
_LONGEST_RECIPIENT = 64


class RecipientParser(AddressedMessages):
    """Addressed messages → content and tool-call events (MarkupParser's seam)."""

    def __init__(self, tools: ToolSchemas | None = None, *,
                 new_call_id: Callable[[int], str] = lambda index: f"call_{index}") -> None:
        super().__init__(tools, new_call_id=new_call_id)
        self._in_header = True  # reading a recipient
        self._marker = ""  # what opened it: nothing (the prompt's `>>>`), or `>>>`
        self._header = ""  # the open message's `>>>recipient` line, as it came
        self._function: str | None = None  # the open message's, None: to the user
        self._body = ""  # the open call's text

    def _header_cut_short(self, text: str, events: list[Event]) -> None:
        self._function = None
        if text.strip() != TO_USER:  # a lone recipient says nothing
            self._emit(self._marker + text, events)

    def _header_cut(self, text: str, events: list[Event]) -> None:
        # (A header is decided at its newline: here, the recipient is not complete.)
        written = text.strip()
        if (self._marker or written) and any(name.startswith(written) for name in self._tools):
            self._cut_inside_call = True  # may still name an offered function: left out
            return
        self._header_cut_short(text, events)

    def _may_open_message(self, held: str) -> bool:
        return NEXT.startswith(held)

    def _step(self, events: list[Event]) -> bool:
        """Consume what can be decided; False when more text is needed."""
        if self._in_header:
            line, newline, rest = self._pending.partition("\n")
            recipient = line.strip()
            if not newline and len(line) <= _LONGEST_RECIPIENT and (
                    not recipient or _RECIPIENT.match(recipient)):
                return False  # may still be a recipient
            self._in_header = False
            if newline and _RECIPIENT.match(recipient):
                self._header = f"{self._marker}{line}\n"
                self._function = None if recipient == TO_USER else recipient
                self._pending = rest
            else:  # no recipient: the `>>>` was text
                self._function = None
                self._emit(self._marker, events)
            return True
        index = self._pending.find(NEXT)
        if index < 0:
            self._emit(self._take_ready((NEXT,)), events)
            return False
        self._emit(self._pending[:index], events)
        self._close(events)
        self._pending = self._pending[index + len(NEXT):]
        self._in_header, self._marker = True, NEXT
        return True

    def _emit(self, text: str, events: list[Event]) -> None:
        if not text:
            return
        if self._function is not None:
            self._body += text
        else:
            events.append(ContentDelta(text))

    def _close(self, events: list[Event], *, cut: bool = False) -> None:
        if self._function is None:
            return
        function, self._function = self._function, None
        body, self._body = self._body, ""
        if cut and function in self._tools:
            cut_call = self._cut_call(function, body)
            events.extend([cut_call] if cut_call is not None else [])
            return
        call = self._call(function, body)
        events.append(ContentDelta(self._header + body) if call is None else call)
