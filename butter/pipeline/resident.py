"""The resident model: backend + engine + chat template under one id, and how it loads."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import trio

from butter.backends.base import Backend, PromptImage
from butter.chat.images import RECENT_IMAGE_BYTES, DecodedImage, ImageLimits, RecentImages
from butter.chat.template import ChatTemplate, choose_template
from butter.engine.engine import Engine
from butter.engine.prefix_cache import CheckpointStats
from butter.errors import ModelLoadError
from butter.kv import kv_window, parse_kv_cache
from butter.models import projector_beside, resolve_model
from butter.settings import (
    DEFAULT_CACHED_PROMPTS,
    DEFAULT_CELLS_PER_EXTRA_SESSION,
    DEFAULT_MAX_CONTEXT_CAP,
    ServeSettings,
)

log = logging.getLogger("butter")


@attrs.frozen
class KvGeometry:
    max_context: int  # positions one request may use (prompt + completion)
    pool_cells: int  # KV cells shared by all sessions


def kv_geometry(n_ctx_train: int, settings: ServeSettings) -> KvGeometry:
    trained = n_ctx_train if n_ctx_train > 0 else DEFAULT_MAX_CONTEXT_CAP
    max_context = settings.max_context or min(trained, DEFAULT_MAX_CONTEXT_CAP)
    pool = settings.kv_pool or max_context + (settings.parallel - 1) * min(
        max_context, DEFAULT_CELLS_PER_EXTRA_SESSION
    )
    return KvGeometry(max_context=max_context, pool_cells=max(pool, max_context))


def is_mlx_checkpoint(path: Path) -> bool:
    """A HuggingFace / MLX model directory (config.json + safetensors), not a GGUF."""
    return path.is_dir() and (path / "config.json").is_file()


# llama.cpp's bound on sequence ids (LLAMA_MAX_SEQ), less its scratch sequence.
MAX_SEQUENCES = 255


def cache_sequences(parallel: int) -> int:
    """Sequence ids for cached prompts beside the `parallel` generating ones."""
    return max(0, min(DEFAULT_CACHED_PROMPTS, MAX_SEQUENCES - parallel))


def projector_for(path: Path, settings: ServeSettings, *, is_boot_model: bool) -> Path | None:
    """The vision projector to load with the model at `path`: --mmproj for the boot model,
    else (--mmproj-auto) the one llama-server would find for it (models.projector_beside)."""
    if settings.mmproj is not None and is_boot_model:
        return Path(settings.mmproj).expanduser()
    return projector_beside(path) if settings.mmproj_auto else None


def _load_backend(path: Path, settings: ServeSettings, size_pool: Callable[[int], int], *,
                  is_boot_model: bool = True) -> Backend:
    """`is_boot_model`: a --draft-model that cannot serve it is an error (else the model
    runs without it, and /v1/server says why); --mmproj is its projector."""
    kv_type = parse_kv_cache(settings.kv_cache)
    cache_seqs = cache_sequences(settings.parallel)
    mmproj = projector_for(path, settings, is_boot_model=is_boot_model)
    if is_mlx_checkpoint(path):
        if mmproj is not None:
            raise ModelLoadError(f"--mmproj works with GGUF models (llama.cpp), and {path} is "
                                 "an MLX checkpoint: butter has no image path on MLX yet")
        from butter.backends.mlx import MlxBackend

        if settings.draft_model is not None:
            raise ModelLoadError("--draft-model works with GGUF models (llama.cpp), and "
                                 f"{path} is an MLX checkpoint")
        return MlxBackend(path, n_cells=size_pool, n_seq=settings.parallel, kv_type=kv_type,
                          cache_seqs=cache_seqs)
    from butter.backends.llama_cpp import LlamaCppBackend  # (an MLX-only install has none)

    return LlamaCppBackend(
        path, n_cells=size_pool, n_seq=settings.parallel, cache_seqs=cache_seqs,
        n_batch=settings.prefill_chunk + settings.parallel, threads=settings.threads,
        kv_type=kv_type, step_shaping=settings.step_shaping, fast_lm_head=settings.fast_lm_head,
        repack=not settings.deterministic, fast_layers=settings.fast_layers,
        draft_model=Path(settings.draft_model) if settings.draft_model else None,
        draft_required=is_boot_model, exact_decode=settings.deterministic,
        fit_threads=settings.fit_threads, mmproj=mmproj,
    )


class ResidentModel:
    def __init__(
        self, model_id: str, backend: Backend, template: ChatTemplate,
        geometry: KvGeometry, settings: ServeSettings,
    ) -> None:
        self.model_id = model_id
        self.names = {model_id}  # every id that names this model without a reload
        self.is_boot_model = False
        self.backend = backend
        self.template = template
        self.template_defaults = settings.template_defaults()
        self.max_context = min(geometry.max_context, backend.n_cells)
        self.window = kv_window(settings.kv_window_size, settings.kv_window_keep)
        self.engine = Engine(
            backend, parallel=settings.parallel, max_context=self.max_context,
            prefill_chunk=settings.prefill_chunk, max_queue=settings.max_queue,
            window=self.window, decode_stall=settings.decode_stall,
            cache_ram_bytes=settings.cache_ram_mib * 2**20, draft_max=settings.draft_max,
            checkpoints_per_sequence=settings.ctx_checkpoints,
        )
        self.kv_requested = settings.kv_cache
        self.strict_max_tokens = settings.strict_max_tokens
        self.image_limits = ImageLimits(max_bytes=settings.max_image_bytes,
                                        max_pixels=settings.max_image_pixels,
                                        max_images=settings.max_images)
        self.recent_images = RecentImages(RECENT_IMAGE_BYTES)
        self.aura_decode_path = settings.aura_decode_path

    @classmethod
    def load_sync(cls, settings: ServeSettings, model_id: str | None = None,
                  path: Path | None = None) -> ResidentModel:
        """Resolve, load and size the model (blocking: call from a worker thread).
        `path`: where `model_id` was resolved already (a request's id, by the catalog)."""
        alias = settings.alias if model_id is None else None
        model_id = model_id or settings.model
        path = path or resolve_model(model_id, settings.models_dir)
        geometry_holder: list[KvGeometry] = []

        def size_pool(n_ctx_train: int) -> int:
            geometry_holder.append(kv_geometry(n_ctx_train, settings))
            return geometry_holder[0].pool_cells

        backend = _load_backend(Path(path), settings, size_pool,
                                is_boot_model=model_id == settings.model)
        try:
            info = backend.info
            if settings.kv_window_size is not None and not backend.can_shift:
                raise ModelLoadError(
                    f"--kv-window-size needs a KV cache that can shift positions, and "
                    f"{info.architecture} ({info.description}) cannot")
            choice = choose_template(settings.chat_template, info.embedded_chat_template,
                                     info.architecture)
            template = ChatTemplate(choice, bos_token=info.bos_text, eos_token=info.eos_text)
            backend.write_out(marker for syntax in template.call_syntaxes
                              for marker in syntax.markers)
        except BaseException:
            backend.close()
            raise
        resident = cls(alias or model_id, backend, template, geometry_holder[0], settings)
        resident.is_boot_model = model_id == settings.model
        resident.names = {model_id, str(path), str(path.resolve()), alias or model_id}
        return resident

    @classmethod
    async def load(cls, settings: ServeSettings, model_id: str | None = None,
                   path: Path | None = None) -> ResidentModel:
        """Load in a worker thread; cancelling the caller waits for the load to finish."""
        return await trio.to_thread.run_sync(cls.load_sync, settings, model_id, path)

    @functools.cached_property
    def turn_marker_tokens(self) -> tuple[int, ...]:
        """The tokens that open every message in this template's prompts (none: unknown)."""
        marker = self.template.turn_marker
        return tuple(self.backend.tokenize(marker, add_bos=False)) if marker else ()

    def tokenize_prompt(self, text: str) -> list[int]:
        return self.backend.tokenize(text, add_bos=self._adds_bos(text))

    def tokenize_media(self, texts: list[str], images: list[DecodedImage]
                       ) -> tuple[list[int], list[PromptImage]]:
        """A prompt's text pieces with an image between each two, tokenized together."""
        return self.backend.tokenize_media(texts, images, add_bos=self._adds_bos(texts[0]))

    def _adds_bos(self, text: str) -> bool:
        """Add BOS only when the model wants one and the template did not render it."""
        bos = self.backend.info.bos_text
        return self.backend.info.add_bos and not (bos and text.startswith(bos))

    def metadata(self) -> dict[str, Any]:
        info = self.backend.info
        return {
            "path": info.path,
            "architecture": info.architecture,
            "description": info.description,
            "n_ctx_train": info.n_ctx_train,
            "n_vocab": info.n_vocab,
            "size_bytes": info.size_bytes,
            "chat_template": self.template.origin,
            # What the template renders itself; the rest is rewritten (chat/polyfill.py).
            "chat_template_capabilities": attrs.asdict(self.template.capabilities),
            "vision": self.backend.vision,  # a projector is loaded: prompts may hold images
            "kv_cells": self.backend.n_cells,
            **self.backend.diagnostics(),  # step_shapes, lm_head, ...: each backend its own
            "parallel": self.backend.n_seq,
            "kv": self.kv_info(),
        }

    def kv_info(self) -> dict[str, Any]:
        per_token = self.backend.kv_bytes_per_token
        return {
            "cache": self.kv_requested,
            "type": self.backend.kv_type.name,
            "bytes_per_token": round(per_token, 1),
            "pool_cells": self.backend.n_cells,
            "pool_mib": round(per_token * self.backend.n_cells / 2**20, 1),
            "max_context": self.max_context,
            "window_size": self.window.size if self.window else None,
            "window_keep": self.window.keep if self.window else None,
            "aura_decode_path": self.aura_decode_path,
        }

    def prefix_cache_info(self) -> dict[str, Any]:
        """What /v1/server shows of the prefix cache: its entries in the KV pool and in
        host RAM, and how often prompts were served from it."""
        stats = self.engine.stats()
        host = stats.host
        per_token = self.backend.kv_bytes_per_token
        return {
            "kv_entries": stats.cached_entries,
            "kv_entry_capacity": len(stats.session_cells),  # sequence ids, busy or idle
            "kv_cells_used": stats.used_cells,
            "kv_cells_cached_only": stats.idle_cached_cells,
            "host_ram": None if host is None else {
                "entries": host.entries, "bytes": host.bytes, "budget_bytes": host.budget_bytes,
                "saved": host.saved, "restored": host.restored,
                "restored_tokens": host.restored_tokens,
                "bytes_per_token": round(per_token, 1),
            },
            "host_ram_unavailable": None if self.backend.saves_sequences else (
                "this backend keeps no host-RAM tier (on MLX the KV pool is host memory)"),
            "checkpoints": self._checkpoints_info(stats.checkpoints),
            "hits": stats.prefix_hits, "misses": stats.prefix_misses,
            "prompt_tokens": stats.prompt_tokens, "cached_tokens": stats.cached_tokens,
        }

    def _checkpoints_info(self, stats: CheckpointStats | None) -> dict[str, Any]:
        """Context checkpoints: what they did and hold, or why this model takes none."""
        if stats is not None:
            return {"per_sequence": self.engine.cache.checkpoints_per_sequence,
                    "bytes_each": self.backend.checkpoint_bytes, **attrs.asdict(stats)}
        if not self.backend.info.is_recurrent:
            why = "not needed: this model's KV cache can be cut back anywhere"
        elif not self.backend.checkpoint_bytes:
            why = ("this backend takes no checkpoints (MLX): a recurrent or hybrid model's "
                   "cached prompt is reused only when a new prompt extends it whole")
        else:
            why = "off (--ctx-checkpoints 0 or --cache-ram 0)"
        return {"off": why}

    def speculation_info(self) -> dict[str, Any]:
        """What /v1/server shows of speculative decoding: whether it runs (and why not),
        its draft tokens verified and accepted, and each running request's acceptance."""
        engine = self.engine
        stats = engine.stats()
        return {
            "enabled": engine.speculation_off is None,
            "off_because": engine.speculation_off,
            "draft_max": engine.speculation.draft_max,
            "max_step_rows": engine.speculation.draft_rows,
            "draft_model": getattr(self.backend, "drafter_path", None),
            "draft_model_off_because": getattr(self.backend, "draft_model_off", None),
            "draft_steps": stats.draft_steps,
            "drafted_tokens": stats.drafted_tokens,
            "accepted_tokens": stats.accepted_tokens,
            "rejected_tokens": stats.drafted_tokens - stats.accepted_tokens,
            "acceptance_by_seq": {str(seq): rate for seq, rate in stats.acceptance},
        }

    def close(self) -> None:
        self.backend.close()
        self.recent_images.clear()  # (a request still holding this model keeps no pixels)
