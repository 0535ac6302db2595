"""butter picks a plain greedy request's token with an argmax instead of running llama.cpp's
greedy sampler over a candidate array per row: the two must pick the same token on any
logits, or the argmax must step aside."""

from __future__ import annotations

import ctypes

import llama_cpp as ll
import numpy as np
import pytest

from butter.backends.llama_cpp.sampling import (
    TOKEN_DATA,
    greedy_choice,
    sampler_chain,
    token_data_array,
)
from butter.sampling import SamplingParams

N_VOCAB = 5000


def _llama_cpp_greedy(logits: np.ndarray) -> int:
    chain = sampler_chain(SamplingParams(temperature=0), len(logits))
    candidates = np.zeros(len(logits), dtype=TOKEN_DATA)
    candidates["id"], candidates["logit"] = np.arange(len(logits)), logits
    array = token_data_array(candidates)
    try:
        ll.llama_sampler_apply(chain, ctypes.byref(array))
    finally:
        ll.llama_sampler_free(chain)
    return int(array.data[array.selected].id)


def _logits(kind: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    logits = rng.normal(scale=3.0, size=N_VOCAB).astype(np.float32)
    if kind == "ties":  # the largest value several times: the first one wins
        top = logits.max()
        logits[rng.choice(N_VOCAB, 4, replace=False)] = top
    elif kind == "coarse":  # few distinct values (a quantized model's logits tie often)
        logits = np.round(logits).astype(np.float32)
    elif kind == "masked":  # a logit bias or grammar's -inf everywhere but a few
        logits[rng.random(N_VOCAB) < 0.99] = -np.inf
    elif kind == "all -inf but one":
        logits[:] = -np.inf
        logits[rng.integers(N_VOCAB)] = 0.0
    return logits


@pytest.mark.parametrize("kind", ["plain", "ties", "coarse", "masked", "all -inf but one"])
def test_the_argmax_picks_llama_cpps_greedy_token(kind: str) -> None:
    for seed in range(20):
        logits = _logits(kind, seed)
        assert greedy_choice(logits) == _llama_cpp_greedy(logits)


def test_a_nan_logit_leaves_the_pick_to_llama_cpp() -> None:
    logits = _logits("plain", 0)
    logits[17] = np.nan  # numpy's argmax would stop here; llama.cpp's sampler skips it
    assert greedy_choice(logits) == -1
    assert _llama_cpp_greedy(logits) != 17
