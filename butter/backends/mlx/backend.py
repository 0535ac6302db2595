"""The MLX backend: a checkpoint loaded through mlx-lm (loading.py), the sessions' caches
and forward passes (forward.py), sampling (sampling.py) and grammars (grammars.py), all
evaluated on the backend's own thread (butter/backends/worker.py): mlx ties unevaluated
arrays to the thread that built them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

from butter.backends.base import (
    BackendError,
    Checkpointed,
    CopyPrefix,
    KvOp,
    PromptImage,
    RemoveTokens,
    RestoreCheckpoint,
    Restored,
    RestoreSequence,
    SaveCheckpoint,
    Saved,
    SaveSequence,
    Scored,
    SeqWork,
    SetSampler,
    ShiftPositions,
    StepResult,
    apply_kv_ops,
)
from butter.backends.logprobs import token_logprobs
from butter.backends.mlx.forward import SessionCaches
from butter.backends.mlx.grammars import LlguidanceGrammars
from butter.backends.mlx.loading import MlxModel
from butter.backends.mlx.sampling import Samplers
from butter.backends.worker import BackendWorker
from butter.chat.images import DecodedImage
from butter.kv import KvCacheType
from butter.sampling import SamplingParams


class MlxBackend:
    def __init__(self, path: Path, *, n_cells: int | Callable[[int], int], n_seq: int,
                 kv_type: KvCacheType | None = None, cache_seqs: int = 0) -> None:
        """`n_cells` may be a function of the trained context (known only from the config).
        `cache_seqs`: sequence ids beyond the `n_seq` generating ones, for cached prefixes."""
        self.model = MlxModel(path, n_cells=n_cells, kv_type=kv_type)
        self.info = self.model.info
        self.kv_type = self.model.kv_type
        self.n_cells = self.model.n_cells
        self.n_seq = n_seq
        self.n_cache_seqs = cache_seqs
        self.shares_prefix_cells = False  # a prefix copy is a copy of the arrays
        # No host-RAM tier: on Apple silicon the KV pool already is host memory.
        self.saves_sequences = False
        # mlx-lm's recurrent caches (ArraysCache) are not copied out as checkpoints (yet):
        # a hybrid model's cached prompt is reused only when a new prompt extends it whole.
        self.checkpoint_bytes = 0
        self.can_shift = False
        self.rewind_limit = self.model.rewind_limit
        self.prompt_tile = 1  # mlx evaluates each sequence's prompt on its own
        self.draft_rows = 0
        # (mlx-lm's caches can be trimmed; verifying drafts in its batched decode is unbuilt)
        self.speculation_off: str | None = "speculative decoding runs on llama.cpp only"
        self.guesses = False
        self.guess_seconds = 0.0
        self.caches = SessionCaches(self.model)
        self.grammars = LlguidanceGrammars(self.model)
        self.samplers = Samplers(self.model, self.grammars)
        with contextlib.suppress(ImportError):  # built here, not in the first request
            self.grammars.tokenizer()
        self._worker = BackendWorker("butter-mlx", free=self._free)

    @property
    def kv_bytes_per_token(self) -> float:
        return self.model.kv_bytes_per_token

    @property
    def decode_batch(self) -> tuple[int, ...]:
        """The sessions whose decodes share one forward pass now."""
        return self.caches.decode_batch

    def diagnostics(self) -> dict[str, Any]:
        return {
            "step_shapes": None,
            "lm_head": None,
            "decode_batch": list(self.decode_batch),  # sessions sharing a forward pass
        }

    def team(self) -> None:
        return None  # (mlx sizes its own CPU work)

    def cached_bytes(self, seq: int) -> int:
        """Bytes of KV state the session holds (its row of the batch, if batched)."""
        return self._worker.call(self.caches.cached_bytes, seq)  # mlx work stays on its thread

    # ------------------------------------------------------------------ text and checks

    def tokenize(self, text: str, *, add_bos: bool) -> list[int]:
        with self._worker.using():
            return self.model.tokenize(text, add_bos=add_bos)

    @property
    def vision(self) -> bool:
        return False  # (mlx-lm's vision towers are not loaded: docs/mlx.md)

    def tokenize_media(self, texts: Sequence[str], images: Sequence[DecodedImage], *,
                       add_bos: bool) -> tuple[list[int], list[PromptImage]]:
        raise BackendError("MLX models here take no images")

    def write_out(self, texts: Iterable[str]) -> None:
        with self._worker.using():
            self.model.write_out(texts)

    def detokenize(self, tokens: Sequence[int]) -> str:
        with self._worker.using():
            text: str = self.model.tokenizer.decode(list(tokens))
        return text

    def check_sampling(self, params: SamplingParams) -> None:
        """Refuse (ValueError) what this backend cannot honour, before admission."""
        with self._worker.using():
            if params.grammar is not None:
                self.grammars.check(params.grammar)

    # ------------------------------------------------------------------ steps

    def step(self, ops: list[KvOp], works: list[SeqWork]) -> list[StepResult]:
        return self.submit_step(ops, works).result()

    def submit_step(self, ops: list[KvOp], works: list[SeqWork]) -> Future[list[StepResult]]:
        """`step` on the mlx thread; the engine awaits the future."""
        return self._worker.submit(self._step, ops, works)

    def _step(self, ops: list[KvOp], works: list[SeqWork]) -> list[StepResult]:
        try:
            apply_kv_ops(self, ops)
            logits = self.caches.logits(works)
            sampled: list[StepResult] = [self.samplers.sample(work.seq, logits[work.seq])
                                         for work in works if work.sample]
            sampled += [self._scored(work) for work in works
                        if work.prompt_top_logprobs is not None]
        except BaseException:
            with contextlib.suppress(Exception):  # the step's own error is the one to report
                self._settle()
            raise
        self._settle()
        return sampled

    def _scored(self, work: SeqWork) -> Scored:
        """The prompt chunk's logprobs: of each token after the first, then of the next."""
        assert work.prompt_top_logprobs is not None
        rows = np.array(self.caches.prompt_logits[work.seq].astype(self.model.mx.float32))
        targets = [*work.tokens[1:], work.next_token]
        return Scored(work.seq, tuple(
            token_logprobs(rows[offset], target, work.prompt_top_logprobs, self.model.piece)
            for offset, target in enumerate(targets) if target is not None))

    def _settle(self) -> None:
        """Evaluate every lazy array the step left behind (merged, filtered or copied caches,
        sampler keys), so that no graph grows from step to step."""
        self.model.mx.eval(self.caches.states(), self.samplers.keys())

    def remove_tokens(self, op: RemoveTokens) -> None:
        self.caches.remove(op.seq, op.start, op.end)

    def copy_prefix(self, op: CopyPrefix) -> None:
        self.caches.copy_prefix(op.src, op.dst, op.length)

    def shift_positions(self, op: ShiftPositions) -> None:
        raise BackendError("MLX caches cannot shift positions")

    def set_sampler(self, op: SetSampler) -> None:
        self.samplers.set(op.seq, op.params)

    def save_sequence(self, op: SaveSequence) -> Saved:
        raise BackendError("MLX caches are not saved to a host tier (saves_sequences)")

    def restore_sequence(self, op: RestoreSequence) -> Restored:
        raise BackendError("MLX caches are not saved to a host tier (saves_sequences)")

    def save_checkpoint(self, op: SaveCheckpoint) -> Checkpointed:
        raise BackendError("MLX caches take no checkpoints (checkpoint_bytes)")

    def restore_checkpoint(self, op: RestoreCheckpoint) -> Restored:
        raise BackendError("MLX caches take no checkpoints (checkpoint_bytes)")

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        self._worker.close()

    def _free(self) -> None:
        self.caches.clear()
        self.samplers.clear()
        self.model.free()
