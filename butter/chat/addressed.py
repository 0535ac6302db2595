"""What answers made of addressed messages share (gpt-oss's harmony, Functionary v3.2):
text in, events out, a message to a function read as a call of an offered tool (pure)."""

from __future__ import annotations

from collections.abc import Callable

from butter.chat.markup import Event, ToolCall, partial_tag_suffix
from butter.chat.tool_calls import ToolSchemas, json_arguments_call


class AddressedMessages:
    """The parsers' common part: the held text, the step loop, the calls' numbering."""

    def __init__(self, tools: ToolSchemas | None = None, *,
                 new_call_id: Callable[[int], str] = lambda index: f"call_{index}") -> None:
        self._tools = tools or {}
        self._new_call_id = new_call_id
        self._pending = ""
        self._calls = 0

    @property
    def tool_calls(self) -> int:
        return self._calls

    def feed(self, text: str) -> list[Event]:
        self._pending += text
        events: list[Event] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[Event]:
        events: list[Event] = []
        pending, self._pending = self._pending, ""
        if self._in_header:
            self._header_cut_short(pending, events)
            return events
        self._emit(pending, events)
        self._close(events)
        return events

    # What each format fills in:
    _in_header = True  # reading a message's header (its first one, at the start)

    def _step(self, events: list[Event]) -> bool:
        """Consume what can be decided; False when more text is needed."""
        raise NotImplementedError

    def _header_cut_short(self, text: str, events: list[Event]) -> None:
        """The answer ended inside a header: what of it is text."""
        raise NotImplementedError

    def _emit(self, text: str, events: list[Event]) -> None:
        raise NotImplementedError

    def _close(self, events: list[Event]) -> None:
        """The open message has ended."""
        raise NotImplementedError

    def _take_ready(self, markers: tuple[str, ...]) -> str:
        """The held text but for an end that may still grow into one of `markers`."""
        keep = partial_tag_suffix(self._pending, markers)
        ready = self._pending[:len(self._pending) - keep]
        self._pending = self._pending[len(ready):]
        return ready

    def _call(self, function: str, body: str) -> ToolCall | None:
        """A message to `function` as a call, if it names an offered tool and its text is a
        JSON object of arguments."""
        parsed = json_arguments_call(function, body, self._tools)
        if parsed is None:
            return None
        name, arguments = parsed
        call = ToolCall(index=self._calls, id=self._new_call_id(self._calls), name=name,
                        arguments=arguments)
        self._calls += 1
        return call
