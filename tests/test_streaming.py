"""The streaming skeleton: frames coalesced (the first write is immediate, later ones wait
for the interval), flushed frames, the failure tail, and the encoder closed with the
stream."""

from __future__ import annotations

from collections.abc import AsyncGenerator

import pytest

from butter.errors import InvalidRequest
from butter.server.streaming import Flush, Frame, FrameCoalescer, encoded


def test_first_frame_goes_out_at_once_then_frames_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr("butter.server.streaming.time.monotonic", lambda: now[0])
    frames = FrameCoalescer(0.1)
    assert frames.add(b"a") == b"a"
    now[0] += 0.03
    assert frames.add(b"b") is None
    now[0] += 0.03
    assert frames.add(b"c") is None
    now[0] += 0.05
    assert frames.add(b"d") == b"bcd"
    assert frames.take() == b""


def test_zero_interval_writes_every_frame() -> None:
    frames = FrameCoalescer(0.0)
    assert [frames.add(x) for x in (b"1", b"2", b"3")] == [b"1", b"2", b"3"]


def test_take_flushes_what_is_held(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("butter.server.streaming.time.monotonic", lambda: 5.0)
    frames = FrameCoalescer(1.0)
    frames.add(b"x")
    frames.add(b"y")
    assert frames.take() == b"y"


async def _written(frames: AsyncGenerator[Frame, None], interval: float = 60.0) -> list[bytes]:
    return [write async for write in encoded(frames, flush_interval=interval,
                                             failed=lambda error: b"<" + error.message.encode()
                                             + b">")]


async def test_a_flushed_frame_goes_out_at_once_with_what_waited_before_it() -> None:
    async def frames() -> AsyncGenerator[Frame, None]:
        yield Flush(b"head ")
        yield b"a"  # the first content: written at once
        yield b"b"  # within the interval: held
        yield Flush(b"!")  # takes the held frame with it
        yield b"c"
        yield b"end"

    assert await _written(frames()) == [b"head ", b"a", b"b!", b"cend"]


async def test_a_failure_after_the_headers_ends_with_the_apis_last_word() -> None:
    async def frames() -> AsyncGenerator[Frame, None]:
        yield b"a"
        yield b"b"
        raise InvalidRequest("gone")

    assert await _written(frames()) == [b"a", b"b<gone>"]


async def test_a_reader_that_leaves_closes_the_encoder_at_once() -> None:
    """The encoder's `finally` (where a request's generation is released) runs when the
    stream is closed, not whenever the garbage collector gets to it."""
    closed: list[bool] = []

    async def frames() -> AsyncGenerator[Frame, None]:
        try:
            while True:
                yield b"x"
        finally:
            closed.append(True)

    stream = encoded(frames(), flush_interval=0.0, failed=lambda error: b"")
    assert await anext(stream) == b"x"
    await stream.aclose()
    assert closed == [True]
