"""butter's output projection (butter/native/lmhead.c, butter/backends/lmhead.py).

The kernel is checked three ways: against the Q8_0 arithmetic written out in numpy,
against llama.cpp's own logits on the same hidden states, and by greedy generation on
the demo model, which must not change when butter computes the logits.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

import butter.backends.llama_cpp as llama_backend
import butter.backends.llama_cpp.loading as llama_loading
import butter.backends.lmhead as lmhead_module
from butter.backends.base import BackendError, RemoveTokens, SeqWork, SetSampler
from butter.backends.gguf_tensors import read_header
from butter.backends.llama_cpp import LlamaCppBackend
from butter.backends.llama_cpp.loading import BUTTER_EXACT_ROWS
from butter.backends.lmhead import (
    DECLINED,
    E_SHORT,
    ISA_NONE,
    ISA_VARIABLE,
    OK,
    LmHead,
    NativeError,
)
from butter.backends.native import Unavailable
from butter.cli import build_parser, settings_from_args
from butter.pipeline.resident import ResidentModel
from butter.sampling import SamplingParams
from butter.testing.tiny_gguf import write_tiny_qwen3_gguf
from tests.backend_steps import generate_greedy


def _head_or_skip(path: Path, *, max_rows: int = 16) -> LmHead:
    try:
        return LmHead(path, threads=2, max_rows=max_rows)
    except Unavailable as exc:
        pytest.skip(f"butter's output projection does not apply here: {exc}")


def _backend(path: Path, *, fast: bool, n_seq: int = 4) -> LlamaCppBackend:
    backend = LlamaCppBackend(path, n_cells=1024, n_seq=n_seq, n_batch=256, threads=2,
                              fast_lm_head=fast)
    if fast and backend.model.lm_head is None:
        backend.close()
        pytest.skip(f"butter's output projection does not apply here: {backend.lm_head}")
    return backend


# ------------------------------------------------------------------ the GGUF header


def test_header_locates_every_tensor_as_the_gguf_package_does(tiny_gguf: Path) -> None:
    header = read_header(tiny_gguf, keys=["general.architecture", "qwen3.block_count"])
    reader = gguf.GGUFReader(tiny_gguf)
    assert set(header.tensors) == {tensor.name for tensor in reader.tensors}
    for tensor in reader.tensors:
        info = header.tensors[tensor.name]
        assert info.offset == tensor.data_offset
        assert info.shape == tuple(int(n) for n in tensor.shape)
        assert info.ggml_type == int(tensor.tensor_type)
    assert header.metadata == {"general.architecture": "qwen3", "qwen3.block_count": 2}
    assert header.keys == set(reader.fields) - {"GGUF.version", "GGUF.tensor_count",
                                                "GGUF.kv_count"}


# ------------------------------------------------------------------ the kernel


def _q8_0_reference(path: Path, hidden: np.ndarray) -> np.ndarray:
    """Logits as ggml defines them: Q8_0 weights times Q8_0-quantized activations."""
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == "output.weight")
    n_embd, n_vocab = (int(n) for n in tensor.shape)
    return _reference(np.asarray(tensor.data).reshape(n_vocab, n_embd // 32, 34), hidden)


def _reference(blocks: np.ndarray, hidden: np.ndarray) -> np.ndarray:
    """`_q8_0_reference` for raw Q8_0 blocks ([n_vocab][n_embd / 32][34 bytes])."""
    n_embd = blocks.shape[1] * 32
    weight_scale = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)
    weights = blocks[..., 2:].copy().view(np.int8).astype(np.float64)
    x = hidden.reshape(len(hidden), n_embd // 32, 32).astype(np.float32)
    amax = np.abs(x).max(-1, keepdims=True)
    inverse = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax != 0)
    quantized = np.rint(x * inverse).astype(np.float64)  # half to even, like ggml's x86 code
    scale = (amax / np.float32(127)).astype(np.float16).astype(np.float64)[..., 0]
    # Exact integer dot product per block, then both scales, summed over blocks.
    dots = np.einsum("rbk,vbk->rvb", quantized, weights)
    return np.einsum("rvb,vb,rb->rv", dots, weight_scale, scale)


ISAS = ["avx512-vnni", "avx2"]


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each kernel in turn (skipped where the CPU lacks it)."""
    monkeypatch.setenv(ISA_VARIABLE, request.param)
    return str(request.param)


@pytest.mark.parametrize("rows", [1, 5, 8, 11, 16, 70])  # (70: two sweeps of the matrix)
def test_logits_are_the_q8_0_arithmetic(tiny_gguf: Path, rows: int, isa: str) -> None:
    head = _head_or_skip(tiny_gguf, max_rows=max(rows, 16))
    assert head.isa.lower() == isa
    assert head.n_vocab % 16  # the tiny vocabulary ends in a partial tile: covered here
    hidden = np.random.default_rng(rows).standard_normal((rows, head.n_embd)).astype(np.float32)
    hidden[0, :32] = 0.0  # an all-zero block has scale 0
    ours = head.project(hidden)
    reference = _q8_0_reference(tiny_gguf, hidden)
    assert ours.shape == reference.shape
    np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-5 * np.abs(reference).max())


def test_a_rows_logits_do_not_depend_on_the_rows_beside_it(tiny_gguf: Path, isa: str) -> None:
    head = _head_or_skip(tiny_gguf)
    hidden = np.random.default_rng(7).standard_normal((16, head.n_embd)).astype(np.float32)
    together = head.project(hidden)  # each tile: passes of 8 (VNNI) or 4 (AVX2) rows
    alone = np.stack([head.project(hidden[row : row + 1])[0] for row in range(16)])
    assert np.array_equal(together, alone)


def test_both_kernels_give_the_same_bits(tiny_gguf: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    hidden = np.random.default_rng(3).standard_normal((8, 64)).astype(np.float32)
    logits = []
    for name in ISAS:
        monkeypatch.setenv(ISA_VARIABLE, name)
        logits.append(_head_or_skip(tiny_gguf).project(hidden))
    assert np.array_equal(*logits)  # exact integer blocks, same float order


def test_auto_is_the_best_kernel_as_for_the_layers(tiny_gguf: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ISA_VARIABLE, raising=False)
    best = _head_or_skip(tiny_gguf).isa
    monkeypatch.setenv(ISA_VARIABLE, "auto")
    assert LmHead(tiny_gguf, threads=2, max_rows=8).isa == best


def test_a_kernel_the_cpu_lacks_is_refused(tiny_gguf: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ISA_VARIABLE, "sse2")
    with pytest.raises(Unavailable, match="BUTTER_KERNEL_ISA=sse2 is not available"):
        LmHead(tiny_gguf, threads=2, max_rows=8)


def test_too_many_rows_are_refused(tiny_gguf: Path) -> None:
    head = _head_or_skip(tiny_gguf, max_rows=4)
    with pytest.raises(ValueError, match="at most 4 rows"):
        head.project(np.zeros((5, head.n_embd), dtype=np.float32))


# ------------------------------------------------------------------ the C boundary


def _library() -> Any:
    try:
        return lmhead_module._library()
    except Unavailable as exc:
        pytest.skip(f"butter's native extension does not load here: {exc}")


def test_a_library_of_another_abi_version_is_refused(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from butter.backends import _lmhead  # type: ignore[attr-defined]

    found = int(ctypes.CDLL(_lmhead.__file__).butter_lmhead_abi_version())
    assert found == lmhead_module.ABI_VERSION  # as built: the two agree
    monkeypatch.setattr(lmhead_module, "ABI_VERSION", found + 1)  # as if lmhead.c were stale
    message = f"butter's native extension has ABI version {found}, expected {found + 1}"
    with pytest.raises(Unavailable, match=message):
        LmHead(tiny_gguf, threads=2, max_rows=8)
    backend = LlamaCppBackend(tiny_gguf, n_cells=1024, n_seq=2, n_batch=256, threads=2)
    try:  # the backend serves with llama.cpp's projection, and says why
        assert backend.model.lm_head is None
        assert backend.lm_head.startswith(f"llama.cpp ({message}")
    finally:
        backend.close()


SENTINEL = 0x5A  # what every output buffer holds before a call
GUARD = 16  # bytes past the length a call is given, which it must never write


class _TokenDataArray(ctypes.Structure):
    """llama.h's llama_token_data_array."""

    _fields_ = [("data", ctypes.c_void_p), ("size", ctypes.c_size_t),
                ("selected", ctypes.c_int64), ("sorted", ctypes.c_bool)]


def _select_first_candidate(sampler: int, array: int) -> None:
    """A sampler chain's apply that picks the first candidate."""
    ctypes.cast(array, ctypes.POINTER(_TokenDataArray)).contents.selected = 0


_select_first = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)(_select_first_candidate)


class _Kernel:
    """lmhead.c's entry points called directly on a small model. Each output buffer is
    exactly as long as the call needs plus a guard region, all of it SENTINEL; `short`
    names the one buffer (input or output) whose length is passed a byte short."""

    N_VOCAB, N_EMBD, MAX_ROWS = 20, 64, 3  # two tiles of 16 rows, the second partial
    BLOCKS = 2 * 16 * (N_EMBD // 32)  # packed blocks, the partial tile padded
    STRIDE = 2 * 16  # logits per row of `out`

    def __init__(self, lib: Any) -> None:
        self.lib = lib
        rng = np.random.default_rng(11)
        blocks = np.zeros((self.N_VOCAB, self.N_EMBD // 32, 34), dtype=np.uint8)
        scales = np.full((self.N_VOCAB, self.N_EMBD // 32, 1), 0.01, np.float16)
        blocks[..., :2] = scales.view(np.uint8)
        quants = rng.integers(-127, 128, size=(*blocks.shape[:2], 32)).astype(np.int8)
        blocks[..., 2:] = quants.view(np.uint8)
        self.blocks = blocks
        self.rows = blocks.reshape(self.N_VOCAB, -1)
        self.hidden = rng.standard_normal((self.MAX_ROWS, self.N_EMBD)).astype(np.float32)
        self.logits = rng.standard_normal((2, self.N_VOCAB)).astype(np.float32)
        self.kept: list[np.ndarray] = []  # buffers a state points into

    def _output(self, name: str, nbytes: int, short: str | None) -> tuple[np.ndarray, int]:
        array = np.full(nbytes + GUARD, SENTINEL, dtype=np.uint8)
        self.kept.append(array)
        return array, nbytes - 1 if short == name else nbytes

    @staticmethod
    def _input(name: str, array: np.ndarray, short: str | None) -> tuple[int, int]:
        return array.ctypes.data, array.nbytes - 1 if short == name else array.nbytes

    def init(self, short: str | None = None, *, isa: int | None = None
             ) -> tuple[int, list[np.ndarray]]:
        isa = self.lib.butter_lmhead_supported() if isa is None else isa
        state, length = self._output("state", self.lib.butter_lmhead_state_size(), short)
        status = self.lib.butter_lmhead_init(state.ctypes.data, length, self.N_VOCAB,
                                             self.N_EMBD, self.MAX_ROWS, 1, isa)
        return status, [state]

    def pack(self, short: str | None = None, *, state: int | None = None
             ) -> tuple[int, list[np.ndarray]]:
        state = self._state() if state is None else state
        wq, wq_bytes = self._output("wq", self.BLOCKS * 32, short)
        wd, wd_bytes = self._output("wd", self.BLOCKS * 2, short)
        wsum, wsum_bytes = self._output("wsum", self.BLOCKS * 2, short)
        status = self.lib.butter_lmhead_pack(
            state, *self._input("rows", self.rows, short), wq.ctypes.data, wq_bytes,
            wd.ctypes.data, wd_bytes, wsum.ctypes.data, wsum_bytes,
        )
        return status, [wq, wd, wsum]

    def _scratch(self, state: int, short: str | None) -> tuple[int, list[np.ndarray]]:
        out, out_bytes = self._output("out", self.MAX_ROWS * self.STRIDE * 4, short)
        xq, xq_bytes = self._output("xq", self.MAX_ROWS * self.N_EMBD, short)
        xd, xd_bytes = self._output("xd", self.MAX_ROWS * self.N_EMBD // 32 * 4, short)
        status = self.lib.butter_lmhead_set_scratch(state, out.ctypes.data, out_bytes,
                                                    xq.ctypes.data, xq_bytes,
                                                    xd.ctypes.data, xd_bytes)
        return status, [out, xq, xd]

    def set_scratch(self, short: str | None = None) -> tuple[int, list[np.ndarray]]:
        """set_scratch, then a projection: nothing may land in buffers it refused."""
        state = self._state()
        assert self.pack(state=state)[0] == OK
        status, scratch = self._scratch(state, short)
        self.lib.butter_lmhead_project(state, *self._input("x", self.hidden, None),
                                       self.MAX_ROWS, 0)
        return status, scratch

    def ready(self, *, isa: int | None = None) -> tuple[int, list[np.ndarray]]:
        """A state with its weights and scratch; the scratch buffers."""
        state = self._state(isa=isa)
        assert self.pack(state=state)[0] == OK
        status, scratch = self._scratch(state, None)
        assert status == OK
        return state, scratch

    def _state(self, *, isa: int | None = None) -> int:
        status, (state,) = self.init(isa=isa)
        assert status in (OK, DECLINED)
        return int(state.ctypes.data)

    def project(self, short: str | None = None) -> tuple[int, list[np.ndarray]]:
        state, scratch = self.ready()
        status = self.lib.butter_lmhead_project(state, *self._input("x", self.hidden, short),
                                                self.MAX_ROWS, 0)
        return status, scratch

    def counters(self, short: str | None = None) -> tuple[int, list[np.ndarray]]:
        state, _ = self.ready()
        counters, length = self._output("counters", 4 * 8, short)
        return self.lib.butter_lmhead_counters(state, counters.ctypes.data, length), [counters]

    def fill_candidates(self, short: str | None = None) -> tuple[int, list[np.ndarray]]:
        candidates, length = self._output("candidates", self.N_VOCAB * 12, short)
        status = self.lib.butter_fill_candidates(
            *self._input("logits", self.logits[0], short), self.N_VOCAB,
            candidates.ctypes.data, length,
        )
        return status, [candidates]

    def sample_rows(self, short: str | None = None) -> tuple[int, list[np.ndarray]]:
        chains = np.array([1, 2], dtype=np.uint64)  # handles only `_select_first` sees
        rows = np.array([row.ctypes.data for row in self.logits], dtype=np.uint64)
        scratch, scratch_bytes = self._output("scratch", self.N_VOCAB * 12, short)  # 1 thread
        chosen, chosen_bytes = self._output("chosen", 2 * 4, short)
        status = self.lib.butter_sample_rows(
            2, *self._input("chains", chains, short), *self._input("logits", rows, short),
            self.N_VOCAB, ctypes.cast(_select_first, ctypes.c_void_p), scratch.ctypes.data,
            scratch_bytes, 1, chosen.ctypes.data, chosen_bytes,
        )
        return status, [scratch, chosen]


@pytest.fixture
def kernel() -> _Kernel:
    return _Kernel(_library())


@pytest.mark.parametrize(("call", "buffer"), [
    ("init", "state"),
    ("pack", "rows"), ("pack", "wq"), ("pack", "wd"), ("pack", "wsum"),
    ("set_scratch", "out"), ("set_scratch", "xq"), ("set_scratch", "xd"),
    ("project", "x"),
    ("counters", "counters"),
    ("fill_candidates", "logits"), ("fill_candidates", "candidates"),
    ("sample_rows", "chains"), ("sample_rows", "logits"), ("sample_rows", "scratch"),
    ("sample_rows", "chosen"),
])
def test_a_buffer_a_byte_too_short_is_refused_and_nothing_is_written(
    kernel: _Kernel, call: str, buffer: str,
) -> None:
    if not kernel.lib.butter_lmhead_supported():
        pytest.skip("no kernel runs on this CPU: the calls that project decline")
    status, outputs = getattr(kernel, call)()  # every length exact: the call writes
    assert status == OK
    for output in outputs:
        assert (output[:-GUARD] != SENTINEL).any()
        assert (output[-GUARD:] == SENTINEL).all()  # and not a byte past its length
    status, outputs = getattr(kernel, call)(short=buffer)
    assert status == E_SHORT
    for output in outputs:
        assert (output == SENTINEL).all()


# ggml's tensor accessors, as lmhead.c calls them
_GET_NAME = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
_GET_DATA = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
_NELEMENTS = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_void_p)
_NBYTES = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_void_p)
_IS_CONTIGUOUS = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p)
_EVAL = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)


class _FinalNorm:
    """A stand-in for llama.cpp's "result_norm" node holding `hidden`, with ggml's
    accessors for it written in Python, so the eval hook runs without a graph."""

    def __init__(self, hidden: np.ndarray) -> None:
        self.name = ctypes.create_string_buffer(b"result_norm")
        self.accessors = [
            _GET_NAME(lambda tensor: ctypes.addressof(self.name)),
            _GET_DATA(lambda tensor: hidden.ctypes.data),
            _NELEMENTS(lambda tensor: hidden.size),
            _NBYTES(lambda tensor: hidden.nbytes),
            _IS_CONTIGUOUS(lambda tensor: True),
        ]

    def evaluate(self, lib: Any, state: int) -> tuple[bool, bool, list[int]]:
        """The hook asked for the node, shown it, and its counters after."""
        assert lib.butter_lmhead_set_ggml(state, *(ctypes.cast(accessor, ctypes.c_void_p)
                                                   for accessor in self.accessors)) == OK
        assert lib.butter_lmhead_arm(state, 1) == OK
        hook = _EVAL(("butter_lmhead_eval", lib))
        asked, shown = hook(None, True, state), hook(None, False, state)
        counters = (ctypes.c_int64 * 4)()
        assert lib.butter_lmhead_counters(state, counters, ctypes.sizeof(counters)) == OK
        return asked, shown, list(counters)


def test_the_hook_projects_the_final_norm_where_a_kernel_runs(kernel: _Kernel) -> None:
    """The control for the next test: the same harness, with a kernel that runs here."""
    if not kernel.lib.butter_lmhead_supported():
        pytest.skip("no kernel runs on this CPU")
    state, (out, _, _) = kernel.ready()
    asked, shown, counters = _FinalNorm(kernel.hidden).evaluate(kernel.lib, state)
    assert asked and not shown  # the logits are here: the graph stops
    assert counters == [1, kernel.MAX_ROWS, 1, 0]  # armed, rows_done, calls, declined
    logits = out[: -GUARD].view(np.float32).reshape(kernel.MAX_ROWS, kernel.STRIDE)
    reference = _reference(kernel.blocks, kernel.hidden)
    np.testing.assert_allclose(logits[:, : kernel.N_VOCAB], reference, rtol=0,
                               atol=1e-5 * np.abs(reference).max())


@pytest.mark.parametrize("past_the_best", [False, True], ids=["none", "past-the-best"])
def test_the_hook_declines_where_no_kernel_runs(kernel: _Kernel, past_the_best: bool) -> None:
    """ISA none, or one past what this CPU runs (a kernel it lacks, or none that exists):
    the library sets the state up but declines, and computes nothing."""
    isa = kernel.lib.butter_lmhead_supported() + 1 if past_the_best else ISA_NONE
    assert kernel.init(isa=isa)[0] == DECLINED
    state, scratch = kernel.ready(isa=isa)
    asked, shown, counters = _FinalNorm(kernel.hidden).evaluate(kernel.lib, state)
    assert asked and shown  # it looked, then let the graph run on: llama.cpp projects
    assert counters == [1, 0, 1, 1]  # armed, no rows done, one call, declined
    status = kernel.lib.butter_lmhead_project(state, kernel.hidden.ctypes.data,
                                              kernel.hidden.nbytes, kernel.MAX_ROWS, 0)
    assert status == DECLINED
    for buffer in scratch:
        assert (buffer == SENTINEL).all()


def test_no_kernel_leaves_the_logits_to_llama_cpp(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    _library()  # (skips where the extension is not built)
    monkeypatch.setenv(ISA_VARIABLE, "none")
    message = f"{ISA_VARIABLE}=none: the kernel declined, as asked"
    with pytest.raises(Unavailable, match=message):
        LmHead(tiny_gguf, threads=2, max_rows=8)
    backend = LlamaCppBackend(tiny_gguf, n_cells=1024, n_seq=2, n_batch=256, threads=2)
    try:
        assert backend.model.lm_head is None and backend.lm_head == f"llama.cpp ({message})"
    finally:
        backend.close()


def test_python_raises_on_a_short_buffer_and_nothing_is_written(tiny_gguf: Path) -> None:
    head = _head_or_skip(tiny_gguf)
    record = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
    memory = np.full((head.n_vocab + 4) * record.itemsize, SENTINEL, dtype=np.uint8)
    candidates = memory[: (head.n_vocab - 1) * record.itemsize].view(record)  # a row short
    with pytest.raises(NativeError, match="butter_fill_candidates failed: a buffer is too short"):
        head.fill_candidates(head.row(0), candidates)
    assert (memory == SENTINEL).all()


# ------------------------------------------------------------------ inside llama.cpp


@pytest.fixture(scope="module")
def demo_pair(demo_gguf: Path) -> Iterator[tuple[LlamaCppBackend, LlamaCppBackend]]:
    ours, theirs = _backend(demo_gguf, fast=True), _backend(demo_gguf, fast=False)
    yield ours, theirs
    ours.close()
    theirs.close()


def test_demo_model_logits_and_greedy_tokens_match_llama_cpp(
    demo_pair: tuple[LlamaCppBackend, LlamaCppBackend],
) -> None:
    ours, theirs = demo_pair
    assert ours.lm_head.startswith("butter") and theirs.lm_head.startswith("llama.cpp")
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,",
               "1, 2, 3, 4,"]
    our_tokens, our_logits = generate_greedy(ours, prompts, steps=24)
    their_tokens, their_logits = generate_greedy(theirs, prompts, steps=24)
    assert ours.stepper.ours and not theirs.stepper.ours  # whose logits each one sampled
    scale = np.abs(their_logits).max()
    np.testing.assert_allclose(our_logits, their_logits, rtol=0, atol=1e-4 * scale)
    assert our_tokens == their_tokens


def test_the_avx2_kernel_serves_a_backend(tiny_gguf: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    theirs = _backend(tiny_gguf, fast=False)
    reference, their_logits = generate_greedy(theirs, ["Session 2 talks about boats"], steps=8)
    theirs.close()
    monkeypatch.setenv(ISA_VARIABLE, "avx2")
    ours = _backend(tiny_gguf, fast=True)
    try:
        assert ours.lm_head == "butter (AVX2)"
        tokens, our_logits = generate_greedy(ours, ["Session 2 talks about boats"], steps=8)
        assert tokens == reference and ours.stepper.ours
        scale = np.abs(their_logits).max()
        np.testing.assert_allclose(our_logits, their_logits, rtol=0, atol=1e-4 * scale)
    finally:
        ours.close()


def test_a_failed_self_check_leaves_the_logits_to_llama_cpp(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    _head_or_skip(tiny_gguf)  # (only meaningful where the projection applies)
    monkeypatch.setattr(llama_loading, "LM_HEAD_TOLERANCE", -1.0)  # nothing can pass
    backend = _backend(tiny_gguf, fast=False)
    reference, _ = generate_greedy(backend, ["Session 1 talks about boats"], steps=8)
    backend.close()
    backend = LlamaCppBackend(tiny_gguf, n_cells=1024, n_seq=4, n_batch=256, threads=2)
    try:
        assert backend.model.lm_head is None
        assert backend.lm_head.startswith("llama.cpp (self-check failed: its logits differ")
        tokens, _ = generate_greedy(backend, ["Session 1 talks about boats"], steps=8)
        assert tokens == reference and not backend.stepper.ours
    finally:
        backend.close()


def _head_logits(path: Path) -> tuple[LlamaCppBackend, np.ndarray, np.ndarray]:
    """A backend on `path` with butter's projection, and one probe's logits both ways."""
    theirs = _backend(path, fast=False)
    _, their_logits = generate_greedy(theirs, ["Session 3 talks about boats"], steps=2)
    theirs.close()
    ours = _backend(path, fast=True)
    _, our_logits = generate_greedy(ours, ["Session 3 talks about boats"], steps=2)
    return ours, our_logits, their_logits


@pytest.mark.parametrize("kind", ["F32", "F16"])
def test_an_output_matrix_of_another_type_is_requantized_to_q8_0(tmp_path: Path, kind: str) -> None:
    # (a Q6_K output, as llama.cpp's Q4_K_M files have, is read in its own bytes by both
    # kernels: test_a_q6_k_output_matrix_is_read_in_its_own_bytes)
    f16 = kind == "F16"
    path = write_tiny_qwen3_gguf(tmp_path / "float.gguf", quantize=f16, f16_output=f16)
    ours, our_logits, their_logits = _head_logits(path)
    try:
        assert ours.lm_head.endswith(f"; {kind} output requantized to Q8_0)")
        assert not ours.model.lm_head.exact and ours.stepper.ours
        error = llama_loading.relative_rms_error(our_logits, their_logits)
        # Both sides' rounding (~1%); a wrong layout would be ~100%.
        assert 0 < error < llama_loading.REQUANTIZED_TOLERANCE
    finally:
        ours.close()


def test_a_q6_k_output_matrix_is_read_in_its_own_bytes(tiny_q4_k_m_gguf: Path) -> None:
    """Under either kernel (VNNI or AVX2) a Q6_K output matrix (Q4_K_M files) is not
    requantized: the logits are llama.cpp's Q6_K arithmetic, to float rounding."""
    ours, our_logits, their_logits = _head_logits(tiny_q4_k_m_gguf)
    try:
        head = ours.model.lm_head
        assert head is not None
        assert ours.lm_head == f"butter ({head.isa}; Q6_K output)"
        assert head.exact and ours.stepper.ours
        scale = np.abs(their_logits).max()
        np.testing.assert_allclose(our_logits, their_logits, rtol=0, atol=1e-5 * scale)
    finally:
        ours.close()


def _ggml_quantized(floats: np.ndarray, ggml_type: int) -> np.ndarray:
    """`floats` quantized by ggml itself (rows of a multiple of the type's block)."""
    ggml = lmhead_module._ggml_base()
    ggml.ggml_row_size.argtypes, ggml.ggml_row_size.restype = [ctypes.c_int,
                                                                ctypes.c_int64], ctypes.c_size_t
    rows, width = floats.shape
    out = np.zeros((rows, ggml.ggml_row_size(ggml_type, width)), dtype=np.uint8)
    quantize = ggml.ggml_quantize_chunk
    quantize.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                         ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    quantize.restype = ctypes.c_size_t
    floats = np.ascontiguousarray(floats, dtype=np.float32)
    written = quantize(ggml_type, floats.ctypes.data, out.ctypes.data, 0, rows, width, None)
    assert written == out.nbytes
    return out


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q6_K, gguf.GGMLQuantizationType.Q5_K,
                                   gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.F16,
                                   gguf.GGMLQuantizationType.Q4_0],
                         ids=lambda qtype: qtype.name)
def test_requantization_is_the_files_weights_rounded_to_q8_0(qtype: gguf.GGMLQuantizationType,
                                                             ) -> None:
    """ggml's dequantizer, reached through its type traits, agrees with the gguf package's
    independent one; the Q8_0 it then writes is the reference Q8_0 of those weights."""
    rng = np.random.default_rng(7)
    floats = rng.normal(0, 0.02, (40, 512)).astype(np.float32)
    if qtype == gguf.GGMLQuantizationType.F16:
        raw = floats.astype(np.float16).view(np.uint8)
    else:
        raw = _ggml_quantized(floats, int(qtype))
    weights = gguf.quants.dequantize(raw, qtype).reshape(40, 512)
    expected = gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q8_0)
    ours = lmhead_module._requantized_q8_0(lmhead_module._ggml_base(), raw, int(qtype), 40, 512)
    np.testing.assert_array_equal(ours, expected)


def test_an_output_type_butter_cannot_requantize_is_left_to_llama_cpp(tmp_path: Path) -> None:
    path = tmp_path / "i8.gguf"
    writer = gguf.GGUFWriter(path, arch="qwen3")
    writer.add_tensor("output.weight", np.zeros((8, 64), dtype=np.int8),
                      raw_dtype=gguf.GGMLQuantizationType.I8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(Unavailable, match=r"output.weight is ggml type 24, which butter "
                                          r"cannot requantize"):
        lmhead_module._output_matrix(path)


def test_weights_of_minus_128_count_as_minus_128(
    tiny_gguf: Path, isa: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Quantizers never write -128, but Q8_0 allows it; ggml's kernels handle it."""
    rng = np.random.default_rng(5)
    n_vocab, n_embd = 40, 64
    blocks = np.zeros((n_vocab, n_embd // 32, 34), dtype=np.uint8)
    blocks[..., :2] = np.full((n_vocab, n_embd // 32), 0.01, np.float16)[..., None].view(np.uint8)
    quants = rng.integers(-128, 128, size=(n_vocab, n_embd // 32, 32)).astype(np.int8)
    quants[:5] = -128  # whole rows of the extreme value
    blocks[..., 2:] = quants.view(np.uint8)
    rows = blocks.reshape(n_vocab, -1)
    monkeypatch.setattr(lmhead_module, "_output_matrix",
                        lambda path: (rows, lmhead_module.Q8_0, n_vocab, n_embd))
    head = _head_or_skip(tiny_gguf)
    hidden = rng.standard_normal((3, n_embd)).astype(np.float32)
    reference = _reference(blocks, hidden)
    np.testing.assert_allclose(head.project(hidden), reference, rtol=0,
                               atol=1e-5 * np.abs(reference).max())


def test_a_step_with_more_output_rows_than_the_hook_holds_uses_llama_cpp(
    tiny_gguf: Path,
) -> None:
    backend = _backend(tiny_gguf, fast=True, n_seq=1)
    try:
        # the hook holds a verifying step's rows (BUTTER_EXACT_ROWS)
        assert backend.model.lm_head is not None
        assert backend.model.lm_head.rows == BUTTER_EXACT_ROWS
        text = "Session 1 talks about boats, the harbour and the people who sail them at dawn"
        prompt = tuple(backend.tokenize(text, add_bos=False))
        outputs = BUTTER_EXACT_ROWS + 4  # rows with logits
        assert len(prompt) >= outputs
        backend.step([SetSampler(0, SamplingParams(temperature=0))], [])
        work = SeqWork(0, prompt, 0, sample=True, prompt=True)
        sampled = backend.stepper.decode([work], outputs=outputs)
        assert backend.model.batch.n_tokens >= outputs and not backend.stepper.ours
        assert sampled[0].token == int(np.argmax(backend.step_logits(len(prompt) - 1)))
        # The next step fits again, and butter's projection takes it.
        backend.step([], [SeqWork(0, (sampled[0].token,), len(prompt), sample=True)])
        assert backend.stepper.ours
    finally:
        backend.close()


def test_a_step_split_into_micro_batches_is_evaluated_again_by_llama_cpp(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """butter's logits of a split step may be out of order: they must never be sampled."""
    create = llama_backend.ll.llama_init_from_model

    def micro_batches_of_8(model: object, params: Any) -> Any:
        params.n_ubatch = 8  # llama.cpp then evaluates a 13-row step in two micro-batches
        return create(model, params)

    monkeypatch.setattr(llama_backend.ll, "llama_init_from_model", micro_batches_of_8)
    prompts = ["Session 4 talks about boats", "Session 5 likes the sea"]
    theirs = _backend(tiny_gguf, fast=False)
    reference, _ = generate_greedy(theirs, prompts, steps=4)
    theirs.close()
    backend = _backend(tiny_gguf, fast=True)
    try:
        tokens, _ = generate_greedy(backend, prompts, steps=4)
        assert backend.lm_head_redos == 1  # the prompt step; decode steps have 2 rows
        assert tokens == reference
    finally:
        backend.close()


def test_a_closed_backend_refuses_steps_and_closes_once(tiny_gguf: Path) -> None:
    backend = _backend(tiny_gguf, fast=False)
    backend.close()
    backend.close()  # a no-op
    with pytest.raises(BackendError, match="unloaded"):
        backend.step([], [SeqWork(0, (1,), 0, sample=True)])


def test_every_evaluation_runs_on_one_thread_whoever_calls(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """llama.cpp's OpenMP teams are per calling thread (docs/design/threads.md)."""
    decoding_threads: set[str] = set()
    decode = llama_backend.ll.llama_decode

    def recording_decode(ctx: object, batch: object) -> int:
        decoding_threads.add(threading.current_thread().name)
        return int(decode(ctx, batch))

    monkeypatch.setattr(llama_backend.ll, "llama_decode", recording_decode)
    backend = LlamaCppBackend(tiny_gguf, n_cells=1024, n_seq=2, n_batch=256, threads=2)
    try:
        prompt = tuple(backend.tokenize("Session 3 talks about boats", add_bos=False))
        ops = [SetSampler(0, SamplingParams(temperature=0))]
        callers = [
            threading.Thread(target=backend.step, args=(ops, [SeqWork(0, prompt, 0, True, True)])),
            threading.Thread(target=backend.step, args=([RemoveTokens(0, 0)], [])),
            threading.Thread(target=backend.step, args=([], [SeqWork(0, prompt, 0, True, True)])),
        ]
        for caller in callers:  # one after another, each from a new thread
            caller.start()
            caller.join()
        assert len(decoding_threads) == 1
        assert decoding_threads.pop().startswith("butter-llama")
    finally:
        backend.close()


@pytest.mark.parametrize("flags", [[], ["--no-fast-lm-head"]])
def test_the_flag_reaches_the_loaded_backend(tiny_gguf: Path, flags: list[str]) -> None:
    _head_or_skip(tiny_gguf)  # (only meaningful where the projection applies)
    args = build_parser().parse_args(["serve", "--model", str(tiny_gguf), *flags])
    resident = ResidentModel.load_sync(settings_from_args(args))
    try:
        assert isinstance(resident.backend, LlamaCppBackend)
        shown = resident.metadata()["lm_head"]  # what /v1/server shows
        assert shown is not None and shown["by"] == resident.backend.lm_head
        if flags:
            assert resident.backend.model.lm_head is None
            assert shown["by"] == "llama.cpp (--no-fast-lm-head)"
        else:  # on by default wherever the kernel applies to this model
            assert resident.backend.model.lm_head is not None
            assert shown["by"] == f"butter ({resident.backend.model.lm_head.isa})"
    finally:
        resident.close()
