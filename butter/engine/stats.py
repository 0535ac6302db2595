"""What the engine counts: the step-time histogram, totals over every request, and the
snapshot `Engine.stats()` hands to /v1/server and /metrics."""

from __future__ import annotations

import bisect

import attrs

from butter.backends.team import TeamStatus
from butter.engine.generation import Generation
from butter.engine.host_cache import HostCacheStats
from butter.engine.prefix_cache import MIN_USEFUL_PREFIX, CheckpointStats

# Upper bounds (seconds) of the step-time histogram exported on /metrics.
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@attrs.frozen
class EngineStats:
    active: int
    queued: int
    reserved_cells: int
    total_cells: int
    idle_cached_cells: int  # cells that only cached prefixes (no running request) hold
    slots: int
    steps: int
    session_cells: tuple[int, ...]  # cached positions per sequence (busy or idle)
    # Prompt tokens a step may carry while sessions decode (PrefillBudget), and at most.
    decoding_prefill_budget: int = 0
    prefill_chunk: int = 0
    # Totals over every request that ran (since the engine started):
    requests_done: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    prefix_hits: int = 0  # requests that reused a cached prefix of MIN_USEFUL_PREFIX or more
    prefix_misses: int = 0
    # The prefix cache now: prompts cached in the KV pool, the cells every sequence holds.
    cached_entries: int = 0
    used_cells: int = 0
    host: HostCacheStats | None = None  # the host-RAM tier (None: off)
    # A recurrent or hybrid model's context checkpoints (None: this model takes none).
    checkpoints: CheckpointStats | None = None
    # Speculative decoding: draft tokens verified and accepted, the steps that verified
    # any, and each running request's acceptance estimate (by sequence).
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    draft_steps: int = 0
    acceptance: tuple[tuple[int, float], ...] = ()
    # The threads steps compute on, and what they see of the machine (None: MLX).
    threads: TeamStatus | None = None



@attrs.define
class Totals:
    """Counts over every request that ran and every step (since the engine started)."""

    requests_done: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    prefix_hits: int = 0
    prefix_misses: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    draft_steps: int = 0

    def count(self, generation: Generation) -> None:
        """An ended request."""
        self.requests_done += 1
        self.prompt_tokens += generation.prompt_tokens
        self.cached_tokens += generation.cached_tokens
        self.completion_tokens += generation.completion_tokens
        if generation.cached_tokens >= MIN_USEFUL_PREFIX:
            self.prefix_hits += 1
        else:
            self.prefix_misses += 1


@attrs.define
class StepTimes:
    """How long steps took: their count, sum and histogram (STEP_BUCKETS)."""

    steps: int = 0
    seconds: float = 0.0
    counts: list[int] = attrs.field(factory=lambda: [0] * (len(STEP_BUCKETS) + 1))  # +Inf last

    def observe(self, seconds: float) -> None:
        self.steps += 1
        self.seconds += seconds
        self.counts[bisect.bisect_left(STEP_BUCKETS, seconds)] += 1  # first bound >= it

    def histogram(self) -> tuple[list[tuple[str, int]], float]:
        """Cumulative (upper bound, count) buckets and the sum, Prometheus-style."""
        buckets, running = [], 0
        for bound, count in zip([*map(str, STEP_BUCKETS), "+Inf"], self.counts, strict=True):
            running += count
            buckets.append((bound, running))
        return buckets, self.seconds
