"""Coalesce SSE frames: fewer, larger writes under load.

Every write costs a trip through quart, hypercorn, h11 and a socket send on the event
loop's thread — CPU taken from llama.cpp's threads on a small machine. A stream's
first content goes out at once (time to first token is untouched); after that,
frames wait until `interval` seconds have passed since the last write.
"""

from __future__ import annotations

import time


class FrameCoalescer:
    def __init__(self, interval: float) -> None:
        self._interval = interval
        self._frames: list[bytes] = []
        self._last_write: float | None = None

    def add(self, frame: bytes) -> bytes | None:
        """Queue a frame; returns what to write now, if anything."""
        self._frames.append(frame)
        now = time.monotonic()
        if self._last_write is not None and now - self._last_write < self._interval:
            return None
        self._last_write = now
        return self.take()

    def take(self) -> bytes:
        frames, self._frames = self._frames, []
        return b"".join(frames)
