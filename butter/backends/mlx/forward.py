"""Each session's mlx-lm cache, the decode batch, and the forward passes over them.

The sessions that decode in a step share one forward pass: their caches are merged into
mlx-lm's batched caches (`BatchKVCache`, the structure its BatchGenerator decodes with:
rows left-padded to a common length, masked) and stay merged while they keep decoding; a
session leaves the batch (`extract`) when it stops decoding or the engine edits its cache.
Only sessions of similar lengths batch (butter/backends/batching.py: padding at most
doubles their KV). Prompt chunks run per session (their lengths and starting positions
differ), and so do models with recurrent layers. Affine-quantized caches batch through
butter's BatchQuantizedKVCache (butter/backends/mlx_batch.py).
"""

from __future__ import annotations

from typing import Any

import attrs

from butter.backends.base import BackendError, SeqWork
from butter.backends.batching import choose_batch
from butter.backends.mlx.loading import MlxModel


@attrs.define
class DecodeBatch:
    """Decoding sessions whose caches are merged into mlx-lm's batched caches, row i = seqs[i]."""

    seqs: list[int]
    cache: list[Any]


class SessionCaches:
    """The sessions' caches and positions; every method runs on the backend's thread."""

    def __init__(self, model: MlxModel) -> None:
        self._model = model
        self._mx = model.mx
        self.can_batch = model.can_batch  # (benchmarks switch it off to compare)
        self._caches: dict[int, list[Any]] = {}
        self._lengths: dict[int, int] = {}  # positions each session's cache holds
        self._batch: DecodeBatch | None = None
        # This step's every-row logits of works that score their prompt
        # (SeqWork.prompt_top_logprobs).
        self.prompt_logits: dict[int, Any] = {}

    # ------------------------------------------------------------------ cache edits

    def remove(self, seq: int, start: int, end: int) -> None:
        """Drop positions [start, end) (end -1: to the end); only the most recent go."""
        if start <= 0:  # the whole sequence: no need to copy its row out first
            self._remove_rows([seq])
            self._caches[seq], self._lengths[seq] = self._model.new_cache(), 0
            return
        cache = self._own_cache(seq)
        length = self._lengths.get(seq, 0)
        if cache is None:
            self._caches[seq], self._lengths[seq] = self._model.new_cache(), 0
        elif start < length:
            end = length if end < 0 else end
            if end != length:
                raise BackendError("MLX caches can only drop their most recent positions")
            if self._model.trim(cache, end - start) != end - start:
                raise BackendError(f"seq {seq}'s cache cannot be cut back to {start}")
            self._lengths[seq] = start

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        self._remove_rows([dst])  # about to be overwritten
        self._caches[dst] = self._copy(self._read_cache(src), length)
        self._lengths[dst] = length

    def _copy(self, donor: list[Any], length: int) -> list[Any]:
        fresh = self._model.new_cache()
        for target, source in zip(fresh, donor, strict=True):
            keys, values = source.keys_and_values()
            if isinstance(keys, tuple):  # quantized: (packed, scales, biases)
                target.keys = tuple(part[..., :length, :] for part in keys)
                target.values = tuple(part[..., :length, :] for part in values)
                target.offset = length
            elif hasattr(target, "max_size"):  # sliding window, not wrapped (rewind_limit)
                target.keys, target.values = keys[..., :length, :], values[..., :length, :]
                target.offset = target._idx = length
            else:
                target.state = (keys[..., :length, :], values[..., :length, :], length)
        return fresh

    def _own_cache(self, seq: int) -> list[Any] | None:
        """The session's own cache, taken out of the decode batch if it is in it."""
        self._leave_batch([seq])
        return self._caches.get(seq)

    def _read_cache(self, seq: int) -> list[Any]:
        """The session's cache to read from; a batched session stays in its batch."""
        batch = self._batch
        if batch is not None and seq in batch.seqs:
            row = batch.seqs.index(seq)
            return [layer.extract(row) for layer in batch.cache]
        return self._caches[seq]

    def cached_bytes(self, seq: int) -> int:
        """Bytes of KV state the session holds (its row of the batch, if batched)."""
        if seq not in self._caches and seq not in self.decode_batch:
            return 0
        return sum(int(layer.nbytes) for layer in self._read_cache(seq))

    # ------------------------------------------------------------------ forward passes

    def logits(self, works: list[SeqWork]) -> dict[int, Any]:
        """Evaluate the works; the last position's logits by seq (and every position's,
        in prompt_logits, for works that score their prompt)."""
        self.prompt_logits = {}
        decoding = [work for work in works if not work.prompt]
        logits: dict[int, Any] = {}
        if self.can_batch and decoding:
            logits.update(self._decode_batched(decoding))
        for work in works:
            if work.seq not in logits:
                logits[work.seq] = self._forward(work)
        return logits

    def _forward(self, work: SeqWork) -> Any:
        cache = self._own_cache(work.seq)
        if cache is None:
            cache = self._caches[work.seq] = self._model.new_cache()
        self._check_position(work)
        inputs = self._mx.array([list(work.tokens)])
        every = self._model.model(inputs, cache=cache)[0]
        logits = every[-1]
        self._mx.eval(logits, [layer.state for layer in cache])
        if work.prompt_top_logprobs is not None:  # every row's logits, to score the prompt
            self.prompt_logits[work.seq] = every
        self._lengths[work.seq] = work.start + len(work.tokens)
        return logits

    def _check_position(self, work: SeqWork) -> None:
        length = self._lengths.get(work.seq, 0)
        if length != work.start:
            raise BackendError(f"seq {work.seq} is at {length}, not {work.start}")

    def states(self) -> list[Any]:
        """Every cache's arrays (to evaluate what a step left lazy)."""
        batch = [] if self._batch is None else [self._batch.cache]
        return [layer.state for cache in (*self._caches.values(), *batch) for layer in cache]

    # ------------------------------------------------------------------ the decode batch

    @property
    def decode_batch(self) -> tuple[int, ...]:
        """The sessions whose decodes share one forward pass now."""
        batch = self._batch  # (read once: a step may replace it meanwhile)
        return () if batch is None else tuple(batch.seqs)

    def _decode_batched(self, works: list[SeqWork]) -> dict[int, Any]:
        """One forward pass for the decoding sessions that batch well; logits by seq
        (the others decode on their own)."""
        for work in works:
            self._check_position(work)
        wanted = choose_batch({work.seq: work.start for work in works})
        members = self._batch.seqs if self._batch is not None else []
        self._leave_batch([seq for seq in members if seq not in wanted])
        self._join_batch([seq for seq in wanted if seq not in members])
        batch = self._batch
        if batch is None:
            return {}
        mx = self._mx
        rows = {seq: row for row, seq in enumerate(batch.seqs)}
        tokens = [0] * len(batch.seqs)
        for work in works:
            if work.seq in rows:
                tokens[rows[work.seq]] = work.tokens[0]
                self._lengths[work.seq] = work.start + 1
        try:
            logits = self._model.model(mx.array(tokens)[:, None], cache=batch.cache)[:, -1]
            mx.eval(logits, [layer.state for layer in batch.cache])
        except BaseException:
            # Its caches may be half-updated: drop the batch (the engine drops these
            # sessions, every one of which was in the failed step).
            self._batch = None
            for seq in batch.seqs:
                self._lengths[seq] = 0
            raise
        return {seq: logits[row] for seq, row in rows.items()}

    def _join_batch(self, seqs: list[int]) -> None:
        if not seqs:
            return
        missing = [seq for seq in seqs if seq not in self._caches]
        if missing:
            raise BackendError(f"seq {missing[0]} has no cache to decode from")
        joining = [self._caches.pop(seq) for seq in seqs]
        merged = [self._merge_layers(list(layers)) for layers in zip(*joining, strict=True)]
        if self._batch is None:
            self._batch = DecodeBatch(seqs=list(seqs), cache=merged)
            return
        for layer, extra in zip(self._batch.cache, merged, strict=True):
            layer.extend(extra)
        self._batch.seqs.extend(seqs)

    def _merge_layers(self, layers: list[Any]) -> Any:
        """One layer's caches of several sessions as one batched cache."""
        if isinstance(layers[0], self._model.quantized_cache_class):
            from butter.backends.mlx_batch import BatchQuantizedKVCache

            return BatchQuantizedKVCache.merge(layers)  # mlx-lm has no batched quantized cache
        return type(layers[0]).merge(layers)

    def _leave_batch(self, seqs: list[int]) -> None:
        """Give these sessions their own caches back (a copy of their rows)."""
        batch = self._batch
        for seq in seqs:
            if batch is not None and seq in batch.seqs:
                row = batch.seqs.index(seq)
                self._caches[seq] = [layer.extract(row) for layer in batch.cache]
        self._remove_rows(seqs)

    def _remove_rows(self, seqs: list[int]) -> None:
        """Take these sessions out of the batch (without keeping their rows)."""
        batch = self._batch
        if batch is None or not any(seq in batch.seqs for seq in seqs):
            return
        keep = [row for row, member in enumerate(batch.seqs) if member not in seqs]
        if not keep:
            self._batch = None
            return
        for layer in batch.cache:
            layer.filter(keep)
        batch.seqs = [batch.seqs[row] for row in keep]

    def clear(self) -> None:
        self._caches.clear()
        self._lengths.clear()
        self._batch = None
