"""Feeding a streaming parser its text in pieces, as generation does."""

from __future__ import annotations

from typing import Protocol

from butter.chat.markup import Event


class Parser(Protocol):
    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


def fed_in_pieces(parser: Parser, text: str, cuts: list[int]) -> list[Event]:
    """The events of `text` fed cut at `cuts` (any order, clamped), then finished."""
    points = sorted({min(cut, len(text)) for cut in cuts})
    events: list[Event] = []
    for start, end in zip([0, *points], [*points, len(text)], strict=True):
        events += parser.feed(text[start:end])
    return events + parser.finish()
