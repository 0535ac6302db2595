"""Prometheus metrics (`GET /metrics`) and the one-line-per-request log.

Route-level events (requests, time to first token, cancellations) are counted here as
they happen; engine state (active sessions, queue depth, token totals, step times) is
read from the resident engine at scrape time, so the engine stays free of HTTP concerns.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from butter.engine.engine import Engine
from butter.pipeline.run import Outcome

log = logging.getLogger("butter.requests")

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class _EngineCollector(Collector):
    def __init__(self, engine: Callable[[], Engine | None], swaps: Callable[[], int]) -> None:
        self._engine = engine
        self._swaps = swaps

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]:
        yield CounterMetricFamily("butter_swaps", "Model swaps", value=self._swaps())
        engine = self._engine()
        if engine is None:
            return
        stats = engine.stats()
        gauges: dict[str, tuple[str, float]] = {
            "butter_active_sessions": ("Requests generating now", stats.active),
            "butter_queue_depth": ("Requests waiting for admission", stats.queued),
            "butter_kv_reserved_cells": ("KV cells reserved by live requests",
                                         stats.reserved_cells),
            "butter_kv_cached_cells": ("KV cells only cached prompts hold (no running request)",
                                       stats.idle_cached_cells),
            "butter_kv_used_cells": ("KV cells any sequence holds", stats.used_cells),
            "butter_prefix_cache_entries": ("Cached prompts in the KV pool",
                                            stats.cached_entries),
        }
        if stats.host is not None:
            gauges["butter_host_cache_entries"] = ("Cached prompts in the host-RAM tier",
                                                   stats.host.entries)
            gauges["butter_host_cache_bytes"] = ("Bytes the host-RAM tier holds",
                                                 stats.host.bytes)
        team = stats.threads
        if team is not None:  # (a busy machine, as the engine's threads see it)
            gauges["butter_threads"] = ("Threads a step computes on now", team.now)
            gauges["butter_threads_max"] = ("Threads a step computes on at most (--threads)",
                                            team.most)
            if team.others_cores is not None:
                gauges["butter_other_programs_cores"] = (
                    "Cores' worth of CPU time other programs took on this process's cores",
                    team.others_cores)
            if team.step_time_ratio is not None:
                gauges["butter_step_time_ratio"] = (
                    "Decode steps' time against the fastest of their size (1: quiet)",
                    team.step_time_ratio)
        for name, (text, value) in gauges.items():
            yield GaugeMetricFamily(name, text, value=value)
        counters = {
            "butter_prompt_tokens": ("Prompt tokens of finished requests", stats.prompt_tokens),
            "butter_cached_tokens": ("Prompt tokens reused from the KV cache",
                                     stats.cached_tokens),
            "butter_completion_tokens": ("Generated tokens", stats.completion_tokens),
            "butter_engine_steps": ("Engine steps (one llama_decode each)", stats.steps),
            "butter_prefix_cache_hits": ("Requests that reused a cached prefix",
                                         stats.prefix_hits),
            "butter_prefix_cache_misses": ("Requests that reused no cached prefix",
                                           stats.prefix_misses),
            "butter_draft_tokens": ("Speculative draft tokens verified", stats.drafted_tokens),
            "butter_draft_accepted_tokens": ("Speculative draft tokens accepted",
                                             stats.accepted_tokens),
            "butter_draft_rejected_tokens": ("Speculative draft tokens rejected",
                                             stats.drafted_tokens - stats.accepted_tokens),
            "butter_draft_steps": ("Engine steps that verified draft tokens",
                                   stats.draft_steps),
        }
        if team is not None:
            counters["butter_thread_shrinks"] = (
                "Times other programs' use of the cores made the team smaller", team.shrinks)
        if stats.host is not None:
            counters["butter_host_cache_restores"] = ("Prefixes restored from host RAM",
                                                      stats.host.restored)
            counters["butter_host_cache_restored_tokens"] = (
                "Prompt tokens restored from host RAM", stats.host.restored_tokens)
            counters["butter_host_cache_saves"] = ("Prefixes saved to host RAM",
                                                   stats.host.saved)
        checkpoints = stats.checkpoints
        if checkpoints is not None:
            gauges_too = {
                "butter_checkpoints": ("Context checkpoints held (recurrent state)",
                                       checkpoints.held),
                "butter_checkpoint_bytes": ("Bytes context checkpoints hold", checkpoints.bytes),
            }
            for name, (text, value) in gauges_too.items():
                yield GaugeMetricFamily(name, text, value=value)
            counters["butter_checkpoints_taken"] = ("Context checkpoints taken",
                                                    checkpoints.taken)
            counters["butter_checkpoints_skipped"] = (
                "Context checkpoints not taken: no room in --cache-ram", checkpoints.skipped)
            counters["butter_checkpoints_restored"] = ("Context checkpoints restored",
                                                       checkpoints.restored)
            counters["butter_checkpoint_restored_tokens"] = (
                "Prompt tokens served by restored checkpoints", checkpoints.restored_tokens)
        for name, (text, value) in counters.items():
            yield CounterMetricFamily(name, text, value=value)
        buckets, total = engine.step_histogram()
        yield HistogramMetricFamily("butter_step_seconds", "Duration of one engine step",
                                    buckets=buckets, sum_value=total)


class Metrics:
    def __init__(self, engine: Callable[[], Engine | None], swaps: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("butter_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=self.registry)
        self.ttft = Histogram("butter_ttft_seconds", "Time to first token",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.cancellations = Counter("butter_cancellations",
                                     "Requests cancelled by their client",
                                     registry=self.registry)
        self.registry.register(_EngineCollector(engine, swaps))

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))


def log_request(route: str, outcome: Outcome | None, *, ttft: float | None, duration: float,
                cancelled: bool) -> None:
    """The request's one log line (`butter.requests`), its finish reason as the response
    says it."""
    shown_ttft = "-" if ttft is None else f"{ttft:.3f}"
    if outcome is None:
        log.info("%s admission_failed duration=%.3f cancelled=%s", route, duration, cancelled)
        return
    usage = outcome.usage
    log.info(
        "%s finish=%s prompt=%d cached=%d completion=%d drafts=%d/%d ttft=%s "
        "duration=%.3f cancelled=%s", route, outcome.finish,
        usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens,
        outcome.accepted_tokens, outcome.drafted_tokens, shown_ttft, duration, cancelled,
    )
