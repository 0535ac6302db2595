"""A batched affine-quantized KV cache for mlx-lm, which has BatchKVCache but no quantized
counterpart.

Same layout and contract as mlx-lm's BatchKVCache (rows left-padded to a common length,
`left_padding` and per-row `offset` arrays, causal mask with the padding masked out), with
K and V stored as mlx's (packed, scales, biases) triples like QuantizedKVCache. mlx-lm's
attention dispatches on the `bits` attribute to its quantized attention, which takes the
same boolean mask. Merge, extend, filter and extract let the MLX backend move decoding
sessions in and out of the batch; quantized values are copied, never re-quantized.
"""

from __future__ import annotations

from typing import Any

import mlx.core
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import QuantizedKVCache

mx: Any = mlx.core  # its stubs type tolist() and friends as unions; arrays are Any here
Triple = tuple[Any, Any, Any]


def _pad_positions(triple: Triple, left: int, right: int) -> Triple:
    if left == 0 and right == 0:
        return triple
    widths = [(0, 0)] * (triple[0].ndim - 2) + [(left, right), (0, 0)]
    return tuple(mx.pad(part, widths) for part in triple)


class BatchQuantizedKVCache:
    step = 256

    def __init__(self, left_padding: list[int], *, group_size: int, bits: int) -> None:
        self.keys: Triple | None = None
        self.values: Triple | None = None
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-pad for pad in left_padding])
        self._idx = 0
        self.group_size = group_size
        self.bits = bits

    # ------------------------------------------------------------------ the forward pass

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Triple, Triple]:
        batch, heads, steps, _ = keys.shape
        previous = self._idx
        if self.keys is None or previous + steps > self.keys[0].shape[-2]:
            self._grow(batch, heads, steps, keys)
        assert self.keys is not None and self.values is not None
        self.offset = self.offset + steps
        self._idx += steps
        new_keys = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        new_values = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        for stored, fresh in ((self.keys, new_keys), (self.values, new_values)):
            for part, update in zip(stored, fresh, strict=True):
                part[..., previous:self._idx, :] = update
        return self.keys_and_values()

    def _grow(self, batch: int, heads: int, steps: int, like: Any) -> None:
        """Room for `steps` more positions, in blocks of `step`."""
        per_word = 32 // self.bits
        added = (self.step + steps - 1) // self.step * self.step
        shape = (batch, heads, added)

        def empty(dim: int) -> Triple:
            return (mx.zeros((*shape, dim // per_word), dtype=mx.uint32),
                    mx.zeros((*shape, dim // self.group_size), dtype=like.dtype),
                    mx.zeros((*shape, dim // self.group_size), dtype=like.dtype))

        if self.keys is None or self.values is None:
            self.keys, self.values = empty(like.shape[-1]), empty(like.shape[-1])
            return
        kept = self._idx
        self.keys = _pad_positions(
            tuple(part[..., :kept, :] for part in self.keys), 0, added)
        self.values = _pad_positions(
            tuple(part[..., :kept, :] for part in self.values), 0, added)

    def keys_and_values(self) -> tuple[Any, Any]:
        assert self.keys is not None and self.values is not None
        cut = self._idx
        return (tuple(part[..., :cut, :] for part in self.keys),
                tuple(part[..., :cut, :] for part in self.values))

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding,
                                  **kwargs)

    @property
    def state(self) -> tuple[Any, ...]:
        return self.keys, self.values, self.offset, self.left_padding

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return sum(int(part.nbytes) for part in (*self.keys, *self.values))

    # ------------------------------------------------------------------ batch membership

    @classmethod
    def merge(cls, caches: list[QuantizedKVCache]) -> BatchQuantizedKVCache:
        """One batch from single-sequence caches (each holding positions), right-aligned."""
        first = caches[0]
        lengths = [int(cache.offset) for cache in caches]
        longest = max(lengths)
        merged = cls([longest - length for length in lengths],
                     group_size=first.group_size, bits=first.bits)
        rows = [cache.keys_and_values() for cache in caches]  # type: ignore[no-untyped-call]
        merged.keys = _stack([_pad_positions(keys, longest - length, 0)
                              for (keys, _), length in zip(rows, lengths, strict=True)])
        merged.values = _stack([_pad_positions(values, longest - length, 0)
                                for (_, values), length in zip(rows, lengths, strict=True)])
        merged.offset = merged.offset + longest
        merged._idx = longest
        return merged

    def extend(self, other: BatchQuantizedKVCache) -> None:
        """Append the rows of `other`, both right-aligned to the longer one."""
        longest = max(self._idx, other._idx)
        mine_k, mine_v = self.keys_and_values()
        theirs_k, theirs_v = other.keys_and_values()
        self.keys = _stack([_pad_positions(mine_k, longest - self._idx, 0),
                            _pad_positions(theirs_k, longest - other._idx, 0)])
        self.values = _stack([_pad_positions(mine_v, longest - self._idx, 0),
                              _pad_positions(theirs_v, longest - other._idx, 0)])
        self.left_padding = mx.concatenate([self.left_padding + (longest - self._idx),
                                            other.left_padding + (longest - other._idx)])
        self.offset = mx.concatenate([self.offset, other.offset])
        self._idx = longest

    def filter(self, batch_indices: list[int]) -> None:
        """Keep these rows, then drop the padding columns no row needs any more."""
        index = mx.array(batch_indices)
        if self.keys is not None and self.values is not None:
            self.keys = tuple(part[index] for part in self.keys)
            self.values = tuple(part[index] for part in self.values)
        self.offset = self.offset[index]
        self.left_padding = self.left_padding[index]
        unused = min(self.left_padding.tolist())
        if unused > 0:
            if self.keys is not None and self.values is not None:
                self.keys = tuple(part[..., unused:, :] for part in self.keys)
                self.values = tuple(part[..., unused:, :] for part in self.values)
            self._idx -= unused
            self.left_padding = self.left_padding - unused

    def extract(self, row: int) -> Any:
        """Row `row` as a single-sequence cache of its own (a copy)."""
        cache: Any = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        pad = int(self.left_padding.tolist()[row])
        if self.keys is not None and self.values is not None:
            cache.keys = tuple(mx.contiguous(part[row:row + 1, :, pad:self._idx])
                               for part in self.keys)
            cache.values = tuple(mx.contiguous(part[row:row + 1, :, pad:self._idx])
                                 for part in self.values)
        cache.offset = self._idx - pad
        return cache


def _stack(triples: list[Triple]) -> Triple:
    """Concatenate (packed, scales, biases) triples along the batch axis."""
    return tuple(mx.concatenate(list(parts), axis=0) for parts in zip(*triples, strict=True))
