"""A loaded model whose engine is running: what the library and the server both hold."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Self

import trio

from butter.pipeline.resident import ResidentModel
from butter.settings import ServeSettings

log = logging.getLogger("butter")


class LoadedModel:
    """A ResidentModel plus its engine, run as a trio system task until `aclose`.

    A system task, so that the engine outlives whichever task loaded the model: in-process
    calls and HTTP requests of one model share one engine and one admission queue."""

    def __init__(self, resident: ResidentModel) -> None:
        """Use `await LoadedModel.from_settings(...)`; this wraps an already loaded model."""
        self._resident = resident
        self._engine_scope = trio.CancelScope()
        self._engine_done = trio.Event()
        self._closed = False
        trio.lowlevel.spawn_system_task(self._run_engine, name=f"butter engine {self.id}")

    @classmethod
    async def from_settings(cls, settings: ServeSettings, model: str | None = None,
                            path: Path | None = None) -> Self:
        """Load `model` (default: settings.model) in a worker thread; the trio loop keeps
        running meanwhile. `path`: the file `model` names, where resolved already."""
        return cls(await ResidentModel.load(settings, model, path))

    @property
    def id(self) -> str:
        return self._resident.model_id

    @property
    def resident(self) -> ResidentModel:
        """The loaded model's parts (backend, engine, template)."""
        return self._resident

    async def _run_engine(self) -> None:
        try:
            with self._engine_scope:
                await self._resident.engine.step_loop()
        except Exception:  # a bug must not take the whole trio run down with it
            log.exception("the engine of %r stopped", self.id)
        finally:
            self._engine_done.set()

    async def aclose(self, reason: str = "the model was unloaded") -> None:
        """End every request of this model, stop its engine and free its memory."""
        if self._closed:
            return
        self._closed = True
        self._resident.engine.abort_all(reason)
        self._engine_scope.cancel()
        await self._engine_done.wait()
        await trio.to_thread.run_sync(self._resident.close)
