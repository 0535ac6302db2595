"""What answers made of addressed messages share (gpt-oss's harmony, Functionary v3.2):
text in, events out, a message to a function read as a call of an offered tool (pure).

An answer that max_tokens cut short (`finish(cut=True)`) follows MarkupParser's rule: a
message to an offered function comes back as a call as far as it was written once the
function's name is complete (its arguments the start of a JSON object, the text the model
wrote, "" where it had not begun them); a header that may still become a call's is left
out, as is a marker cut halfway; `cut_inside_call` says where a call was cut or may have
begun."""

from __future__ import annotations

from collections.abc import Callable

from butter.chat.markup import Event, ToolCall, partial_tag_suffix
from butter.chat.partial_json import read_prefix
from butter.chat.tool_calls import ToolSchemas, json_arguments_call


class AddressedMessages:
    """The parsers' common part: the held text, the step loop, the calls' numbering."""

    def __init__(self, tools: ToolSchemas | None = None, *,
                 new_call_id: Callable[[int], str] = lambda index: f"call_{index}") -> None:
        self._tools = tools or {}
        self._new_call_id = new_call_id
        self._pending = ""
        self._calls = 0
        self._cut_inside_call = False

    @property
    def tool_calls(self) -> int:
        return self._calls

    @property
    def cut_inside_call(self) -> bool:
        """The answer was cut (finish(cut=True)) inside a call's message, or where one may
        have begun: its last call, if any came back, is not whole."""
        return self._cut_inside_call

    def feed(self, text: str) -> list[Event]:
        self._pending += text
        events: list[Event] = []
        while self._step(events):
            pass
        return events

    def finish(self, *, cut: bool = False) -> list[Event]:
        """End of generation: release held text. `cut`: max_tokens ended it (not the
        model), so a call it ended inside comes back as far as it was written, or not at
        all; else an unfinished call is text, as it came."""
        events: list[Event] = []
        pending, self._pending = self._pending, ""
        if self._in_header:
            if cut:
                self._header_cut(pending, events)
            else:
                self._header_cut_short(pending, events)
            return events
        if not cut:
            self._emit(pending, events)
        elif self._tools and pending and self._may_open_message(pending):
            self._cut_inside_call = True  # (what is held is a marker begun: left out)
        self._close(events, cut=cut)
        return events

    # What each format fills in:
    _in_header = True  # reading a message's header (its first one, at the start)

    def _step(self, events: list[Event]) -> bool:
        """Consume what can be decided; False when more text is needed."""
        raise NotImplementedError

    def _header_cut_short(self, text: str, events: list[Event]) -> None:
        """The answer ended inside a header: what of it is text."""
        raise NotImplementedError

    def _header_cut(self, text: str, events: list[Event]) -> None:
        """max_tokens cut the answer inside a header: a call where it names an offered
        function in full, nothing where it may still become a call's, else as
        `_header_cut_short`."""
        raise NotImplementedError

    def _may_open_message(self, held: str) -> bool:
        """The held end of a message may be the start of the next message's marker."""
        raise NotImplementedError

    def _emit(self, text: str, events: list[Event]) -> None:
        raise NotImplementedError

    def _close(self, events: list[Event], *, cut: bool = False) -> None:
        """The open message has ended (`cut`: max_tokens ended it)."""
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
        return None if parsed is None else self._new_call(*parsed)

    def _cut_call(self, function: str, body: str) -> ToolCall | None:
        """A message to `function`, an offered tool, that max_tokens cut short: the call as
        far as it was written, its arguments the text so far where that is the start of a
        JSON object (or nothing yet), else None (left out). A whole call is whole."""
        call = self._call(function, body)
        if call is not None:
            return call
        self._cut_inside_call = True
        written = body.strip()
        if written:
            prefix = read_prefix(written)
            if prefix is None or not isinstance(prefix.value, dict):
                return None
        return self._new_call(function.strip(), written)

    def _new_call(self, name: str, arguments: str) -> ToolCall:
        call = ToolCall(index=self._calls, id=self._new_call_id(self._calls), name=name,
                        arguments=arguments)
        self._calls += 1
        return call
