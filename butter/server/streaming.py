"""One skeleton for every streamed answer (SSE for OpenAI and Anthropic, NDJSON for
Ollama): an API's frames, written in fewer, larger writes, and a last word in the API's
own shape when the request fails after the headers went out.

Every write costs a trip through quart, hypercorn, h11 and a socket send on the event
loop's thread — CPU taken from llama.cpp's threads on a small machine. So frames are
coalesced: a stream's first content goes out at once (time to first token is untouched);
after that, frames wait until `interval` seconds have passed since the last write.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing

import attrs

from butter.errors import ButterError


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


@attrs.frozen
class Flush:
    """A frame written at once, after whatever waits before it: the head of an answer,
    prompt progress, keep-alives. It does not start the coalescing interval, so the
    answer's first content still goes out the moment it exists."""

    frame: bytes


Frame = bytes | Flush
# The last word of a stream that failed mid-way, in the API's own shape.
FailureTail = Callable[[ButterError], bytes]


async def encoded(frames: AsyncGenerator[Frame, None], *, flush_interval: float,
                  failed: FailureTail) -> AsyncIterator[bytes]:
    """The writes of a stream whose frames an API's encoder yields, its closing frames
    last. The encoder is closed with the stream (a reader that left ends the request's
    generation and releases what it holds)."""
    coalescer = FrameCoalescer(flush_interval)
    try:
        async with aclosing(frames):
            async for frame in frames:
                if isinstance(frame, Flush):
                    if now := coalescer.take() + frame.frame:
                        yield now
                elif ready := coalescer.add(frame):
                    yield ready
    except ButterError as exc:  # after the headers went out: end cleanly, then say why
        yield coalescer.take() + failed(exc)
        return
    if rest := coalescer.take():
        yield rest
