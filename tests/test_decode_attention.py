"""butter's decode attention (butter/native/decode_attention.h) through real ggml graphs:
the same bits for a row whatever the step, the threads or the chunks around it, and closer
to exact attention than llama.cpp's own."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from butter.backends.llama_cpp import LlamaCppBackend, layer_matmul
from butter.backends.llama_cpp.layer_matmul import LayerMatmul
from butter.backends.native import Unavailable
from butter.kv import parse_kv_cache

# SmolLM2-135M's shape (9 query heads on 3 KV heads of 64) and Gemma 3's (4 on 1 of 256)
SHAPES = [{"heads": 9, "kv_heads": 3, "dim": 64}, {"heads": 4, "kv_heads": 1, "dim": 256}]
MASK = (1 << 64) - 1


def kernels() -> LayerMatmul:
    try:
        return layer_matmul.registered()
    except Unavailable as exc:
        pytest.skip(f"butter's kernels are off here: {exc}")


def probe_values(seed: int, n: int) -> np.ndarray:
    """The probe's values (layer_matmul.cpp's probe_values): floats in [-1, 1) from a
    64-bit linear congruential generator."""
    a, c = 6364136223846793005, 1442695040888963407
    state = (seed * a + c) & MASK
    out = np.empty(n, dtype=np.float32)
    for i in range(n):
        state = (state * a + c) & MASK
        out[i] = np.float32((state >> 40) / float(1 << 23) - 1.0)
    return out


def exact_attention(rows: int, cells: int, heads: int, kv_heads: int, dim: int,
                    seed: int) -> np.ndarray:
    """The probe's attention in float64, from its f16 keys and values and f32 queries."""
    def cache(s: int) -> np.ndarray:
        values = probe_values(s, dim * cells * kv_heads).astype(np.float16).astype(np.float64)
        return values.reshape(kv_heads, cells, dim)

    keys, values = cache(seed), cache(seed + 1000003)
    out = np.empty((rows, heads, dim))
    for r in range(rows):
        hidden = np.arange(cells) % 5 == r % 5
        for h in range(heads):
            q = (probe_values((seed + 1 + r) * 131 + h, dim) * np.float32(4)).astype(np.float64)
            kv = h // (heads // kv_heads)
            scores = keys[kv] @ q / np.sqrt(dim)
            scores[hidden] = -np.inf
            weights = np.exp(scores - scores.max())
            out[r, h] = weights / weights.sum() @ values[kv]
    return out


@pytest.mark.parametrize("shape", SHAPES)
def test_butters_attention_is_exact_attention_to_float_rounding(shape: dict[str, int]) -> None:
    k = kernels()
    probe = {"rows": 3, "cells": 700, "threads": 2, "seed": 11, **shape}
    exact = exact_attention(3, 700, shape["heads"], shape["kv_heads"], shape["dim"], 11)
    ours = np.array(k.attention_probe(butter=True, **probe)).reshape(exact.shape)
    theirs = np.array(k.attention_probe(butter=False, **probe)).reshape(exact.shape)
    largest = np.abs(exact).max()
    assert np.abs(ours - exact).max() < 1e-5 * largest
    # llama.cpp rounds the query to f16 and sums the values in f16
    assert np.abs(theirs - exact).max() > 10 * np.abs(ours - exact).max()
    assert np.abs(theirs - ours).max() <= layer_matmul.ATTENTION_TOLERANCE


@pytest.mark.parametrize("shape", SHAPES)
def test_a_rows_attention_is_the_same_bits_whatever_the_step_and_the_threads(
    shape: dict[str, int],
) -> None:
    k = kernels()
    width = shape["heads"] * shape["dim"]
    probe = {"cells": 1100, "seed": 3, **shape}
    lone = k.attention_probe(butter=True, rows=1, threads=2, **probe)
    assert len(lone) == width
    for rows, threads in ((2, 2), (9, 2), (16, 1), (40, 3), (5, 4)):
        step = k.attention_probe(butter=True, rows=rows, threads=threads, **probe)
        assert step[:width] == lone, (rows, threads)
    # llama.cpp's own: a lone row split over the cells rounds otherwise than in a step
    theirs = k.attention_probe(butter=False, rows=1, threads=2, **probe)
    assert k.attention_probe(butter=False, rows=9, threads=2, **probe)[:width] != theirs


def test_attention_that_disagrees_with_llama_cpp_stays_with_llama_cpp(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    k = kernels()
    assert layer_matmul._checked_attention(k) == "butter" == k.attention
    monkeypatch.setattr(layer_matmul, "ATTENTION_TOLERANCE", 1e-9)
    verdict = layer_matmul._checked_attention(k)
    assert verdict.startswith("llama.cpp (butter's differs from llama.cpp's by")


def test_a_quantized_cache_leaves_the_attention_to_llama_cpp(tiny_gguf: Path) -> None:
    kernels()
    backend = LlamaCppBackend(tiny_gguf, n_cells=512, n_seq=1, n_batch=64, threads=2,
                              repack=True, kv_type=parse_kv_cache("affine8"))
    try:
        assert backend.decode_attention == "llama.cpp (a q8_0 cache: row by row)"
    finally:
        backend.close()
