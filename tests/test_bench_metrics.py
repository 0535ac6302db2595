"""serve-bench arithmetic on synthetic timelines."""

from __future__ import annotations

import pytest

from butter.bench.metrics import (
    SIDE_MARKER,
    Timeline,
    interleave_report,
    leaked_markers,
    level_report,
    percentile,
    post_ttft_rate,
    wave_wall,
)


def timeline(lane: int, start: float, first: float | None, end: float, tokens: int,
             text: str = "", **kwargs: object) -> Timeline:
    return Timeline(lane=lane, wave=1, marker=f"M{lane}", start=start, first_output=first,
                    end=end, status=200, text=text, completion_tokens=tokens,
                    **kwargs)  # type: ignore[arg-type]


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 95) == 3.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([0, 10], 95) == pytest.approx(9.5)
    assert percentile([5, 1, 3], 0) == 1 and percentile([5, 1, 3], 100) == 5


def test_ttft_and_latency() -> None:
    t = timeline(0, 10.0, 10.25, 12.0, 5)
    assert t.ttft == pytest.approx(0.25) and t.latency == pytest.approx(2.0)
    assert timeline(0, 1.0, None, 2.0, 0).ttft is None


def test_post_ttft_rate_drops_one_token_per_response() -> None:
    wave = [timeline(0, 0.0, 0.5, 2.5, 11), timeline(1, 0.0, 1.0, 3.0, 21)]
    tokens, seconds = post_ttft_rate(wave)
    assert tokens == 10 + 20
    assert seconds == pytest.approx(3.0 - 0.5)  # earliest first output → latest end


def test_wave_wall_and_rates() -> None:
    waves = [[timeline(0, 0.0, 0.1, 2.0, 10, prompt_tokens=30, cached_tokens=10),
              timeline(1, 0.5, 0.7, 3.0, 20, prompt_tokens=30, cached_tokens=0)],
             [timeline(0, 10.0, 10.1, 11.0, 5, prompt_tokens=30, cached_tokens=29)]]
    assert wave_wall(waves[0]) == pytest.approx(3.0)
    report = level_report(2, waves)
    assert report.requests == 3 and report.waves == 2
    assert report.wall_seconds == pytest.approx(4.0)
    assert report.completion_tokens == 35
    assert report.completion_tok_s == pytest.approx(35 / 4.0)
    assert (report.prompt_tokens, report.cached_tokens, report.uncached_tokens) == (90, 39, 51)
    assert report.uncached_prompt_tok_s == pytest.approx(51 / 4.0)
    assert report.ttft_p50 == pytest.approx(0.1)


def test_marker_leakage_and_failures_are_counted() -> None:
    wave = [
        timeline(0, 0, 0.1, 1, 3, text="story about M1 and more"),  # another lane's marker
        timeline(1, 0, 0.1, 1, 3, text="M1 is mine"),
        timeline(2, 0, None, 1, 0, text=""),  # empty
        Timeline(lane=3, wave=1, marker="M3", start=0, end=1, status=503, error="HTTP 503"),
        timeline(4, 0, 0.2, 1, 2, text="x\ufffd", invalid_utf8=True),
    ]
    assert leaked_markers(wave) == 1
    report = level_report(5, [wave])
    assert report.marker_leaks == 1
    assert report.empty_responses == 1
    assert report.http_errors == 1
    assert report.invalid_utf8 == 1
    assert report.completion_tokens == 8  # failed requests do not count


def test_mixed_long_prompt_classes() -> None:
    wave = [timeline(0, 0, 2.0, 3, 4, long_prompt=True), timeline(1, 0, 0.2, 1, 4)]
    report = level_report(2, [wave])
    assert report.long_ttft_p95 == pytest.approx(2.0)
    assert report.standard_ttft_p95 == pytest.approx(0.2)
    assert level_report(1, [[timeline(0, 0, 0.2, 1, 4)]]).long_ttft_p95 is None


def test_requests_without_usage_are_counted() -> None:
    t = timeline(0, 0, 0.1, 1, 7, usage_missing=True)
    report = level_report(1, [[t, timeline(1, 0, 0.1, 1, 5)]])
    assert report.usage_missing == 1 and report.completion_tokens == 12


def test_an_interleaved_turn_answered_with_reasoning_alone_has_a_ttft() -> None:
    """A thinking model's short answer may be all reasoning (no content): its TTFT is its
    first delta of any kind, as a tool call's is."""

    def turn(marker: str, turn: int, start: float, **firsts: float) -> Timeline:
        return Timeline(lane=0, wave=0, marker=marker, turn=turn, start=start, end=start + 2,
                        status=200, prompt_tokens=1000, cached_tokens=900 if turn else 0,
                        **firsts)  # type: ignore[arg-type]

    report = interleave_report(1, 1, [
        turn("conv0", 0, 0.0, first_reasoning=3.0),
        turn(SIDE_MARKER, 0, 10.0, first_output=10.25),
        turn("conv0", 1, 20.0, first_reasoning=20.5),  # reasoning only
        turn("conv0", 2, 30.0, first_output=31.0, first_reasoning=30.75),  # reasoning first
        turn("conv0", 3, 40.0, first_output=40.5),  # a tool call or content
    ], enable_thinking=None, tool_rounds=True)
    assert report.first_turn_ttft_p50 == pytest.approx(3.0)
    assert report.returning_ttft_p50 == pytest.approx(0.5)
    assert report.returning_ttft_p95 == pytest.approx(0.725)
    assert report.side_ttft_p50 == pytest.approx(0.25)
    assert report.returning_cached_share == pytest.approx(0.9)
    assert report.tool_rounds and report.enable_thinking is None
