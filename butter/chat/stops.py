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
        return self._settle(self._held + text, final=False)

    def flush(self) -> str:
        """End of stream: held text is settled with nothing more to come."""
        if self.matched is not None or not self._held:
            self._held = ""
            return ""
        return self._settle(self._held, final=True)

    def _settle(self, pending: str, *, final: bool) -> str:
        """Emit what is decided. A stop found in `pending` decides only if no longer stop
        could still begin before it (a held prefix of one), as the unsplit text would."""
        open_at = len(pending) if final else len(pending) - self._partial_suffix_length(pending)
        found = self._earliest_stop(pending)
        if found is not None and found[0] <= open_at:
            cut, self.matched = found
            self._held = ""
            return pending[:cut]
        self._held = pending[open_at:]
        return pending[:open_at]

    def _earliest_stop(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = text.find(stop)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _partial_suffix_length(self, text: str) -> int:
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
