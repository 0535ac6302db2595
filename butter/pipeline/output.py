"""Generated token pieces -> events (text, reasoning, tool calls), and events -> blocks."""

from __future__ import annotations

import uuid

import attrs

from butter.chat.answers import answer_parser
from butter.chat.detokenize import IncrementalDetokenizer
from butter.chat.markup import ContentDelta, Event, ReasoningDelta, ToolCall
from butter.chat.request import ChatPrompt, Logprobs
from butter.chat.stops import StopMatcher
from butter.pipeline.prepare import PreparedGeneration


class OutputAssembler:
    """Token pieces -> events: UTF-8 safe, stop strings cut, think blocks and tool calls
    recovered, never a partial tag or stop string emitted."""

    def __init__(self, prepared: PreparedGeneration, *, call_id_prefix: str = "call_") -> None:
        self._detokenizer = IncrementalDetokenizer()
        self._stops = StopMatcher(prepared.request.stop)
        self.can_stop = bool(prepared.request.stop)  # the request names stop strings
        # Markup (think blocks, tool calls) belongs to a chat turn; a raw prompt's
        # completion is text as it came.
        self._parses_markup = isinstance(prepared.request.prompt, ChatPrompt)
        self._markup = answer_parser(
            prepared.request.tool_schemas, start_in_reasoning=prepared.starts_in_reasoning,
            new_call_id=lambda _: f"{call_id_prefix}{uuid.uuid4().hex[:24]}",
            bare_json_calls=prepared.bare_json_calls, syntaxes=prepared.call_syntaxes,
        )

    @property
    def stopped(self) -> bool:
        return self._stops.matched is not None

    @property
    def matched_stop(self) -> str | None:
        return self._stops.matched

    @property
    def tool_calls(self) -> int:
        """The answer's calls, which make its finish reason `tool_calls`: none where
        max_tokens cut it inside a call (that call comes back as far as it was written,
        and the finish reason stays `length`)."""
        if self._markup.cut_inside_call:
            return 0
        return self._markup.tool_calls

    def feed(self, pieces: list[bytes]) -> list[Event]:
        return self._events(self._stops.feed(self._detokenizer.feed(b"".join(pieces))))

    def finish(self, *, cut: bool = False) -> list[Event]:
        """The end of the answer. `cut`: max_tokens (or the context) ended it, not the
        model: a tool call it ended inside never shows its markup (AnswerParser.finish)."""
        tail = self._stops.feed(self._detokenizer.flush()) + self._stops.flush()
        if not self._parses_markup:
            return self._events(tail)
        return self._markup.feed(tail) + self._markup.finish(cut=cut)

    def _events(self, text: str) -> list[Event]:
        if self._parses_markup:
            return self._markup.feed(text)
        return [ContentDelta(text)] if text else []


@attrs.frozen
class LogprobsDelta:
    """The logprobs of the tokens generated since the last one (requests that ask)."""

    entries: tuple[Logprobs, ...]


@attrs.frozen
class TextBlock:
    text: str


@attrs.frozen
class ReasoningBlock:
    text: str


Block = TextBlock | ReasoningBlock | ToolCall


class OutputBlocks:
    """Events -> the answer's blocks in order, consecutive text (or reasoning) merged: the
    one place a whole answer is put together, for every non-streamed encoder."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self.logprobs: list[Logprobs] = []

    def add(self, event: Event | LogprobsDelta) -> None:
        if isinstance(event, LogprobsDelta):
            self.logprobs.extend(event.entries)
            return
        last = self.blocks[-1] if self.blocks else None
        if isinstance(event, ContentDelta):
            if isinstance(last, TextBlock):
                self.blocks[-1] = TextBlock(last.text + event.text)
            else:
                self.blocks.append(TextBlock(event.text))
        elif isinstance(event, ReasoningDelta):
            if isinstance(last, ReasoningBlock):
                self.blocks[-1] = ReasoningBlock(last.text + event.text)
            else:
                self.blocks.append(ReasoningBlock(event.text))
        else:
            self.blocks.append(event)

    @property
    def text(self) -> str:
        return "".join(block.text for block in self.blocks if isinstance(block, TextBlock))

    @property
    def reasoning(self) -> str:
        return "".join(block.text for block in self.blocks if isinstance(block, ReasoningBlock))

    @property
    def calls(self) -> list[ToolCall]:
        return [block for block in self.blocks if isinstance(block, ToolCall)]
