"""Per-request timelines → per-level metrics (pure arithmetic, no I/O)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import attrs

# Where a response's cached prompt token count was read. OpenAI's usage field first;
# llama-server's own per-request timings (cache_n cached, prompt_n evaluated) otherwise.
CACHE_FROM_USAGE = "usage.prompt_tokens_details.cached_tokens"
CACHE_FROM_TIMINGS = "timings.cache_n"
CACHE_SOURCES = (CACHE_FROM_USAGE, CACHE_FROM_TIMINGS)


@attrs.define
class Timeline:
    """What one request did, in seconds on one monotonic clock."""

    lane: int
    wave: int
    marker: str
    long_prompt: bool = False
    turn: int = 0  # replay: the request's index in its conversation
    start: float = 0.0
    first_output: float | None = None  # first non-empty content or tool-call delta
    first_reasoning: float | None = None  # first non-empty reasoning delta
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
    retries: int = 0  # sent again after the server closed the connection unanswered
    cache_source: str | None = None  # where cached_tokens came from (CACHE_SOURCES)
    # (arrival time, characters of output) per chunk that carried output; the
    # workloads spread the usage's completion tokens over these.
    chunks: list[tuple[float, int]] = attrs.Factory(list)

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200

    @property
    def ttft(self) -> float | None:
        return None if self.first_output is None else self.first_output - self.start

    @property
    def first_token(self) -> float | None:
        """First output of any kind: content, a tool-call delta or reasoning."""
        firsts = [t for t in (self.first_output, self.first_reasoning) if t is not None]
        return min(firsts) if firsts else None

    @property
    def token_ttft(self) -> float | None:
        first = self.first_token
        return None if first is None else first - self.start

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
    retried: int = 0  # requests sent twice: the server dropped a reused connection unanswered


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
        retried=sum(1 for t in every if t.retries),
    )


def cache_source(timelines: Sequence[Timeline]) -> str:
    """Which field the cached counts of these requests came from: one of CACHE_SOURCES,
    "mixed: a, b", or "none" (the server reported no cached count)."""
    found = sorted({t.cache_source for t in timelines if t.cache_source is not None})
    if not found:
        return "none"
    return found[0] if len(found) == 1 else "mixed: " + ", ".join(found)


def _share(part: int, whole: int) -> float | None:
    return part / whole if whole > 0 else None


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def error_samples(timelines: Sequence[Timeline], limit: int = 3) -> list[str]:
    """The first few distinct error messages, for the record."""
    samples: list[str] = []
    for t in timelines:
        message = t.error or (None if t.ok else f"HTTP {t.status}")
        if message and message not in samples:
            samples.append(message)
    return samples[:limit]


# ----------------------------------------------------------------------- replay


@attrs.frozen
class ReplayReport:
    """One concurrency level of `serve-bench --replay`: every conversation of the file
    replayed once, `concurrency` lanes each sending its conversations' requests in turn."""

    concurrency: int
    conversations: int
    requests: int
    http_errors: int
    wall_seconds: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    completion_tok_s: float
    requests_per_s: float
    prompt_tokens_per_request: float | None
    cached_share: float | None  # cached prompt tokens / prompt tokens
    cached_source: str
    ttft_p50: float | None  # first content, tool-call or reasoning delta
    ttft_p95: float | None
    latency_p95: float | None
    turn_prompt_tokens: list[float | None]  # mean prompt tokens of the k-th requests
    turn_cached_share: list[float | None]
    turn_ttft_p50: list[float | None]
    usage_missing: int
    retried: int  # requests sent twice: the server dropped a reused connection unanswered
    errors: list[str]


def replay_report(concurrency: int, timelines: Sequence[Timeline]) -> ReplayReport:
    """Totals over successful requests; wall from the first start to the last end."""
    ok = [t for t in timelines if t.ok]
    wall = wave_wall(timelines)
    prompt = sum(t.prompt_tokens for t in ok)
    cached = sum(t.cached_tokens for t in ok)
    completion = sum(t.completion_tokens for t in ok)
    ttfts = [t.token_ttft for t in ok if t.token_ttft is not None]
    turns = range(max((t.turn for t in timelines), default=-1) + 1)

    def at(turn: int) -> list[Timeline]:
        return [t for t in ok if t.turn == turn]

    return ReplayReport(
        concurrency=concurrency,
        conversations=len({t.marker for t in timelines}),
        requests=len(timelines), http_errors=len(timelines) - len(ok),
        wall_seconds=wall, prompt_tokens=prompt, cached_tokens=cached,
        completion_tokens=completion, completion_tok_s=_rate(completion, wall),
        requests_per_s=_rate(len(ok), wall),
        prompt_tokens_per_request=_mean([t.prompt_tokens for t in ok]),
        cached_share=_share(cached, prompt), cached_source=cache_source(ok),
        ttft_p50=percentile(ttfts, 50), ttft_p95=percentile(ttfts, 95),
        latency_p95=percentile([t.latency for t in ok], 95),
        turn_prompt_tokens=[_mean([t.prompt_tokens for t in at(k)]) for k in turns],
        turn_cached_share=[
            _share(sum(t.cached_tokens for t in at(k)), sum(t.prompt_tokens for t in at(k)))
            for k in turns
        ],
        turn_ttft_p50=[
            percentile([t.token_ttft for t in at(k) if t.token_ttft is not None], 50)
            for k in turns
        ],
        usage_missing=sum(1 for t in ok if t.usage_missing),
        retried=sum(1 for t in timelines if t.retries),
        errors=error_samples(timelines),
    )


# ---------------------------------------------------------------- long arrival


def tokens_between(timeline: Timeline, start: float, end: float) -> float:
    """Completion tokens of `timeline` that arrived in (start, end]: the usage's count
    spread over the output chunks in proportion to their characters (servers that write
    several tokens per chunk, like butter's --stream-flush-ms, are counted fairly)."""
    total = sum(weight for _, weight in timeline.chunks)
    if total <= 0 or timeline.completion_tokens <= 0:
        return 0.0
    inside = sum(weight for at, weight in timeline.chunks if start < at <= end)
    return timeline.completion_tokens * inside / total


def window_rate(timelines: Sequence[Timeline], start: float, end: float) -> float | None:
    """Aggregate completion tok/s of these requests over (start, end]."""
    if end <= start:
        return None
    return sum(tokens_between(t, start, end) for t in timelines) / (end - start)


def longest_stall(timelines: Sequence[Timeline], start: float, end: float) -> float:
    """The longest stretch of (start, end] in which none of these requests (one session's
    requests, one after another) received output; the window's length if none did."""
    times = sorted(at for t in timelines for at, _ in t.chunks if start < at < end)
    points = [start, *times, end]
    return max((b - a for a, b in itertools.pairwise(points)), default=0.0)


@attrs.frozen
class ArrivalReport:
    """`serve-bench --long-arrival`: `concurrency` sessions stream long answers (each
    session sends its next request when one ends); once every session has its first
    token and `settle_seconds` passed, one request with a long unique prompt arrives.
    Windows: before = the settle seconds before it is sent; during = its prefill, from
    its send to its first token; after = `after_seconds` from its first token."""

    concurrency: int
    target_prompt_tokens: int
    chars_per_token: float
    long_prompt_tokens: int
    long_cached_tokens: int
    long_completion_tokens: int
    long_ttft: float | None
    long_latency: float | None
    long_error: str | None
    before_tok_s: float | None  # the sessions' aggregate completion tok/s
    during_tok_s: float | None
    after_tok_s: float | None
    before_seconds: float
    during_seconds: float
    after_seconds: float
    starved_sessions: int  # sessions that received no output during the prefill
    longest_stall_s: float | None  # longest gap without output of any session, prefill
    session_requests: int
    session_errors: int
    session_ttft_p50: float | None
    cached_source: str
    retried: int  # requests sent twice: the server dropped a reused connection unanswered
    errors: list[str]


@attrs.frozen
class ArrivalMarks:
    """The run's moments on the client's clock."""

    all_first: float  # every session has received output
    sent: float  # the long request was sent
    after_end: float  # end of the after window


def arrival_report(
    sessions: Sequence[Sequence[Timeline]], long: Timeline, marks: ArrivalMarks,
    target_prompt_tokens: int, chars_per_token: float,
) -> ArrivalReport:
    every = [t for session in sessions for t in session]
    ok = [t for t in every if t.ok]
    first = long.first_token
    prefill_end = first if first is not None else long.end
    during = [longest_stall(s, marks.sent, prefill_end) for s in sessions]
    session_ttfts = [t.token_ttft for t in ok if t.token_ttft is not None]
    return ArrivalReport(
        concurrency=len(sessions), target_prompt_tokens=target_prompt_tokens,
        chars_per_token=chars_per_token,
        long_prompt_tokens=long.prompt_tokens, long_cached_tokens=long.cached_tokens,
        long_completion_tokens=long.completion_tokens,
        long_ttft=long.token_ttft if long.ok else None,
        long_latency=long.latency if long.ok else None,
        long_error=None if long.ok else (long.error or f"HTTP {long.status}"),
        before_tok_s=window_rate(ok, marks.all_first, marks.sent),
        during_tok_s=window_rate(ok, marks.sent, prefill_end),
        after_tok_s=window_rate(ok, prefill_end, marks.after_end),
        before_seconds=marks.sent - marks.all_first,
        during_seconds=prefill_end - marks.sent,
        after_seconds=max(0.0, marks.after_end - prefill_end),
        starved_sessions=sum(
            1 for s in sessions
            if not any(marks.sent < at <= prefill_end for t in s for at, _ in t.chunks)
        ),
        longest_stall_s=max(during) if during and prefill_end > marks.sent else None,
        session_requests=len(every), session_errors=len(every) - len(ok),
        session_ttft_p50=percentile(session_ttfts, 50),
        cached_source=cache_source([*ok, long] if long.ok else ok),
        retried=sum(1 for t in [*every, long] if t.retries),
        errors=error_samples([*every, long]),
    )


# ---------------------------------------------------------------- interleaved conversations

SIDE_MARKER = "side"  # the marker of `--interleave`'s side requests (conversations: conv<k>)


@attrs.frozen
class InterleaveReport:
    """`serve-bench --interleave`: returning turns are a conversation's requests after its
    first, each sent after other conversations' turns and side requests. A TTFT is to the
    first output of any kind (content, reasoning or a tool call: a thinking model's short
    answer may be reasoning alone)."""

    conversations: int
    side_requests: int
    turns: int
    requests: int
    http_errors: int
    returning_prompt_tokens: int
    returning_cached_tokens: int
    returning_cached_share: float | None
    returning_ttft_p50: float | None
    returning_ttft_p95: float | None
    first_turn_ttft_p50: float | None
    side_ttft_p50: float | None
    cached_source: str
    errors: list[str]
    enable_thinking: bool | None = None  # what requests sent (None: not sent)
    tool_rounds: bool = False  # answers came back as tool calls, with the tools' results


def interleave_report(conversations: int, side_requests: int, timelines: Sequence[Timeline],
                      enable_thinking: bool | None = None,
                      tool_rounds: bool = False) -> InterleaveReport:
    ok = [t for t in timelines if t.ok]
    turns = [t for t in ok if t.marker != SIDE_MARKER]
    returning = [t for t in turns if t.turn > 0]
    prompt = sum(t.prompt_tokens for t in returning)
    cached = sum(t.cached_tokens for t in returning)

    def ttfts(group: Sequence[Timeline]) -> list[float]:
        return [t.token_ttft for t in group if t.token_ttft is not None]

    return InterleaveReport(
        conversations=conversations, side_requests=side_requests,
        turns=max((t.turn for t in timelines), default=-1) + 1,
        requests=len(timelines), http_errors=len(timelines) - len(ok),
        returning_prompt_tokens=prompt, returning_cached_tokens=cached,
        returning_cached_share=_share(cached, prompt),
        returning_ttft_p50=percentile(ttfts(returning), 50),
        returning_ttft_p95=percentile(ttfts(returning), 95),
        first_turn_ttft_p50=percentile(ttfts([t for t in turns if t.turn == 0]), 50),
        side_ttft_p50=percentile(ttfts([t for t in ok if t.marker == SIDE_MARKER]), 50),
        cached_source=cache_source(returning), errors=error_samples(timelines),
        enable_thinking=enable_thinking, tool_rounds=tool_rounds,
    )
