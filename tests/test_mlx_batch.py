"""The batched affine-quantized KV cache: rows move in and out without changing a value."""

from __future__ import annotations

from typing import Any

import pytest

mx: Any = pytest.importorskip("mlx.core")
cache_module = pytest.importorskip("mlx_lm.models.cache")

from butter.backends.mlx_batch import BatchQuantizedKVCache  # noqa: E402

HEADS, DIM = 2, 32


def _filled(length: int, seed: int, bits: int = 4) -> Any:
    cache = cache_module.QuantizedKVCache(group_size=32, bits=bits)
    keys = mx.random.normal((1, HEADS, length, DIM), key=mx.random.key(seed))
    cache.update_and_fetch(keys, keys * 2)
    return cache


def _same(a: Any, b: Any) -> bool:
    (ak, av), (bk, bv) = a.keys_and_values(), b.keys_and_values()
    return a.offset == b.offset and all(
        mx.array_equal(x, y).item() for x, y in zip((*ak, *av), (*bk, *bv), strict=True))


def test_merge_extend_filter_extract_round_trip() -> None:
    caches = [_filled(5, 1), _filled(9, 2), _filled(3, 3)]
    batch = BatchQuantizedKVCache.merge(caches[:2])
    batch.extend(BatchQuantizedKVCache.merge(caches[2:]))
    assert batch.left_padding.tolist() == [4, 0, 6] and batch.offset.tolist() == [5, 9, 3]
    assert all(_same(batch.extract(row), cache) for row, cache in enumerate(caches))
    batch.filter([0, 2])  # the longest row leaves: padding columns no row needs go too
    assert batch.left_padding.tolist() == [0, 2] and batch._idx == 5
    assert _same(batch.extract(0), caches[0]) and _same(batch.extract(1), caches[2])


def test_decoding_appends_at_each_rows_own_position() -> None:
    caches = [_filled(5, 1, bits=8), _filled(2, 2, bits=8)]
    batch = BatchQuantizedKVCache.merge(caches)
    step = mx.random.normal((2, HEADS, 1, DIM), key=mx.random.key(9))
    keys, _ = batch.update_and_fetch(step, step)
    assert keys[0].shape[2] == 6 and batch.offset.tolist() == [6, 3]
    for row, cache in enumerate(caches):
        cache.update_and_fetch(step[row:row + 1], step[row:row + 1])
        assert _same(batch.extract(row), cache)  # the same quantized values as alone
    mask = batch.make_mask(1)
    # The next token of row 1 sees its 3 positions and itself, not the 3 padding columns.
    assert mask[1, 0, 0].tolist() == [False] * 3 + [True] * 4


def test_mlx_penalties_equal_llama_cpps() -> None:
    import ctypes

    import llama_cpp as ll
    import numpy as np

    from butter.backends.llama_cpp.sampling import TOKEN_DATA, token_data_array
    from butter.backends.mlx import penalize
    from butter.sampling import SamplingParams

    n_vocab, recent = 48, [3, 7, 7, 12, 3, 3, 40]
    params = SamplingParams(repeat_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.7,
                            penalty_last_n=64)
    logits = np.random.default_rng(5).normal(size=n_vocab).astype(np.float32)
    logits[7] = -abs(logits[7])  # both sides of the repeat penalty's sign rule
    logits[3] = abs(logits[3])
    sampler = ll.llama_sampler_init_penalties(n_vocab, params.penalty_last_n,
                                              params.repeat_penalty, params.frequency_penalty,
                                              params.presence_penalty)
    for token in recent:
        ll.llama_sampler_accept(sampler, token)
    candidates = np.zeros(n_vocab, dtype=TOKEN_DATA)
    candidates["id"], candidates["logit"] = np.arange(n_vocab), logits
    ll.llama_sampler_apply(sampler, ctypes.byref(token_data_array(candidates)))
    ll.llama_sampler_free(sampler)
    ours = np.array(penalize(mx, mx.array(logits), recent, params))
    assert not np.allclose(candidates["logit"], logits)  # the penalties did something
    np.testing.assert_allclose(ours, candidates["logit"], rtol=1e-6, atol=1e-6)
