"""Readiness and drain: whether this replica should be sent work now, and how it stops.

Liveness and readiness answer different questions, for different callers:

- `GET /health` (liveness): the process runs. It stays 200 through swaps and drains, so
  an orchestrator never restarts a replica that is only busy changing models or stopping.
- `GET /ready` (readiness): send me new requests. 200 only when a model is loaded, no
  swap is under way, the engine's step loop is alive and not stuck in one step, and the
  server is not draining; otherwise 503 with the reason as JSON. Routers health-check it
  (vllm-router `--health-check-endpoint /ready`) and Kubernetes probes it.

Drain (SIGTERM): readiness turns 503 at once and new work gets 503 + Retry-After in the
API's own shape, which routers retry on another replica; requests already in flight,
streams and queued ones included, finish. The listener stays open meanwhile, so a router
still holding a connection to this replica gets a 503 it can retry rather than a reset.
`CountInFlight` tells the server when the last request has finished.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import attrs
import trio

from butter.errors import Draining
from butter.server.holders import ModelHolder
from butter.settings import ENGINE_STALL_SECONDS, RETRY_AFTER_SECONDS

LIVE_PATH = "/health"
READY_PATH = "/ready"
# Probes and scrapes are not work: they must neither hold a drain open nor be refused.
NOT_WORK_PATHS = frozenset({LIVE_PATH, READY_PATH, "/metrics", "/get_load"})

AsgiApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


@attrs.frozen
class ReadyState:
    ready: bool
    reason: str  # "ready", or why not: draining, swapping, no_model, engine_stopped, ...
    detail: str
    model: str | None = None
    in_flight: int = 0  # requests being served: what a drain still waits for

    def body(self) -> dict[str, Any]:
        return {"status": "ready" if self.ready else "unready", "reason": self.reason,
                "detail": self.detail, "model": self.model, "in_flight": self.in_flight}


class Readiness:
    """What `/ready` answers, the drain flag, and the count of requests in flight."""

    def __init__(self, holder: ModelHolder, *,
                 stall_after: float = ENGINE_STALL_SECONDS) -> None:
        self._holder = holder
        self._stall_after = stall_after
        self.draining = False
        self._in_flight = 0
        self._idle = trio.Event()
        self._idle.set()

    def state(self) -> ReadyState:
        return attrs.evolve(self._state(), in_flight=self._in_flight, model=self._model_id())

    def _state(self) -> ReadyState:
        """The first reason not to send this replica work, in the order a caller can act
        on: it is going away, it is changing models, it has none, its engine is broken."""
        if self.draining:
            return ReadyState(False, "draining", "the server is shutting down")
        if self._holder.swapping:
            return ReadyState(False, "swapping", "a model swap is under way")
        resident = self._holder.resident
        if resident is None:  # between a swap's unload and load, or after a failed one
            return ReadyState(False, "no_model", "no model is loaded")
        engine = resident.engine
        if not engine.running:
            return ReadyState(False, "engine_stopped", "the engine's step loop is not running")
        started = engine.step_started
        if started is not None and time.perf_counter() - started > self._stall_after:
            return ReadyState(False, "engine_stalled",
                              f"one engine step has run for over {self._stall_after:.0f} s")
        return ReadyState(True, "ready", "serving")

    def _model_id(self) -> str | None:
        resident = self._holder.resident
        return None if resident is None else resident.model_id

    def start_draining(self) -> None:
        self.draining = True

    def refuse_new_work(self) -> None:
        """Raise (503 + Retry-After) when draining: a router retries it elsewhere."""
        if self.draining:
            raise Draining("the server is shutting down and takes no new requests; retry on "
                           "another replica", retry_after=RETRY_AFTER_SECONDS)

    @contextmanager
    def in_flight(self) -> Iterator[None]:
        if self._in_flight == 0:
            self._idle = trio.Event()
        self._in_flight += 1
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    async def wait_idle(self) -> None:
        """Until no request is in flight (returns at once when none is)."""
        while self._in_flight:
            await self._idle.wait()


class CountInFlight:
    """ASGI wrapper: counts HTTP requests from their headers to their response's last byte
    (a stream's too), probes and scrapes aside, so a drain knows when work has ended."""

    def __init__(self, app: AsgiApp, readiness: Readiness) -> None:
        self.app = app
        self.readiness = readiness

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in NOT_WORK_PATHS:
            await self.app(scope, receive, send)
            return
        with self.readiness.in_flight():
            await self.app(scope, receive, send)


def current_load(holder: ModelHolder) -> int:
    """Requests running or waiting for admission (0 between a swap's unload and load)."""
    resident = holder.resident
    if resident is None:
        return 0
    stats = resident.engine.stats()
    return stats.active + stats.queued
