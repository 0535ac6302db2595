"""Weight repacking and the bit-exact cache hit (`--deterministic`, docs/design/numerics.md).

llama.cpp's repacked (interleaved) x86 kernels quantize and multiply batch rows four at a
time and the rest one by one, so a row's result can depend on where it sits in the batch:
measured on Qwen3-0.6B's shape in Q4_K_M, a prompt's last logits moved by up to 0.056 when
another prompt shared its step (bit-identical with repacking off). butter now multiplies
Q4_K itself; llama.cpp still repacks Q4_0 (the file here), IQ4_NL and MXFP4. On the tiny models here
the repacked kernels happen to agree bit for bit, so only what butter promises is pinned:
with repacking off (`--deterministic`) a prompt's logits never depend on its neighbours,
and with it on (the server's default, for speed) the repacked kernels serve and stay close.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import llama_cpp as ll
import numpy as np
import pytest

import butter.backends.llama_cpp.loading as llama_loading
from butter.backends.llama_cpp import LlamaCppBackend
from butter.cli import build_parser, settings_from_args
from butter.pipeline.resident import ResidentModel
from tests.backend_steps import last_prompt_logits

PROMPT = "Session 4 talks about the harbour, its boats and the people who sail them"
OTHER = "A short one"


@pytest.mark.parametrize("repack", [False, True], ids=["deterministic", "repacked"])
def test_a_prompts_logits_do_not_depend_on_its_batch_neighbours(
    tiny_q4_0_gguf: Path, repack: bool,
) -> None:
    backend = LlamaCppBackend(tiny_q4_0_gguf, n_cells=1024, n_seq=2, n_batch=256, threads=2,
                              fast_lm_head=False, repack=repack)
    try:
        prompt = backend.tokenize(PROMPT, add_bos=False)
        other = backend.tokenize(OTHER, add_bos=False)
        assert len(other) % 4  # shifts the prompt's rows off llama.cpp's groups of four
        alone = last_prompt_logits(backend, None, prompt)
        beside = last_prompt_logits(backend, other, prompt)
        again = last_prompt_logits(backend, None, prompt)
        np.testing.assert_array_equal(alone, again)  # either way, the same step repeats
        if repack:
            np.testing.assert_allclose(alone, beside, atol=1e-2 * np.abs(alone).max())
        else:
            np.testing.assert_array_equal(alone, beside)
    finally:
        backend.close()


@contextmanager
def llama_log() -> Iterator[list[str]]:
    """llama.cpp's log lines while the block runs (butter keeps it quiet otherwise)."""
    lines: list[str] = []

    def collect(level: int, text: bytes, user_data: Any) -> None:
        lines.append(text.decode("utf-8", errors="replace"))

    callback = ll.llama_log_callback(collect)
    ll.llama_log_set(callback, ctypes.c_void_p(0))
    try:
        yield lines
    finally:
        ll.llama_log_set(llama_loading._log_callback, ctypes.c_void_p(0))


@pytest.mark.parametrize(("flags", "repacked"), [([], True), (["--deterministic"], False)])
def test_the_flag_decides_whether_llama_cpp_repacks(
    tiny_q4_0_gguf: Path, flags: list[str], repacked: bool,
) -> None:
    if repacked and "AVX2 = 1" not in ll.llama_print_system_info().decode():
        pytest.skip("llama.cpp repacks Q4_0 for its AVX2 (x86) or NEON kernels only")
    args = build_parser().parse_args(["serve", "--model", str(tiny_q4_0_gguf), *flags])
    llama_loading.init_llama_backend()  # (its quiet callback first, then ours over it)
    with llama_log() as lines:
        resident = ResidentModel.load_sync(settings_from_args(args))
    try:
        assert isinstance(resident.backend, LlamaCppBackend)
        repacking = [line for line in lines if "repack tensor" in line]
        assert bool(repacking) is repacked, lines[-5:]  # what llama.cpp itself did
        assert resident.metadata()["weight_repacking"] is repacked  # what /v1/server shows
    finally:
        resident.close()
