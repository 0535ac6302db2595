"""Stop strings over a text stream: never emit a partial stop string."""

from __future__ import annotations


class StopMatcher:
    """Feed text deltas; get back the text that is safe to emit.

    Text that could be the start of a stop string is held back until the next delta
    decides it. Once a stop string is found, everything from it on is dropped.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        if self.matched is not None:
            return ""
        if not self._stops:
            return text
        pending = self._held + text
        cut = self._earliest_stop(pending)
        if cut is not None:
            self._held = ""
            return pending[:cut]
        keep = self._partial_suffix_length(pending)
        self._held = pending[len(pending) - keep:] if keep else ""
        return pending[: len(pending) - keep]

    def flush(self) -> str:
        """End of stream: held text was not a stop after all."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _earliest_stop(self, text: str) -> int | None:
        best: int | None = None
        for stop in self._stops:
            index = text.find(stop)
            if index >= 0 and (best is None or index < best):
                best, self.matched = index, stop
        return best

    def _partial_suffix_length(self, text: str) -> int:
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
