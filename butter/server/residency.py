"""One resident model at a time, swapped on request, never half-loaded.

A request naming another model swaps it in: in-flight and queued requests of the old
model end (their clients are told the model was replaced), the old model is freed,
the new one is loaded, and the request proceeds. Requests arriving meanwhile wait,
in order. A bad id or a failed load answers 404 and leaves (or restores) the old model.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from butter.backends.llama_cpp import check_gguf_file
from butter.errors import InvalidRequest, ModelLoadError, ModelNotFound
from butter.models import InvalidModelId, resolve_model
from butter.server.resident import ResidentModel

log = logging.getLogger("butter")

Loader = Callable[[str | None], Awaitable[ResidentModel]]


class Residency:
    def __init__(
        self, loader: Loader, *, initial: ResidentModel | None = None,
        models_dir: str | None = None, allow_swap: bool = True,
    ) -> None:
        self._loader = loader
        self._initial = initial
        self._models_dir = models_dir
        self.allow_swap = allow_swap
        self._current: ResidentModel | None = None
        self._engine_scope: trio.CancelScope | None = None
        self._engine_stopped = trio.Event()
        self._lock = trio.Lock()  # FIFO: swaps and requests waiting for one go in order
        self._nursery: trio.Nursery | None = None
        self.swaps = 0

    @property
    def current(self) -> ResidentModel:
        if self._current is None:
            raise RuntimeError("no model is resident yet")
        return self._current

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load the boot model (unless given), keep its engine running, free it at the end."""
        resident = self._initial or await self._loader(None)
        self._initial = None
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await self._start_engine(resident)
                task_status.started()
                await trio.sleep_forever()  # engines come and go; the nursery stays
        finally:
            self._nursery = None
            if self._current is not None:
                self._current.close()
                self._current = None

    async def resident_for(self, model: str | None) -> ResidentModel:
        """The resident model for a request's `model`, swapping if it names another."""
        if self._lock.locked():  # a swap is under way: wait for it, in order
            async with self._lock:
                pass
        current = self.current
        if not model or model in current.names:
            return current
        if not self.allow_swap:
            raise ModelNotFound(
                f"model {model!r} is not available; this server serves {current.model_id!r} "
                "and swapping is disabled (--no-allow-swap)", param="model",
            )
        self._check_loadable(model)
        async with self._lock:
            if model in self.current.names:  # someone else's swap brought it in
                return self.current
            return await self._swap(model)

    def _check_loadable(self, model: str) -> None:
        """What can be checked without touching the resident model."""
        try:
            check_gguf_file(Path(resolve_model(model, self._models_dir)))
        except InvalidModelId as exc:
            raise InvalidRequest(str(exc), param="model") from None
        except ModelLoadError as exc:
            raise ModelNotFound(str(exc), param="model") from None

    async def _swap(self, model: str) -> ResidentModel:
        old = self.current
        log.info("swapping model %r for %r", old.model_id, model)
        await self._stop_engine(f"the model was replaced by {model!r}")
        await trio.to_thread.run_sync(old.close)
        self._current = None
        try:
            new = await self._loader(model)
        except ModelLoadError as exc:
            log.warning("loading %r failed (%s): restoring %r", model, exc, old.model_id)
            await self._start_engine(await self._loader(None if old.is_boot_model
                                                        else old.model_id))
            raise ModelNotFound(f"model {model!r} could not be loaded: {exc}",
                                param="model") from None
        await self._start_engine(new)
        self.swaps += 1
        return new

    async def _start_engine(self, resident: ResidentModel) -> None:
        assert self._nursery is not None
        self._current = resident
        self._engine_stopped = trio.Event()
        self._engine_scope = await self._nursery.start(self._run_engine, resident)

    async def _run_engine(
        self, resident: ResidentModel, *, task_status: trio.TaskStatus[trio.CancelScope]
    ) -> None:
        try:
            with trio.CancelScope() as scope:
                task_status.started(scope)
                await resident.engine.run()
        finally:
            self._engine_stopped.set()

    async def _stop_engine(self, reason: str) -> None:
        self.current.engine.abort_all(reason)
        assert self._engine_scope is not None
        self._engine_scope.cancel()
        await self._engine_stopped.wait()
