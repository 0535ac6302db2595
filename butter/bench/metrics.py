"""Per-request timelines → per-level metrics (pure arithmetic, no I/O)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs


@attrs.define
class Timeline:
    """What one request did, in seconds on one monotonic clock."""

    lane: int
    wave: int
    marker: str
    long_prompt: bool = False
    start: float = 0.0
    first_output: float | None = None  # first non-empty content or tool-call delta
    end: float = 0.0
    status: int | None = None
    error: str | None = None
    text: str = ""
    invalid_utf8: bool = False
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    content_deltas: int = 0
    usage_missing: bool = False  # the server sent no usage: tokens counted as deltas

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200

    @property
    def ttft(self) -> float | None:
        return None if self.first_output is None else self.first_output - self.start

    @property
    def latency(self) -> float:
        return self.end - self.start


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def leaked_markers(timelines: Sequence[Timeline]) -> int:
    """Responses that contain another lane's marker (crossed streams)."""
    markers = {t.marker for t in timelines}
    return sum(
        1 for t in timelines if any(m != t.marker and m in t.text for m in markers)
    )


def wave_wall(timelines: Sequence[Timeline]) -> float:
    """From the wave's first request start to its last request end."""
    if not timelines:
        return 0.0
    return max(t.end for t in timelines) - min(t.start for t in timelines)


def post_ttft_rate(timelines: Sequence[Timeline]) -> tuple[int, float]:
    """(tokens, seconds) after first output: one first token dropped per response,
    measured from the wave's earliest first output to its latest completion."""
    done = [t for t in timelines if t.ok and t.first_output is not None]
    if not done:
        return 0, 0.0
    tokens = sum(max(0, t.completion_tokens - 1) for t in done)
    seconds = max(t.end for t in done) - min(t.first_output or 0.0 for t in done)
    return tokens, max(0.0, seconds)


@attrs.frozen
class LevelReport:
    concurrency: int
    requests: int
    waves: int
    prompt_tokens: int
    cached_tokens: int
    uncached_tokens: int
    completion_tokens: int
    wall_seconds: float
    completion_tok_s: float
    uncached_prompt_tok_s: float
    post_ttft_tok_s: float
    ttft_p50: float | None
    ttft_p95: float | None
    latency_p95: float | None
    marker_leaks: int
    empty_responses: int
    invalid_utf8: int
    http_errors: int
    long_ttft_p95: float | None = None
    standard_ttft_p95: float | None = None
    usage_missing: int = 0  # requests whose completion tokens are counted content deltas


def _rate(amount: float, seconds: float) -> float:
    return amount / seconds if seconds > 0 else 0.0


def level_report(concurrency: int, waves: Sequence[Sequence[Timeline]]) -> LevelReport:
    every = [t for wave in waves for t in wave]
    ok = [t for t in every if t.ok]
    wall = sum(wave_wall(wave) for wave in waves)
    post = [post_ttft_rate(wave) for wave in waves]
    prompt = sum(t.prompt_tokens for t in ok)
    cached = sum(t.cached_tokens for t in ok)
    completion = sum(t.completion_tokens for t in ok)
    ttfts = [t.ttft for t in ok if t.ttft is not None]
    mixed = any(t.long_prompt for t in every) and not all(t.long_prompt for t in every)

    def class_p95(long_prompt: bool) -> float | None:
        values = [t.ttft for t in ok if t.long_prompt == long_prompt and t.ttft is not None]
        return percentile(values, 95)

    return LevelReport(
        concurrency=concurrency, requests=len(every), waves=len(waves),
        prompt_tokens=prompt, cached_tokens=cached, uncached_tokens=prompt - cached,
        completion_tokens=completion, wall_seconds=wall,
        completion_tok_s=_rate(completion, wall),
        uncached_prompt_tok_s=_rate(prompt - cached, wall),
        post_ttft_tok_s=_rate(sum(n for n, _ in post), sum(s for _, s in post)),
        ttft_p50=percentile(ttfts, 50), ttft_p95=percentile(ttfts, 95),
        latency_p95=percentile([t.latency for t in ok], 95),
        marker_leaks=leaked_markers(every),
        empty_responses=sum(1 for t in ok if not t.text.strip() and t.first_output is None),
        invalid_utf8=sum(1 for t in every if t.invalid_utf8),
        http_errors=sum(1 for t in every if not t.ok),
        long_ttft_p95=class_p95(True) if mixed else None,
        standard_ttft_p95=class_p95(False) if mixed else None,
        usage_missing=sum(1 for t in ok if t.usage_missing),
    )
