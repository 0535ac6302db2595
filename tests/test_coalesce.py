"""SSE frame coalescing: the first write is immediate, later ones wait for the interval."""

from __future__ import annotations

import pytest

from butter.server.coalesce import FrameCoalescer


def test_first_frame_goes_out_at_once_then_frames_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr("butter.server.coalesce.time.monotonic", lambda: now[0])
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
    monkeypatch.setattr("butter.server.coalesce.time.monotonic", lambda: 5.0)
    frames = FrameCoalescer(1.0)
    frames.add(b"x")
    frames.add(b"y")
    assert frames.take() == b"y"
