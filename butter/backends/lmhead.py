"""butter's own output projection for llama.cpp models (the kernel is butter/native/lmhead.c).

On a small model the output projection dominates a decode step (the demo Gemma 3 270M:
a 262k-token vocabulary, 71% of its weights). llama.cpp computes it with generic x86
kernels; this computes the same Q8_0 arithmetic with an AVX512-VNNI layout that reuses
each weight for up to 8 rows, hooked into llama.cpp's graph evaluation (`cb_eval`) at
the final norm, so llama.cpp's own projection never runs (RESULTS.md has the numbers).

It is used where it applies and verified: an x86 CPU with AVX512-VNNI (or AVX2, a slower
kernel with the same results), the extension built, a CPU-only llama.cpp, an output
matrix in Q8_0 or in a type ggml can dequantize (F16, BF16, Q4_0..Q5_1, Q2_K..Q6_K: those
are requantized to Q8_0 at load; Q4_K_M files store it as Q6_K), no logit soft-capping;
and at load, one probe prompt's logits must agree with llama.cpp's own. Anywhere else
llama.cpp computes the logits as before, and the backend's `lm_head` says why.

The boundary with C is checked, since ctypes checks nothing: the library must report the
ABI version this module was written for; the kernel's state is opaque here (allocated at
the size the library reports, read and written only through its functions); every buffer
goes with its size in bytes, and the library refuses one too short instead of writing past
it; and where no kernel runs on the CPU the library declines rather than computes.
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

from butter.backends import native
from butter.backends.gguf_tensors import GgufFormatError, read_header
from butter.backends.native import Unavailable

log = logging.getLogger(__name__)

QK = 32  # elements per Q8_0 block
LANES = 16  # vocabulary rows per tile (butter/native/lmhead.c)
Q8_0 = 8  # GGML_TYPE_Q8_0
Q8_0_BLOCK_BYTES = 34  # fp16 scale + 32 int8
OUTPUT_TENSORS = ("output.weight", "token_embd.weight")  # untied first, else tied

_P, _I32, _I64, _SIZE = native.P, native.I32, native.I64, native.SIZE

# The signatures below, the status codes and the ISA numbers are what this module and
# lmhead.c agree on; BUTTER_LMHEAD_ABI_VERSION there names them. Change both together.
ABI_VERSION = 5
_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "butter_lmhead_supported": (_I32, []),
    "butter_lmhead_state_size": (_SIZE, []),
    "butter_lmhead_init": (_I32, [_P, _SIZE, _I64, _I64, _I64, _I32, _I32]),
    "butter_lmhead_set_ggml": (_I32, [_P, _P, _P, _P, _P, _P]),
    "butter_lmhead_pack": (_I32, [_P, _P, _SIZE, _P, _SIZE, _P, _SIZE, _P, _SIZE]),
    "butter_lmhead_pack_q6_k": (_I32, [_P, _P, _SIZE, _P, _SIZE, _P, _P, _SIZE]),
    "butter_lmhead_set_scratch": (_I32, [_P, _P, _SIZE, _P, _SIZE, _P, _SIZE]),
    "butter_lmhead_arm": (_I32, [_P, _I32]),
    "butter_lmhead_set_threads": (_I32, [_P, _I32]),
    "butter_lmhead_counters": (_I32, [_P, _P, _SIZE]),
    "butter_lmhead_project": (_I32, [_P, _P, _SIZE, _I64, _I64]),
    "butter_fill_candidates": (_I32, [_P, _SIZE, _I32, _P, _SIZE]),
    "butter_sample_rows": (
        _I32, [_I32, _P, _SIZE, _P, _SIZE, _I32, _P, _P, _SIZE, _I32, _P, _SIZE],
    ),
}

# Status codes (BUTTER_* in lmhead.c).
OK = 0
DECLINED = 1  # no kernel for this CPU: llama.cpp's projection applies
E_SHORT, E_ARGUMENT, E_STATE = -1, -2, -3
ERRORS = {
    E_SHORT: "a buffer is too short (nothing was written)",
    E_ARGUMENT: "a count, dimension or pointer is out of range",
    E_STATE: "the kernel's state is not set up for this call",
}
COUNTERS = 4  # butter_lmhead_counters: armed, rows_done, calls, declined

# The kernels in lmhead.c, by the number butter_lmhead_supported() returns (best last).
ISA_NONE = 0
ISA_AVX2, ISA_AVX512_VNNI = 1, 2
ISA_NAMES = {ISA_AVX2: "AVX2", ISA_AVX512_VNNI: "AVX512-VNNI"}
# Forces a slower kernel than the CPU's best (for tests and benchmarks/lm_head.py), or
# "none": no kernel, so the library declines and llama.cpp projects.
# The same variable limits the layer matmuls (kernels.py).
ISA_VARIABLE = "BUTTER_KERNEL_ISA"


class Verdict(Enum):
    OURS = "ours"
    LLAMA = "llama.cpp"
    NEITHER = "neither"


class NativeError(RuntimeError):
    """A call into lmhead.c returned an error code: a bug on this side of the boundary."""


def check(function: str, status: int) -> None:
    """Raise for a status other than OK: Unavailable where the kernel declined."""
    if status == OK:
        return
    if status == DECLINED:
        raise Unavailable(f"{function} declined: no kernel for this CPU")
    raise NativeError(f"{function} failed: {ERRORS.get(status, f'status {status}')}")


def _library() -> Any:
    """The kernel library, refused unless it speaks this module's ABI."""
    # (butter_lmhead_eval is not declared here: llama.cpp calls it, with ggml's signature
    # for an eval callback.)
    return native.open_extension("_lmhead", "butter_lmhead_abi_version", ABI_VERSION,
                                 _SIGNATURES)


def _requested_isa(lib: Any) -> tuple[int, str]:
    """The kernel to ask the library for, and why (for the message if it declines)."""
    wanted = os.environ.get(ISA_VARIABLE, "").strip()
    if wanted.lower() in ("", "auto"):  # (the layer kernels read it the same way: kernels.py)
        return int(lib.butter_lmhead_supported()), "this CPU has neither AVX512-VNNI nor AVX2"
    names = {"none": ISA_NONE} | {name.lower(): number for number, name in ISA_NAMES.items()}
    isa = names.get(wanted.lower())
    if isa is None:
        raise Unavailable(f"{ISA_VARIABLE}={wanted} is not available (butter's kernels: "
                          f"{', '.join(ISA_NAMES.values())}, or none)")
    if isa == ISA_NONE:
        return isa, f"{ISA_VARIABLE}={wanted}: the kernel declined, as asked"
    return isa, f"{ISA_VARIABLE}={wanted} is not available on this CPU"


def _new_state(lib: Any) -> ctypes.Array[ctypes.c_uint64]:
    """Zeroed, 8-byte aligned memory for the kernel's state, at the size it reports."""
    words = -(-int(lib.butter_lmhead_state_size()) // 8)
    return (ctypes.c_uint64 * words)()


def _ggml_cpu_quantize_q8_k() -> int:
    """ggml's quantize_row_q8_K in the libggml-cpu llama.cpp loaded."""
    address = ctypes.cast(native.loaded_library("libggml-cpu.so.0").quantize_row_q8_K, _P).value
    if not address:
        raise Unavailable("libggml-cpu has no quantize_row_q8_K")
    return address


def _ggml_base() -> Any:
    import llama_cpp  # noqa: F401  (loads llama.cpp, and with it ggml)

    return native.loaded_library("libggml-base.so.0")


# Output matrices of other types are requantized to Q8_0 once at load (ggml's own
# dequantizer, then its Q8_0 quantizer), so the one kernel serves them too. Q8_0's
# per-32 scale adds a rounding step of at most 1/254 of a block's largest weight: far
# below what the file's own 4-6 bit quantization already removed, but no longer
# llama.cpp's exact arithmetic, so these logits are checked against llama.cpp's with a
# relative tolerance (REQUANTIZED_TOLERANCE) instead of float rounding's.
F32, F16, BF16, Q6_K = 0, 1, 30, 14
QK_K = 256  # elements per K-quant block
Q6_TILE_BLOCK_BYTES = 3360  # one tile's block in butter/native/q6_k_tiles.h
Q8_K_BLOCK_BYTES = 292  # ggml's block_q8_K
# ggml type -> (name ggml gives it, elements per block, bytes per block): the types whose
# rows ggml can turn back into floats and whose layout this module knows.
REQUANTIZABLE = {
    F32: ("f32", 1, 4), F16: ("f16", 1, 2), BF16: ("bf16", 1, 2),
    2: ("q4_0", 32, 18), 3: ("q4_1", 32, 20), 6: ("q5_0", 32, 22), 7: ("q5_1", 32, 24),
    10: ("q2_K", 256, 84), 11: ("q3_K", 256, 110), 12: ("q4_K", 256, 144),
    13: ("q5_K", 256, 176), 14: ("q6_K", 256, 210),
}
REQUANTIZE_ROWS = 4096  # rows per dequantize/quantize round (16 MB of floats at 1024 wide)


class _TypeTraits(ctypes.Structure):
    """ggml.h's `struct ggml_type_traits` (public API), as far as it is read here."""

    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


_TO_FLOAT = ctypes.CFUNCTYPE(None, _P, _P, _I64)  # (const void * x, float * y, int64_t k)


def ggml_type_name(ggml_type: int) -> str:
    """A ggml type number as people read it in file listings (Q6_K, F16, ...)."""
    if ggml_type == Q8_0:
        return "Q8_0"
    known = REQUANTIZABLE.get(ggml_type)
    return known[0].upper() if known else f"ggml type {ggml_type}"


def _row_dequantizer(ggml: Any, ggml_type: int) -> Any:
    """ggml's to-float function for this type, once its traits match what this module
    assumes about the layout (a different ggml would otherwise be read as garbage)."""
    name, block, block_bytes = REQUANTIZABLE[ggml_type]
    ggml.ggml_get_type_traits.argtypes, ggml.ggml_get_type_traits.restype = [
        ctypes.c_int], ctypes.POINTER(_TypeTraits)
    traits = ggml.ggml_get_type_traits(ggml_type).contents
    found = (traits.type_name or b"").decode(), traits.blck_size, traits.type_size
    if found != (name, block, block_bytes):
        raise Unavailable(f"ggml describes type {ggml_type} as {found}, not "
                          f"{(name, block, block_bytes)}")
    if not traits.to_float:
        raise Unavailable(f"ggml has no dequantizer for {name}")
    return _TO_FLOAT(traits.to_float)


def _requantized_q8_0(
    ggml: Any, raw: npt.NDArray[np.uint8], ggml_type: int, n_vocab: int, n_embd: int,
) -> npt.NDArray[np.uint8]:
    """The output matrix as Q8_0 rows: ggml dequantizes the file's rows, then quantizes
    them to Q8_0 (ggml_quantize_chunk), a few thousand rows at a time."""
    to_float = None if ggml_type == F32 else _row_dequantizer(ggml, ggml_type)
    quantize = ggml.ggml_quantize_chunk
    quantize.argtypes = [ctypes.c_int, _P, _P, _I64, _I64, _I64, _P]
    quantize.restype = _SIZE
    row_bytes = n_embd // QK * Q8_0_BLOCK_BYTES
    q8 = np.empty((n_vocab, row_bytes), dtype=np.uint8)
    floats = np.empty((REQUANTIZE_ROWS, n_embd), dtype=np.float32)
    for start in range(0, n_vocab, REQUANTIZE_ROWS):
        rows = min(REQUANTIZE_ROWS, n_vocab - start)
        source = np.ascontiguousarray(raw[start : start + rows])
        if to_float is None:  # already floats
            floats[:rows] = source.view(np.float32).reshape(rows, n_embd)
        else:
            to_float(source.ctypes.data, floats.ctypes.data, rows * n_embd)
        written = quantize(Q8_0, floats.ctypes.data, q8[start].ctypes.data, 0, rows, n_embd, None)
        if written != rows * row_bytes:
            raise Unavailable(f"ggml_quantize_chunk wrote {written} bytes, not {rows * row_bytes}")
    return q8


def _output_matrix(path: Path) -> tuple[npt.NDArray[np.uint8], int, int, int]:
    """The output matrix's raw rows (mapped from the file), its ggml type, n_vocab and
    n_embd; Unavailable where the kernel cannot compute with it."""
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
    if tensor.ggml_type == Q8_0:
        block, block_bytes = QK, Q8_0_BLOCK_BYTES
    elif tensor.ggml_type in REQUANTIZABLE:
        _, block, block_bytes = REQUANTIZABLE[tensor.ggml_type]
    else:
        raise Unavailable(f"{name} is {ggml_type_name(tensor.ggml_type)}, which butter "
                          "cannot requantize")
    if len(tensor.shape) != 2 or tensor.shape[0] % QK or tensor.shape[0] % block:
        raise Unavailable(f"{name} has shape {tensor.shape}")
    n_embd, n_vocab = tensor.shape
    row_bytes = n_embd // block * block_bytes
    rows = np.memmap(path, dtype=np.uint8, mode="r", offset=tensor.offset,
                     shape=(n_vocab, row_bytes))
    return rows, tensor.ggml_type, n_vocab, n_embd


class LmHead:
    """Packed weights, scratch buffers and the hook's state for one llama.cpp model."""

    def __init__(self, path: Path, *, threads: int, max_rows: int) -> None:
        """Raises Unavailable when it does not apply to this model or machine."""
        self._lib = _library()
        isa, why_not = _requested_isa(self._lib)
        ggml = _ggml_base()
        raw, ggml_type, n_vocab, n_embd = _output_matrix(path)
        self.n_vocab, self.n_embd = n_vocab, n_embd
        self.source_type = ggml_type_name(ggml_type)
        # Q8_0 and Q6_K are computed as llama.cpp does, from the file's bytes; other types
        # after a requantization to Q8_0.
        native_q6_k = ggml_type == Q6_K and isa != ISA_NONE and n_embd % QK_K == 0
        self.exact = ggml_type == Q8_0 or native_q6_k
        self._threads = self._most_threads = max(1, threads)
        self.rows_asked = max_rows
        self.state = _new_state(self._lib)
        status = self._lib.butter_lmhead_init(
            self.state, ctypes.sizeof(self.state), n_vocab, n_embd, max_rows, self._threads, isa
        )
        if status == DECLINED:
            raise Unavailable(why_not)
        self._setup("butter_lmhead_init", status)
        self.isa = ISA_NAMES[isa]
        if native_q6_k:
            self._pack_q6_k(raw)
        else:
            rows = raw if self.exact else _requantized_q8_0(ggml, raw, ggml_type, n_vocab,
                                                            n_embd)
            self._pack(rows)
            del rows  # any requantized copy
        del raw  # the GGUF mapping (llama.cpp holds its own)
        self.stride = -(-n_vocab // LANES) * LANES  # logits per row in `out`, whole tiles
        self.out = np.zeros((max_rows, self.stride), dtype=np.float32)
        self._xq = np.zeros((max_rows, n_embd), dtype=np.uint8)
        self._xd = np.zeros((max_rows, n_embd // QK), dtype=np.float32)
        self._setup("butter_lmhead_set_scratch", self._lib.butter_lmhead_set_scratch(
            self.state, *_buffer(self.out), *_buffer(self._xq), *_buffer(self._xd),
        ))
        self._set_ggml(ggml)
        # (room for the most threads: the team may shrink and grow back, set_threads)
        self._sampling_scratch = np.zeros(self._threads * n_vocab * 3, dtype=np.int32)  # 12 B each
        self._counters = (ctypes.c_int64 * COUNTERS)()

    @staticmethod
    def _setup(function: str, status: int) -> None:
        """A setup call's status: any failure means the kernel cannot serve this model."""
        try:
            check(function, status)
        except NativeError as exc:
            raise Unavailable(str(exc)) from None

    def _pack(self, rows: npt.NDArray[np.uint8]) -> None:
        rows = np.ascontiguousarray(rows, dtype=np.uint8)
        blocks = -(-self.n_vocab // LANES) * LANES * (self.n_embd // QK)
        self._wq = np.empty(blocks * QK, dtype=np.int8)
        self._wd = np.empty(blocks, dtype=np.uint16)
        self._wsum = np.empty(blocks, dtype=np.int16)
        self._setup("butter_lmhead_pack", self._lib.butter_lmhead_pack(
            self.state, *_buffer(rows), *_buffer(self._wq), *_buffer(self._wd),
            *_buffer(self._wsum),
        ))

    def _pack_q6_k(self, rows: npt.NDArray[np.uint8]) -> None:
        rows = np.ascontiguousarray(rows, dtype=np.uint8)
        blocks = self.n_embd // QK_K
        self._w6 = np.empty(-(-self.n_vocab // LANES) * blocks * Q6_TILE_BLOCK_BYTES,
                            dtype=np.uint8)
        self._xk = np.zeros((self.rows_asked, blocks * Q8_K_BLOCK_BYTES), dtype=np.uint8)
        self._setup("butter_lmhead_pack_q6_k", self._lib.butter_lmhead_pack_q6_k(
            self.state, *_buffer(rows), *_buffer(self._w6), _ggml_cpu_quantize_q8_k(),
            *_buffer(self._xk),
        ))

    def _set_ggml(self, ggml: Any) -> None:
        def address(function: Any) -> int | None:
            return ctypes.cast(function, _P).value

        self._setup("butter_lmhead_set_ggml", self._lib.butter_lmhead_set_ggml(
            self.state, address(ggml.ggml_get_name), address(ggml.ggml_get_data),
            address(ggml.ggml_nelements), address(ggml.ggml_nbytes),
            address(ggml.ggml_is_contiguous),
        ))
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
        check("butter_lmhead_arm", self._lib.butter_lmhead_arm(self.state, int(armed)))

    def verdict(self, rows: int) -> Verdict:
        """Whose logits the last decode (with `rows` output rows) left usable."""
        counters = self._counters
        check("butter_lmhead_counters", self._lib.butter_lmhead_counters(
            self.state, counters, ctypes.sizeof(counters)
        ))
        armed, rows_done, calls, declined = counters
        if not armed or rows_done == 0:
            return Verdict.LLAMA  # the graph ran to its end every time
        if calls == 1 and declined == 0 and rows_done == rows:
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
        check("butter_lmhead_project", self._lib.butter_lmhead_project(
            self.state, *_buffer(hidden), len(hidden), 0
        ))
        return self.out[: len(hidden), : self.n_vocab].copy()

    def set_threads(self, threads: int) -> None:
        """Project and sample on `threads` threads from the next step on (at most the
        count it was set up with)."""
        threads = max(1, min(threads, self._most_threads))
        check("butter_lmhead_set_threads", self._lib.butter_lmhead_set_threads(self.state, threads))
        self._threads = threads

    def fill_candidates(self, logits: npt.NDArray[np.float32], candidates: Any) -> None:
        """llama.cpp sampler input {id, logit, p=0} for every token, written in C."""
        if logits.dtype != np.float32 or not logits.flags.c_contiguous:
            raise ValueError("logits must be contiguous float32")
        check("butter_fill_candidates", self._lib.butter_fill_candidates(
            *_buffer(logits), self.n_vocab, *_buffer(candidates)
        ))

    def row_address(self, ordinal: int) -> int:
        """Where the logits of the last step's `ordinal`-th output row start."""
        if not 0 <= ordinal < len(self.out):
            raise IndexError(f"output row {ordinal} of {len(self.out)}")
        return int(self.out.ctypes.data) + ordinal * self.stride * self.out.itemsize

    def sample_rows(self, chains: list[Any], logits: list[int], apply: Any) -> list[int]:
        """Each chain's pick from its row's logits (addresses of n_vocab floats each), rows
        side by side on the model's threads; `apply` is llama_sampler_apply. -1 where a
        chain picked nothing. The caller accepts the tokens (llama_sampler_accept), as
        llama_sampler_sample does."""
        count = len(chains)
        chain_array = (ctypes.c_void_p * count)(*(ctypes.cast(c, _P).value for c in chains))
        logits_array = (ctypes.c_void_p * len(logits))(*logits)
        chosen = (ctypes.c_int32 * count)()
        check("butter_sample_rows", self._lib.butter_sample_rows(
            count, chain_array, ctypes.sizeof(chain_array),
            logits_array, ctypes.sizeof(logits_array), self.n_vocab, ctypes.cast(apply, _P),
            *_buffer(self._sampling_scratch), self._threads, chosen, ctypes.sizeof(chosen),
        ))
        return list(chosen)


def _buffer(array: npt.NDArray[Any]) -> tuple[int, int]:
    """A contiguous array as C sees it: its address and its size in bytes."""
    if not array.flags.c_contiguous:
        raise ValueError("the kernel reads and writes contiguous arrays only")
    return int(array.ctypes.data), int(array.nbytes)
