"""What a ServeServer serves: a holder of one butter.Model (the library's model is served as
it is), fixed or swapped by requests ("backend" is the word for the model library below
the engine).

- `FixedHolder(model=..., model_id=...)`: one Model, never swapped.
- `SwappableHolder(loader=..., initial_model_id=...)`: one resident Model at a time,
  swapped when a request names another id. In-flight and queued requests of the old model
  end (their clients are told the model was replaced), the old model is freed, the new
  one is loaded, and the request proceeds. Requests arriving meanwhile wait, in order. A
  bad id or a failed load answers 404 and leaves (or restores) the old model.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio

from butter.errors import InvalidRequest, ModelLoadError, ModelNotFound, NoModelLoaded
from butter.model import Model
from butter.models import InvalidModelId, ModelCatalog, check_gguf_file
from butter.pipeline.resident import ResidentModel

log = logging.getLogger("butter")

Loader = Callable[[str], Awaitable[Model]]


class ModelHolder(Protocol):
    """What the HTTP routes need from whatever holds the model."""

    swaps: int
    allow_swap: bool

    @property
    def resident(self) -> ResidentModel | None:
        """The resident model; None while none is (between a swap's unload and load, or
        after a failed swap): what answers at once, never waiting out a swap."""
        ...

    @property
    def swapping(self) -> bool:
        """A model swap is under way (readiness says 503 meanwhile)."""
        ...

    def swappable(self) -> list[str]:
        """The other ids a request may name to swap the resident model (GET /v1/models)."""
        ...

    async def resident_for(self, model: str | None) -> ResidentModel:
        """The model to serve `model` (None: whichever is resident) once any swap under
        way has ended. Naming another model swaps to it where swapping is allowed, else
        ModelNotFound; NoModelLoaded when none is resident."""
        ...

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...


def catalog_precheck(catalog: ModelCatalog) -> Callable[[str], None]:
    """The CLI's check: the id is in the catalog and names a folder with a config.json or
    a readable file with the GGUF magic."""

    def check(model: str) -> None:
        path = catalog.resolve(model)
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelLoadError(f"{path} is a folder without config.json")
            return
        check_gguf_file(path)

    return check


def _not_served(model: str, serving: ResidentModel, why: str) -> ModelNotFound:
    return ModelNotFound(
        f"model {model!r} is not available; this server serves {serving.model_id!r}{why}",
        param="model",
    )


class FixedHolder:
    """Serve one already loaded Model under `model_id`; other ids get 404."""

    allow_swap = False
    swapping = False  # never: this holder serves one model

    def __init__(self, *, model: Model, model_id: str | None = None,
                 maximum_concurrent_requests: int | None = None) -> None:
        self.model = model
        self.swaps = 0
        resident = model.resident
        if model_id is not None:
            resident.model_id = model_id
            resident.names.add(model_id)
        if maximum_concurrent_requests is not None:
            if maximum_concurrent_requests > resident.backend.n_seq:
                raise ValueError(
                    f"maximum_concurrent_requests={maximum_concurrent_requests} exceeds the "
                    f"model's {resident.backend.n_seq} sessions: load it with a larger parallel"
                )
            resident.engine.limit_slots(maximum_concurrent_requests)

    @property
    def resident(self) -> ResidentModel:
        return self.model.resident

    def swappable(self) -> list[str]:
        return []

    async def resident_for(self, model: str | None) -> ResidentModel:
        if model and model not in self.resident.names:
            raise _not_served(model, self.resident, "")
        return self.resident

    async def start(self) -> None:
        return None  # the Model is loaded and its engine runs already

    async def aclose(self) -> None:
        return None  # the caller owns the Model


class SwappableHolder:
    """One resident Model, swapped through requests' `model` (loader: id → Model)."""

    def __init__(
        self, *, loader: Loader, initial_model_id: str | None = None,
        initial: Model | None = None, allow_swap: bool = True,
        precheck: Callable[[str], None] | None = None, catalog: ModelCatalog | None = None,
    ) -> None:
        """`precheck(id)` raises ModelLoadError for ids that cannot load, before the old
        model is unloaded (by default, with a catalog: the id is in it, and its GGUF
        exists and has the magic). `catalog`: what GET /v1/models lists besides the
        resident model."""
        if initial is None and initial_model_id is None:
            raise ValueError("give initial_model_id (or an initial Model)")
        self._loader = loader
        self._initial_id = initial_model_id or (initial.id if initial else "")
        self._model = initial
        self._catalog = catalog
        self._precheck = precheck or (catalog_precheck(catalog) if catalog else None)
        self.allow_swap = allow_swap
        self._lock = trio.Lock()  # FIFO: swaps, and requests waiting for one, go in order
        self._swapping = False  # from unloading the old model until the new one has loaded
        self.swaps = 0

    @property
    def resident(self) -> ResidentModel | None:
        return None if self._model is None else self._model.resident

    @property
    def swapping(self) -> bool:
        # (Not the lock: a request that waited for a swap holds it for a moment after.)
        return self._swapping

    def swappable(self) -> list[str]:
        if not self.allow_swap or self._catalog is None:
            return []
        resident = self._model.resident.names if self._model is not None else set()
        return [entry.id for entry in self._catalog.entries() if entry.id not in resident
                and str(entry.path) not in resident]

    async def start(self) -> None:
        if self._model is None:
            self._model = await self._loader(self._initial_id)

    async def aclose(self) -> None:
        if self._model is not None:
            await self._model.aclose()
            self._model = None

    async def resident_for(self, model: str | None) -> ResidentModel:
        if self._lock.locked():  # a swap is under way: wait for it, in order
            async with self._lock:
                pass
        if self._model is None and model and self.allow_swap:
            return await self._load_after_failure(model)
        serving = self._settled()
        if not model or model in serving.names:
            return serving
        if not self.allow_swap:
            raise _not_served(model, serving, " and swapping is disabled (--no-allow-swap)")
        self._check_loadable(model)
        async with self._lock:
            serving = self._settled()
            if model in serving.names:  # someone else's swap brought it in
                return serving
            return await self._swap(model)

    def _settled(self) -> ResidentModel:
        """The resident model once no swap is under way; NoModelLoaded (503) where none is:
        after a failed swap whose restore of the old model failed too."""
        if self._model is None:
            raise NoModelLoaded("no model is loaded: a swap failed and the previous model "
                                "could not be reloaded; name a model to load one")
        return self._model.resident

    async def _load_after_failure(self, model: str) -> ResidentModel:
        """With no model resident (a failed swap and a failed restore), a request that
        names a loadable model loads it: the server recovers without a restart."""
        self._check_loadable(model)
        async with self._lock:
            if self._model is None:
                try:
                    self._swapping = True
                    self._model = await self._loader(model)
                except ModelLoadError as exc:
                    raise ModelNotFound(f"model {model!r} could not be loaded: {exc}",
                                        param="model") from None
                finally:
                    self._swapping = False
                self.swaps += 1
                log.info("loaded %r: a model is resident again", model)
        return await self.resident_for(model)

    def _check_loadable(self, model: str) -> None:
        """What can be checked without touching the resident model."""
        if self._precheck is None:
            return
        try:
            self._precheck(model)
        except InvalidModelId as exc:
            raise InvalidRequest(str(exc), param="model") from None
        except ModelLoadError as exc:
            raise ModelNotFound(str(exc), param="model") from None

    async def _swap(self, model: str) -> ResidentModel:
        self._swapping = True
        try:
            return await self._swap_models(model)
        finally:
            self._swapping = False

    async def _swap_models(self, model: str) -> ResidentModel:
        assert self._model is not None
        old, old_id = self._model, self._model.id
        restore_id = self._initial_id if old.resident.is_boot_model else old_id
        log.info("swapping model %r for %r", old_id, model)
        self._model = None
        await old.aclose(f"the model was replaced by {model!r}")  # freed before the load
        del old
        gc.collect()  # now: its objects sit in reference cycles, hundreds of MiB until then
        try:
            self._model = await self._loader(model)
        except ModelLoadError as exc:
            log.warning("loading %r failed (%s): restoring %r", model, exc, old_id)
            try:
                self._model = await self._loader(restore_id)
            except ModelLoadError as again:
                log.error("restoring %r failed too (%s): no model is resident", old_id, again)
                raise NoModelLoaded(f"model {model!r} could not be loaded ({exc}) and the "
                                    f"previous model {old_id!r} could not be reloaded "
                                    f"({again}); name a model to load one") from None
            raise ModelNotFound(f"model {model!r} could not be loaded: {exc}",
                                param="model") from None
        self.swaps += 1
        return self._model.resident
