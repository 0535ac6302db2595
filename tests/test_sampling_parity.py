"""Both backends sample the same distribution: butter/sampling.py's order of effect.

The same logits go through llama.cpp's native chain (without its draw) and through the MLX
backend's filter, at several temperatures with top-k, top-p and min-p; the tokens that
survive and the probabilities they are drawn with must agree."""

from __future__ import annotations

import ctypes

import llama_cpp as ll
import numpy as np
import pytest

from butter.backends.llama_cpp.sampling import TOKEN_DATA, sampler_chain, token_data_array
from butter.sampling import SamplingParams

mx = pytest.importorskip("mlx.core")

from butter.backends.mlx.sampling import filter_logits  # noqa: E402

N_VOCAB = 400
LOGITS = np.random.default_rng(11).normal(scale=2.5, size=N_VOCAB).astype(np.float32)
TEMPERATURES = (0.3, 1.0, 1.7)
FILTERS = [  # (top_k, top_p, min_p)
    (40, 0.95, 0.05),  # llama-server's defaults
    (0, 0.8, 0.0),
    (0, 1.0, 0.1),
    (120, 0.9, 0.02),
]
GRID = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=1)
        for t in TEMPERATURES for k, p, m in FILTERS]


def _softmax(logits: np.ndarray) -> np.ndarray:
    exp = np.exp(logits.astype(np.float64) - logits.max())
    return exp / exp.sum()


def _llama_cpp(params: SamplingParams) -> dict[int, float]:
    """Survivors of llama.cpp's chain and the probability its draw would give each."""
    chain = sampler_chain(params, N_VOCAB, draw=False)
    candidates = np.zeros(N_VOCAB, dtype=TOKEN_DATA)
    candidates["id"], candidates["logit"] = np.arange(N_VOCAB), LOGITS
    array = token_data_array(candidates)
    try:
        ll.llama_sampler_apply(chain, ctypes.byref(array))
    finally:
        ll.llama_sampler_free(chain)
    kept = [array.data[i] for i in range(array.size)]  # (samplers cut and sort in place)
    probs = _softmax(np.array([entry.logit for entry in kept]))
    return {int(entry.id): float(p) for entry, p in zip(kept, probs, strict=True)}


def _mlx(params: SamplingParams) -> dict[int, float]:
    filtered = np.array(filter_logits(mx, mx.array(LOGITS), params))
    kept = np.flatnonzero(np.isfinite(filtered))
    probs = _softmax(filtered[kept])
    return {int(token): float(p) for token, p in zip(kept, probs, strict=True)}


def _temperature_first(params: SamplingParams) -> dict[int, float]:
    """The order MLX used to follow: temperature, then the filters on that distribution."""
    scaled = LOGITS.astype(np.float64) / params.temperature
    keep = np.ones(N_VOCAB, dtype=bool)
    if params.top_k > 0:
        keep &= scaled >= np.sort(scaled)[-params.top_k]
    probs = np.where(keep, _softmax(np.where(keep, scaled, -np.inf)), 0.0)
    order = np.argsort(-probs)
    before = np.cumsum(probs[order]) - probs[order]
    keep[order[before >= params.top_p]] = False
    keep &= probs >= params.min_p * probs.max()
    kept = np.flatnonzero(keep)
    return {int(t): float(p) for t, p in zip(kept, _softmax(scaled[kept]), strict=True)}


def _agree(a: dict[int, float], b: dict[int, float]) -> bool:
    return a.keys() == b.keys() and all(abs(a[t] - b[t]) <= 1e-5 for t in a)


@pytest.mark.parametrize("params", GRID, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}"
                                                      f"-min{p.min_p}")
def test_mlx_filters_equal_llama_cpps_chain(params: SamplingParams) -> None:
    ours, theirs = _mlx(params), _llama_cpp(params)
    assert 1 < len(theirs) < N_VOCAB  # the filters cut something, and left a choice
    assert ours.keys() == theirs.keys()
    for token, p in theirs.items():
        assert ours[token] == pytest.approx(p, abs=1e-5)


def test_the_grid_tells_the_two_orders_apart() -> None:
    """Were either backend to apply temperature first, some case above would fail."""
    differ = [params for params in GRID
              if not _agree(_temperature_first(params), _llama_cpp(params))]
    assert any(params.temperature != 1.0 for params in differ)
    # (At temperature 1 the two orders are the same: a sanity check of the reference.)
    assert all(_agree(_temperature_first(p), _llama_cpp(p)) for p in GRID
               if p.temperature == 1.0)
