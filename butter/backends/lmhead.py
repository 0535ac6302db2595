"""butter's own output projection for llama.cpp models (the kernel is butter/native/lmhead.c).

On a small model the output projection dominates a decode step (the demo Gemma 3 270M:
a 262k-token vocabulary, 71% of its weights). llama.cpp computes it with generic x86
kernels; this computes the same Q8_0 arithmetic with an AVX512-VNNI layout that reuses
each weight for up to 8 rows, hooked into llama.cpp's graph evaluation (`cb_eval`) at
the final norm, so llama.cpp's own projection never runs (RESULTS.md has the numbers).

It is used where it applies and verified: an x86 CPU with AVX512-VNNI (or AVX2, a slower
kernel with the same results), the extension built, a CPU-only llama.cpp, a Q8_0 output
matrix, no logit soft-capping; and at load, one probe prompt's logits must agree with
llama.cpp's own. Anywhere else llama.cpp computes the logits as before, and the
backend's `lm_head` says why.
"""

from __future__ import annotations

import ctypes
import logging
import os
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from butter.backends.gguf_tensors import GgufFormatError, read_header

log = logging.getLogger(__name__)

QK = 32  # elements per Q8_0 block
LANES = 16  # vocabulary rows per tile (butter/native/lmhead.c)
Q8_0 = 8  # GGML_TYPE_Q8_0
Q8_0_BLOCK_BYTES = 34  # fp16 scale + 32 int8
OUTPUT_TENSORS = ("output.weight", "token_embd.weight")  # untied first, else tied

_P = ctypes.c_void_p

# The kernels in lmhead.c, by the number butter_lmhead_supported() returns (best last).
ISA_NAMES = {1: "AVX2", 2: "AVX512-VNNI"}
# Forces a slower kernel than the CPU's best (for tests and benchmarks/lm_head.py).
ISA_VARIABLE = "BUTTER_LM_HEAD_ISA"


class _State(ctypes.Structure):
    """Mirrors `butter_lmhead` in lmhead.c, field for field."""

    _fields_ = [
        ("get_name", _P), ("get_data", _P), ("nelements", _P), ("nbytes", _P),
        ("is_contiguous", _P),
        ("wq", _P), ("wd", _P), ("wsum", _P),
        ("n_tiles", ctypes.c_int64), ("n_embd", ctypes.c_int64), ("n_vocab", ctypes.c_int64),
        ("n_threads", ctypes.c_int32),
        ("armed", ctypes.c_int32), ("max_rows", ctypes.c_int64), ("rows_done", ctypes.c_int64),
        ("out", _P), ("xq", _P), ("xd", _P),
        ("isa", ctypes.c_int32), ("calls", ctypes.c_int32), ("declined", ctypes.c_int32),
    ]


class Verdict(Enum):
    OURS = "ours"
    LLAMA = "llama.cpp"
    NEITHER = "neither"


class Unavailable(Exception):
    """Why butter's projection does not apply here (llama.cpp's is used)."""


def _native() -> tuple[Any, int]:
    """The kernel library and the instruction set to run it with."""
    try:
        from butter import _lmhead  # type: ignore[attr-defined]
    except ImportError:
        raise Unavailable("butter's native extension is not built") from None
    lib = ctypes.CDLL(_lmhead.__file__)
    best = int(lib.butter_lmhead_supported())
    if not best:
        raise Unavailable("this CPU has neither AVX512-VNNI nor AVX2")
    wanted = os.environ.get(ISA_VARIABLE)
    if wanted:
        isa = {name.lower(): number for number, name in ISA_NAMES.items()}.get(wanted.lower())
        if isa is None or isa > best:
            raise Unavailable(f"{ISA_VARIABLE}={wanted} is not available on this CPU")
    else:
        isa = best
    lib.butter_lmhead_pack.argtypes = [_P, ctypes.c_int64, ctypes.c_int64, _P, _P, _P]
    lib.butter_lmhead_pack.restype = None
    lib.butter_lmhead_project.argtypes = [_P, _P, ctypes.c_int64, ctypes.c_int64]
    lib.butter_lmhead_project.restype = None
    lib.butter_fill_candidates.argtypes = [_P, ctypes.c_int32, _P]
    lib.butter_fill_candidates.restype = None
    lib.butter_sample_rows.argtypes = [
        ctypes.c_int32, _P, _P, ctypes.c_int32, _P, _P, ctypes.c_int32, _P,
    ]
    lib.butter_sample_rows.restype = None
    return lib, isa


def _ggml_base() -> Any:
    import llama_cpp

    library = Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"
    if not library.exists():
        raise Unavailable(f"libggml-base not found at {library}")
    return ctypes.CDLL(str(library))


def _q8_0_output(path: Path) -> tuple[npt.NDArray[np.uint8], int, int]:
    """The output matrix's raw Q8_0 rows (mapped from the file), n_vocab and n_embd."""
    try:
        header = read_header(path, keys=["general.architecture"])
    except (OSError, GgufFormatError) as exc:
        raise Unavailable(f"cannot read the GGUF header: {exc}") from None
    arch = header.metadata.get("general.architecture")
    if f"{arch}.final_logit_softcapping" in header.keys:
        raise Unavailable("the model soft-caps its logits")
    name = next((n for n in OUTPUT_TENSORS if n in header.tensors), None)
    if name is None:
        raise Unavailable("no output matrix in the GGUF")
    tensor = header.tensors[name]
    if tensor.ggml_type != Q8_0:
        raise Unavailable(f"{name} is not Q8_0 (ggml type {tensor.ggml_type})")
    if len(tensor.shape) != 2 or tensor.shape[0] % QK:
        raise Unavailable(f"{name} has shape {tensor.shape}")
    n_embd, n_vocab = tensor.shape
    row_bytes = n_embd // QK * Q8_0_BLOCK_BYTES
    rows = np.memmap(path, dtype=np.uint8, mode="r", offset=tensor.offset,
                     shape=(n_vocab, row_bytes))
    return rows, n_vocab, n_embd


class LmHead:
    """Packed weights, scratch buffers and the hook's state for one llama.cpp model."""

    def __init__(self, path: Path, *, threads: int, max_rows: int) -> None:
        """Raises Unavailable when it does not apply to this model or machine."""
        self._lib, isa = _native()
        self.isa = ISA_NAMES[isa]
        ggml = _ggml_base()
        rows, n_vocab, n_embd = _q8_0_output(path)
        self.n_vocab, self.n_embd = n_vocab, n_embd
        n_tiles = -(-n_vocab // LANES)
        self.stride = n_tiles * LANES  # logits per row in `out`, padded to whole tiles
        blocks = n_tiles * LANES * (n_embd // QK)
        self._wq = np.empty(blocks * QK, dtype=np.int8)
        self._wd = np.empty(blocks, dtype=np.uint16)
        self._wsum = np.empty(blocks, dtype=np.int16)
        self._lib.butter_lmhead_pack(
            rows.ctypes.data, n_vocab, n_embd,
            self._wq.ctypes.data, self._wd.ctypes.data, self._wsum.ctypes.data,
        )
        del rows  # the GGUF mapping: llama.cpp holds its own
        self.out = np.zeros((max_rows, self.stride), dtype=np.float32)
        self._threads = max(1, threads)
        self._sampling_scratch = np.zeros(self._threads * n_vocab * 3, dtype=np.int32)  # 12 B each
        self._xq = np.zeros((max_rows, n_embd), dtype=np.uint8)
        self._xd = np.zeros((max_rows, n_embd // QK), dtype=np.float32)

        def address(function: Any) -> int | None:
            return ctypes.cast(function, _P).value

        self.state = _State(
            address(ggml.ggml_get_name), address(ggml.ggml_get_data),
            address(ggml.ggml_nelements), address(ggml.ggml_nbytes),
            address(ggml.ggml_is_contiguous),
            self._wq.ctypes.data, self._wd.ctypes.data, self._wsum.ctypes.data,
            n_tiles, n_embd, n_vocab, self._threads,
            0, max_rows, 0,
            self.out.ctypes.data, self._xq.ctypes.data, self._xd.ctypes.data,
            isa, 0, 0,
        )
        self._ggml = ggml  # keeps the accessors' library loaded

    @property
    def rows(self) -> int:
        """The most output rows one step may have for butter to project them."""
        return len(self.out)

    @property
    def callback(self) -> Any:
        """The eval hook (a C function), for llama_context_params.cb_eval."""
        return self._lib.butter_lmhead_eval

    @property
    def user_data(self) -> int:
        return ctypes.addressof(self.state)

    def arm(self, armed: bool) -> None:
        self.state.armed = int(armed)
        self.state.rows_done = self.state.calls = self.state.declined = 0

    def verdict(self, rows: int) -> Verdict:
        """Whose logits the last decode (with `rows` output rows) left usable."""
        state = self.state
        if not state.armed or state.rows_done == 0:
            return Verdict.LLAMA  # the graph ran to its end every time
        if state.calls == 1 and state.declined == 0 and state.rows_done == rows:
            return Verdict.OURS
        # Split into micro-batches (whose order may not be the batch's), or some of them
        # stopped and others not: neither buffer holds every row, in order.
        return Verdict.NEITHER

    def row(self, ordinal: int) -> npt.NDArray[np.float32]:
        """The logits of the `ordinal`-th output row of the last step (a view)."""
        return self.out[ordinal, : self.n_vocab]

    def project(self, hidden: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """Logits of these hidden states (rows of n_embd floats), outside any decode."""
        hidden = np.ascontiguousarray(hidden, dtype=np.float32)
        if hidden.ndim != 2 or hidden.shape[1] != self.n_embd:
            raise ValueError(f"expected rows of {self.n_embd} floats, got {hidden.shape}")
        if len(hidden) > len(self.out):
            raise ValueError(f"at most {len(self.out)} rows at a time")
        self._lib.butter_lmhead_project(
            ctypes.byref(self.state), hidden.ctypes.data, len(hidden), 0
        )
        return self.out[: len(hidden), : self.n_vocab].copy()

    def fill_candidates(self, logits: npt.NDArray[np.float32], candidates: Any) -> None:
        """llama.cpp sampler input {id, logit, p=0} for every token, written in C."""
        self._lib.butter_fill_candidates(logits.ctypes.data, self.n_vocab, candidates.ctypes.data)

    def row_address(self, ordinal: int) -> int:
        """Where the logits of the last step's `ordinal`-th output row start."""
        return int(self.out.ctypes.data) + ordinal * self.stride * self.out.itemsize

    def sample_rows(self, chains: list[Any], logits: list[int], apply: Any) -> list[int]:
        """Each chain's pick from its row's logits (addresses), rows side by side on the
        model's threads; `apply` is llama_sampler_apply. -1 where a chain picked nothing.
        The caller accepts the tokens (llama_sampler_accept), as llama_sampler_sample does."""
        count = len(chains)
        chain_array = (ctypes.c_void_p * count)(*(ctypes.cast(c, _P).value for c in chains))
        logits_array = (ctypes.c_void_p * count)(*logits)
        chosen = (ctypes.c_int32 * count)()
        self._lib.butter_sample_rows(
            count, chain_array, logits_array, self.n_vocab, ctypes.cast(apply, _P),
            self._sampling_scratch.ctypes.data, self._threads, chosen,
        )
        return list(chosen)
