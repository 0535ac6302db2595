"""gpt-oss's harmony format (pure): an answer is a run of messages, each a header, then
`<|message|>`, then its text, ended by `<|end|>`, `<|return|>` or `<|call|>` (or by the next
message's `<|start|>`). The header names the channel and, for a tool call, the recipient:

    <|channel|>analysis<|message|>We need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"city": "Paris"}<|call|>

`analysis` is reasoning, `final` (and `commentary` to no one) is the answer, and a message
to `functions.NAME` is a tool call whose text is the arguments' JSON. An answer that does
not begin with a header is plain content. Fed in any split, the events are the same.

Cut by max_tokens (`finish(cut=True)`), a message to an offered function is a call as far
as it was written once its recipient is complete (followed by a space or a marker), with
the arguments written so far; a header that may still become a call's is left out.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from butter.chat.addressed import AddressedMessages
from butter.chat.markup import ContentDelta, Event, ReasoningDelta, earliest_tag
from butter.chat.tool_calls import ToolSchemas

CHANNEL, MESSAGE, START, CONSTRAIN = "<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
_MESSAGE_ENDS = (*ENDS, START, CHANNEL)  # what ends a message's text
# Every marker the parser reads (the backends write them out as text).
MARKERS = (CHANNEL, MESSAGE, START, CONSTRAIN, *ENDS)
# A header opens with a marker, or with the recipient (the prompt ends `<|start|>assistant`).
_HEADER_STARTS = (CHANNEL, START, "to=")
_LONGEST_HEADER = 256  # characters: past this without `<|message|>`, it was no header
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
_FUNCTIONS = "functions."
_OPENINGS = (START, CHANNEL)  # what opens the next message (which may be a call)


class HarmonyParser(AddressedMessages):
    """Harmony messages → reasoning, content and tool-call events (MarkupParser's seam)."""

    def __init__(self, tools: ToolSchemas | None = None, *,
                 new_call_id: Callable[[int], str] = lambda index: f"call_{index}") -> None:
        super().__init__(tools, new_call_id=new_call_id)
        self._in_header = True
        self._kind = "content"  # of the open message: content, reasoning or call
        self._function = ""  # the open call's function
        self._body = ""  # the open call's text

    def _header_cut_short(self, text: str, events: list[Event]) -> None:
        if "<|" not in text:  # markup cut short is not text; anything else is
            self._kind = "content"
            self._emit(text, events)

    def _header_cut(self, text: str, events: list[Event]) -> None:
        if not text.strip():
            return
        recipient = _RECIPIENT.search(text)
        named = recipient.group(1) if recipient else None
        if recipient is not None and recipient.end() < len(text):  # the name is complete
            function = recipient.group(1).removeprefix(_FUNCTIONS)
            if recipient.group(1).startswith(_FUNCTIONS) and function in self._tools:
                call = self._cut_call(function, "")  # (its arguments not begun)
                events.extend([call] if call is not None else [])
                return
        elif self._tools and (named is None or _may_address(named, self._tools)):
            self._cut_inside_call = True  # a call's header may have begun: left out
            return
        self._header_cut_short(text, events)

    def _may_open_message(self, held: str) -> bool:
        return any(marker.startswith(held) for marker in _OPENINGS)

    # ------------------------------------------------------------------ internals

    def _step(self, events: list[Event]) -> bool:
        """Consume what can be decided; False when more text is needed."""
        if self._in_header:
            index = self._pending.find(MESSAGE)
            header = self._pending if index < 0 else self._pending[:index]
            if not _may_be_header(header):
                self._in_header, self._kind = False, "content"  # no header: plain text
                return True
            if index < 0:
                return False
            self._open(self._pending[:index])
            self._pending = self._pending[index + len(MESSAGE):]
            return True
        found = earliest_tag(self._pending, _MESSAGE_ENDS)
        if found is None:
            self._emit(self._take_ready(_MESSAGE_ENDS), events)
            return False
        index, tag = found
        self._emit(self._pending[:index], events)
        self._close(events)
        self._pending = self._pending[index + (len(tag) if tag in ENDS else 0):]
        self._in_header = True
        return True

    def _open(self, header: str) -> None:
        self._in_header = False
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL_NAME.search(header)
        if recipient and recipient.group(1).startswith(_FUNCTIONS):
            self._kind, self._function, self._body = (
                "call", recipient.group(1).removeprefix(_FUNCTIONS), "")
        elif channel and channel.group(1) == "analysis":
            self._kind = "reasoning"
        else:
            self._kind = "content"

    def _emit(self, text: str, events: list[Event]) -> None:
        if not text:
            return
        if self._kind == "call":
            self._body += text
        elif self._kind == "reasoning":
            events.append(ReasoningDelta(text))
        else:
            events.append(ContentDelta(text))

    def _close(self, events: list[Event], *, cut: bool = False) -> None:
        if self._kind != "call":
            return
        self._kind = "content"
        body, self._body = self._body, ""
        if cut and self._function in self._tools:
            cut_call = self._cut_call(self._function, body)
            events.extend([cut_call] if cut_call is not None else [])
            return
        call = self._call(self._function, body)
        if call is None:  # not a call of an offered tool: its text, as it came
            self._emit(body, events)
        else:
            events.append(call)


def _may_address(recipient: str, tools: ToolSchemas) -> bool:
    """A recipient cut short may still become `functions.` and an offered tool's name."""
    if not recipient.startswith(_FUNCTIONS):
        return _FUNCTIONS.startswith(recipient)
    written = recipient.removeprefix(_FUNCTIONS)
    return any(name.startswith(written) for name in tools)


def _may_be_header(text: str) -> bool:
    """`text` is (the start of) a message header: a marker or a recipient first, and not
    too long."""
    start = text.lstrip()
    return len(text) <= _LONGEST_HEADER and (
        not start or any(start.startswith(opening) or opening.startswith(start)
                         for opening in _HEADER_STARTS))
