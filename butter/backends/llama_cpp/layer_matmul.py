"""butter's layer matmuls inside llama.cpp (butter/native/layer_matmul.cpp).

With several sequences decoding at once, every layer matrix is multiplied by 2-8 rows per
step, and for Q8_0, Q6_K, Q5_K, Q4_1 and Q5_0 matrices llama.cpp's x86 code has only
generic paths for that, far below what the cores can do (and for Q4_K a repacked kernel
whose cost grows with every row: kernels.py). The native library adds a buffer
type to llama.cpp's CPU backend, the way llama.cpp's own repacked kernels plug in: at load,
a layer's plain 2-D weights of those types are stored there in butter's tile layout, and
their matmuls then run butter's kernels (AVX512-VNNI or AVX2, kernels.py's table) on
llama.cpp's own threads.
Any other weight, type or op stays with llama.cpp.

It applies where: the extension is built, the CPU has AVX2 (FMA, F16C) or AVX512-VNNI,
llama.cpp runs on the CPU, its extra buffer types are on (they are off with
`--deterministic`), and the running ggml is the one the library mirrors: its commit and
version first (ggml_abi.h names the one the mirror was copied from: another llama.cpp,
such as a newer llama-cpp-python installed for a newer model, runs on llama.cpp's own
kernels, and the log and `/v1/server` say why), then, field by field, tensors and a buffer
the running ggml made, read through the mirror. Nothing inside llama.cpp is touched before
all of these pass. Once registered, each type's kernel computes probe products through a
real ggml graph against llama.cpp's own (`self_check`); a type that disagrees stays with
llama.cpp, and `/v1/server` says why. Registration is once per process and must come
before llama.cpp first lists its buffer types, at its first model load; `register` runs
from `init_llama_backend`. Whether a given load may use it is chosen per load
(`accepting`), and the result is read back: the matrices stored there, from the library's
counters.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from array import array
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

import attrs
import llama_cpp

from butter.backends import native
from butter.backends.kernels import (
    TYPE_BITS,
    Isa,
    butter_layer_types,
    isa_number,
    isa_of,
    requested_isa,
)
from butter.backends.llama_cpp import ggml_abi as abi
from butter.backends.llama_cpp import ggml_boundary
from butter.backends.native import Unavailable

log = logging.getLogger(__name__)
T = TypeVar("T")

_P, _I32, _I64, _SIZE = native.P, native.I32, native.I64, native.SIZE

# What this module and the library agree on (butter/native/ggml_abi.h, read as ggml_abi.py).
ABI_VERSION = abi.LAYER_MATMUL_ABI_VERSION
_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "butter_layer_matmul_ggml_commit": (ctypes.c_char_p, []),
    "butter_layer_matmul_header_check": (_I32, []),
    "butter_layer_matmul_mirror": (_I32, [_P, _SIZE]),
    "butter_layer_matmul_buffer_type_name": (ctypes.c_char_p, [_P]),
    "butter_layer_matmul_best_isa": (_I32, []),
    "butter_layer_matmul_function_names": (ctypes.c_char_p, []),
    "butter_layer_matmul_bind": (_I32, [_P, _SIZE]),
    "butter_layer_matmul_check_mirror": (_I32, [_P]),
    "butter_layer_matmul_register": (_I32, [_P, _I32, _I32]),
    "butter_layer_matmul_enable_types": (_I32, [_I32]),
    "butter_layer_matmul_decode_attention": (_I32, [_I32]),
    "butter_layer_matmul_prompt_attention": (_I32, [_I32]),
    "butter_layer_matmul_attention_probe": (
        _I32, [_I32, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I32, _I64, ctypes.c_float,
               ctypes.c_float, _P, _SIZE, _P]),
    "butter_layer_matmul_self_check": (
        _I32, [_I32, _I64, _I64, _I64, _I32, ctypes.c_double, _P, _SIZE]),
    "butter_layer_matmul_buffer_type": (_P, []),
    "butter_layer_matmul_accept": (_I32, [_I32]),
    "butter_layer_matmul_counters": (_I32, [_P, _SIZE]),
    "butter_layer_matmul_drop_buffer_type": (_I32, [ctypes.c_char_p]),
    "butter_layer_matmul_delta_net_widths": (_I32, []),
    "butter_layer_matmul_delta_net": (_I32, [_I32]),
    "butter_layer_matmul_delta_net_probe": (
        _I32, [_I32, _I64, _I64, _I64, _I64, _I64, _I32, _I32, _I64, _P, _SIZE, _P]),
    "butter_layer_matmul_short_conv": (_I32, [_I32, _I32]),
    "butter_layer_matmul_quantize_q8_k": (_I32, [_P, _I64, _P, _SIZE]),
    "butter_layer_matmul_conv_probe": (
        _I32, [_I32, _I32, _I64, _I64, _I64, _I64, _I32, _I64, _P, _SIZE, _P]),
}
OK, DECLINED = abi.OK, abi.DECLINED
COUNTERS = abi.COUNTERS
MIRRORED = abi.MIRRORED
ISA_VARIABLE = "BUTTER_KERNEL_ISA"  # (shared with the output projection: lmhead.py)
# The self-check's probe products, one per shape class a model's matmuls fall in: one row
# (a single stream), a partial pass of the AVX2 kernel (5 = 4 + 1), a whole pass of 8; n
# is 2 whole tiles and half of one (a matrix's last tile may be partial), k two K-quant
# blocks. Each compares butter's kernel with llama.cpp's on 2 threads.
# Rows 1, 5 and 8 as a decode step meets them, and 21 as a prompt step does (2 passes of 8
# and one of 5; from 16 rows the AVX2 kernels read Q5_K and Q6_K values unpacked).
SELF_CHECK_SHAPES = ((512, 40, 1), (512, 40, 5), (512, 40, 8), (512, 40, 21))
SELF_CHECK_THREADS = 2
# Both compute the same integer block products; only the float sums over blocks differ in
# order, so the largest difference is float rounding of the largest value.
SELF_CHECK_TOLERANCE = 1e-4
SELF_CHECK_PERTURBATION = 0.0  # tests set it: a wrong kernel result must fail the check


@attrs.frozen
class Counters:
    q8_0_matrices: int
    q6_k_matrices: int
    q5_k_matrices: int
    packed_bytes: int
    matmuls: int
    rows: int
    q4_1_matrices: int
    q5_0_matrices: int
    q4_k_matrices: int
    attentions: int  # flash attentions butter computed (decode_attention.h)
    attention_rows: int  # and their query rows
    delta_nets: int  # Gated DeltaNet ops butter computed (delta_net.cpp)
    short_convs: int  # and short convolutions (SSM_CONV ops)

    @property
    def matrices(self) -> int:
        return sum(self.by_type().values())

    def by_type(self) -> dict[str, int]:
        """Matrices stored, by ggml's type name."""
        return {"q8_0": self.q8_0_matrices, "q6_K": self.q6_k_matrices,
                "q5_K": self.q5_k_matrices, "q4_1": self.q4_1_matrices,
                "q5_0": self.q5_0_matrices, "q4_K": self.q4_k_matrices}


class LayerMatmul:
    """The registered library: choose per load whether the layer weights of its types may go
    there, and read what it has done."""

    def __init__(self, lib: Any, isa: Isa, types: dict[str, str]) -> None:
        self._lib = lib
        self.isa = isa
        # each type butter has a kernel for on this ISA: "butter", or "llama.cpp (why)"
        self.types = types
        self._loading = threading.Lock()  # `accepting` is process-wide in the library
        # who computes decode steps' attention: "butter", or "llama.cpp (why)"
        self.attention = "llama.cpp (not checked yet)"
        # who computes the Gated DeltaNet layers' recurrence (Qwen3.5 and kin): "butter
        # (AVX-512)" / "butter (AVX2)", or "llama.cpp (why)"
        self.delta_net = "llama.cpp (not checked yet)"
        # and the short convolution before each recurrent layer (SSM_CONV), and how it
        # rounds (use_short_conv's `rounding`)
        self.short_conv = "llama.cpp (not checked yet)"
        self.conv_rounding = 0

    def counters(self) -> Counters:
        out = (ctypes.c_int64 * COUNTERS)()
        if self._lib.butter_layer_matmul_counters(out, ctypes.sizeof(out)) != OK:
            raise RuntimeError("butter_layer_matmul_counters refused its buffer")
        return Counters(
            q8_0_matrices=out[abi.COUNTER_Q8_0_MATRICES],
            q6_k_matrices=out[abi.COUNTER_Q6_K_MATRICES],
            q5_k_matrices=out[abi.COUNTER_Q5_K_MATRICES],
            packed_bytes=out[abi.COUNTER_PACKED_BYTES], matmuls=out[abi.COUNTER_MATMULS],
            rows=out[abi.COUNTER_ROWS], q4_1_matrices=out[abi.COUNTER_Q4_1_MATRICES],
            q5_0_matrices=out[abi.COUNTER_Q5_0_MATRICES],
            q4_k_matrices=out[abi.COUNTER_Q4_K_MATRICES],
            attentions=out[abi.COUNTER_ATTENTIONS],
            attention_rows=out[abi.COUNTER_ATTENTION_ROWS],
            delta_nets=out[abi.COUNTER_DELTA_NETS],
            short_convs=out[abi.COUNTER_SHORT_CONVS])

    def decode_attention(self, on: bool) -> None:
        """Whether butter computes the attention of steps of fewer than 64 query rows over an
        f16 or f32 cache (butter/native/decode_attention.h): each row over its cells in fixed
        chunks, so that it does not depend on the other rows of the step, the thread count or
        the cache's size. On from registration where the probes agree with llama.cpp's (a
        decode row verified beside drafts, or beside other requests, is then the lone row it
        stands for: docs/design/speculation.md, "Speculative decoding"). Takes effect from the next
        step; change it only between steps."""
        self._lib.butter_layer_matmul_decode_attention(int(on))

    def prompt_attention(self, on: bool) -> None:
        """Whether butter computes the attention of steps of 64 query rows or more too
        (butter/native/prompt_attention.h): tiles of rows sharing each key's load, each row's
        bits those decode_attention gives it alone, so that a prompt's result does not
        depend on the prompts prefilled beside it, the chunk it fell in, or where its cells
        lie. Takes effect from the next step; change it only between steps."""
        self._lib.butter_layer_matmul_prompt_attention(int(on))

    def attention_probe(self, *, butter: bool, rows: int, cells: int, heads: int,
                        kv_heads: int, dim: int, threads: int, seed: int,
                        view: int | None = None, placement: int = 0, max_bias: float = 0.0,
                        softcap: float = 0.0) -> list[float]:
        """One flash attention through a real ggml graph (butter_layer_matmul_attention_probe:
        probe values, a mask that hides every fifth cell), computed by butter's decode
        attention or by llama.cpp's: the rows x heads x dim results. The cells lie in a
        cache view of `view` slots (default: just them), in order (`placement` 0) or
        scattered in an order that `placement` draws. `max_bias` (ALiBi; the mask then
        holds a distance term for each seen cell) and `softcap` are the op's parameters.
        Raises Unavailable if butter's was asked for and llama.cpp computed it."""
        out = (ctypes.c_float * (rows * heads * dim))()
        ran = ctypes.c_int32()
        status = self._lib.butter_layer_matmul_attention_probe(
            int(butter), rows, cells, cells if view is None else view, placement, heads,
            kv_heads, dim, threads, seed, max_bias, softcap, out, ctypes.sizeof(out),
            ctypes.byref(ran))
        return _probe_output(status, butter and not ran.value, out, "decode attention")

    def delta_net_widths(self) -> list[int]:
        """The vector widths (floats: 16 for AVX-512, 8 for AVX2) at which this CPU can
        compute ggml's Gated DeltaNet op as butter/native/delta_net.cpp does, widest first."""
        mask = int(self._lib.butter_layer_matmul_delta_net_widths())
        return [width for width in (16, 8) if mask & width]

    def use_delta_net(self, width: int) -> None:
        """Whether butter computes the Gated DeltaNet layers' recurrence (ggml's
        GATED_DELTA_NET op: each state row held in registers through a whole step, with
        llama.cpp's bits) at `width`, or llama.cpp does (0). Takes effect from the next step;
        change it only between steps."""
        status = self._lib.butter_layer_matmul_delta_net(width)
        if status != OK:
            raise ValueError(f"no Gated DeltaNet kernel of width {width} (status {status})")

    def delta_net_probe(self, *, width: int, tokens: int, heads: int, dim: int, seqs: int = 1,
                        snapshots: int = 1, per_column: bool = False, threads: int = 2,
                        seed: int = 3) -> list[float]:
        """One Gated DeltaNet op through a real ggml graph (butter_layer_matmul_delta_net_probe:
        probe values, decaying gates), computed by butter at `width` or by llama.cpp (0): its
        whole result, the outputs and then the `snapshots` last states. Raises Unavailable if
        butter's was asked for and llama.cpp computed it."""
        out = (ctypes.c_float * ((tokens + snapshots * dim) * seqs * heads * dim))()
        ran = ctypes.c_int32()
        status = self._lib.butter_layer_matmul_delta_net_probe(
            width, tokens, heads, dim, seqs, snapshots, int(per_column), threads, seed, out,
            ctypes.sizeof(out), ctypes.byref(ran))
        return _probe_output(status, bool(width) and not ran.value, out, "Gated DeltaNet")

    def use_short_conv(self, lanes: int, rounding: int = 0) -> None:
        """Whether butter computes the short convolutions before recurrent layers (ggml's
        SSM_CONV op, and the CONCATs feeding it: square tiles of `lanes` channels x tokens,
        one of delta_net_widths()), or llama.cpp does (0). `rounding` is how llama.cpp's
        build sums each output: 0, one FMA per weight; 4, the products of the leading
        multiple of 4 weights rounded and then added in order (GCC's vectorized loop), the
        rest fused. Takes effect from the next step; change it only between steps."""
        status = self._lib.butter_layer_matmul_short_conv(lanes, rounding)
        if status != OK:
            raise ValueError(f"no short convolution of {lanes} lanes and rounding {rounding} "
                             f"here (status {status})")
        self.conv_rounding = rounding

    def conv_probe(self, *, lanes: int, tokens: int, channels: int, width: int = 4,
                   rounding: int = 0, seqs: int = 1, threads: int = 2,
                   seed: int = 7) -> list[float]:
        """One short convolution (ggml's SSM_CONV) of `width` weights a channel through a
        real ggml graph, by butter at `lanes` and `rounding` (as use_short_conv takes them)
        or by llama.cpp (lanes 0): channels x tokens x seqs outputs of probe values. Raises
        Unavailable if butter's was asked for and llama.cpp computed it."""
        out = (ctypes.c_float * (tokens * channels * seqs))()
        ran = ctypes.c_int32()
        status = self._lib.butter_layer_matmul_conv_probe(
            lanes, rounding, tokens, channels, width, seqs, threads, seed, out,
            ctypes.sizeof(out), ctypes.byref(ran))
        return _probe_output(status, bool(lanes) and not ran.value, out, "short convolution")

    @contextmanager
    def accepting(self, accept: bool) -> Iterator[None]:
        """While loading a model: whether its layers' weights of butter's types may be stored in
        butter's layout."""
        with self._loading:
            self._lib.butter_layer_matmul_accept(int(accept))
            try:
                yield
            finally:
                self._lib.butter_layer_matmul_accept(0)


def _probe_output(status: int, not_butters: bool, out: Any, what: str) -> list[float]:
    """A probe's floats; ValueError if it could not run, Unavailable if butter's `what`
    was asked for and llama.cpp computed it."""
    if status != OK:
        raise ValueError(f"the {what} probe could not run (status {status})")
    if not_butters:
        raise Unavailable(f"llama.cpp did not call butter's {what}")
    return list(out)


_registering = threading.Lock()
_registered: LayerMatmul | None = None
_why_not: str | None = None

# llama.cpp's AMX buffer type (CPUs with AMX-INT8, Sapphire Rapids on, in a build for such a
# CPU): at the llama.cpp commit butter links, a decode with weights stored there crashes the
# process (SIGSEGV in ggml_backend_amx_mul_mat, llama-cpp-python alone included, while the
# CPU runs AMX tiles fine). Weights go to the repacked layouts instead, as on AVX512 CPUs.
#
# Taking it out of llama.cpp's list is surgery on a std::vector inside llama.cpp, so it runs
# only where butter's kernels register: after the ggml commit and every mirror check passed
# (`_register`). With BUTTER_KERNEL_ISA=none, or on another ggml, butter touches nothing
# inside llama.cpp, and the AMX type stays listed; loading.py then turns llama.cpp's weight
# repacking (the extra buffer types, AMX among them) off and says so in the log, which is as
# safe and only slower. Decided so that "none" means butter's native code stays out of
# llama.cpp entirely (the way to tell a butter bug from a llama.cpp one), and that on a
# ggml butter does not know it neither writes into it nor guesses where its crash is fixed.
CRASHING_BUFFER_TYPES = (b"AMX",)
dropped_buffer_types: list[str] = []  # what `register` took out of llama.cpp's list


def register() -> None:
    """Add butter's buffer type to llama.cpp's CPU backend, once per process, where it
    applies (see the module docstring); else remember why not. Call before any model load."""
    global _registered, _why_not
    with _registering:
        if _registered is not None or _why_not is not None:
            return
        try:
            _registered = _register()
        except Unavailable as exc:
            _why_not = str(exc)
        except Exception as exc:  # a library that will not load: serve without it
            log.warning("butter's layer matmuls failed to register: %r", exc)
            _why_not = f"failed to register: {exc!r}"


def registered() -> LayerMatmul:
    """The registered library, or Unavailable with the reason it is not."""
    if _registered is None:
        raise Unavailable(_why_not or "not registered (init_llama_backend was not called)")
    return _registered


def _library() -> Any:
    return native.open_extension("_layer_matmul", "butter_layer_matmul_abi_version",
                                 ABI_VERSION, _SIGNATURES)


def self_check(lib: Any, ggml_type: int, *, perturbation: float) -> str:
    """"" if butter's kernel for this type gives llama.cpp's products on every probe shape,
    else why not."""
    for k, n, rows in SELF_CHECK_SHAPES:
        out = (ctypes.c_double * 3)()
        status = lib.butter_layer_matmul_self_check(
            ggml_type, k, n, rows, SELF_CHECK_THREADS, perturbation, out, ctypes.sizeof(out))
        if status != OK:
            return f"self-check could not run (status {status})"
        worst, largest, ran = float(out[0]), float(out[1]), bool(out[2])
        if not ran:
            return "self-check: llama.cpp did not call butter's kernel"
        if not worst <= SELF_CHECK_TOLERANCE * max(largest, 1e-30):
            return (f"self-check failed: {rows} x {k} by {n} differs from llama.cpp's by "
                    f"{worst:.3g} (largest value {largest:.3g})")
    return ""


def _self_checked_types(lib: Any, isa: Isa) -> dict[str, str]:
    """Each type the ISA's kernels cover: "butter", or "llama.cpp (why)"; and the library
    told which to accept."""
    mirror = ggml_boundary.mirror_figures(lib)
    numbers = {name: mirror[place] for name, place in ggml_boundary.TYPE_PLACES.items()}
    verdicts: dict[str, str] = {}
    accepted = 0
    for name in butter_layer_types(isa):
        why_not = self_check(lib, numbers[name], perturbation=SELF_CHECK_PERTURBATION)
        if why_not:
            log.warning("butter's %s %s layer kernel is off: %s", isa.value, name, why_not)
            verdicts[name] = f"llama.cpp ({why_not})"
        else:
            verdicts[name] = "butter"
            accepted |= TYPE_BITS[name]
    lib.butter_layer_matmul_enable_types(accepted)
    return verdicts


# The attention probes: a lone row, a decode step of 12 rows and a prompt step of 70
# (prompt_attention.h's tiles), 9 query heads sharing 3 KV heads of 64 (SmolLM2's shape) over
# 700 cells (two whole chunks and part of a third), on 2 threads.
ATTENTION_PROBE = {"cells": 700, "heads": 9, "kv_heads": 3, "dim": 64, "threads": 2, "seed": 5}
# llama.cpp rounds the query and its value sums to f16: butter's f32 sums differ by that.
ATTENTION_TOLERANCE = 2e-3


def _checked_attention(kernels: LayerMatmul) -> str:
    """"butter" if butter's decode attention gives llama.cpp's results on the probes, and
    the same bits for a row whatever the step holds; else "llama.cpp (why)"."""
    try:
        by_rows = {rows: (kernels.attention_probe(butter=True, rows=rows, **ATTENTION_PROBE),
                          kernels.attention_probe(butter=False, rows=rows, **ATTENTION_PROBE))
                   for rows in (1, 12, 70)}
    except (Unavailable, ValueError) as exc:
        return f"llama.cpp ({exc})"
    for rows, (ours, theirs) in by_rows.items():
        worst = max(abs(a - b) for a, b in zip(ours, theirs, strict=True))
        if not worst <= ATTENTION_TOLERANCE:  # (a NaN fails too)
            return f"llama.cpp (butter's differs from llama.cpp's by {worst:.3g} at {rows} rows)"
    width = ATTENTION_PROBE["heads"] * ATTENTION_PROBE["dim"]
    if not by_rows[1][0] == by_rows[12][0][:width] == by_rows[70][0][:width]:
        return "llama.cpp (butter's lone row differs from the same row in a bigger step)"
    return "butter"


# The Gated DeltaNet probes: Qwen3.5's head size, a decode step, a prompt step with K state
# snapshots (speculative decoding's) that crosses a block of tokens (delta_net.cpp's
# DELTA_TOKENS), two sequences and a gate per column (Kimi's KDA), and heads shorter than
# a step of ggml's dot product (its floats one at a time).
DELTA_NET_PROBES: tuple[dict[str, Any], ...] = (
    {"tokens": 1, "heads": 2, "dim": 128},
    {"tokens": 70, "heads": 3, "dim": 128, "snapshots": 3},
    {"tokens": 9, "heads": 2, "dim": 64, "seqs": 2, "per_column": True},
    {"tokens": 5, "heads": 2, "dim": 32},
)


def _checked_delta_net(kernels: LayerMatmul) -> str:
    """"butter (<set>)" at the widest width whose probes give llama.cpp's bits exactly (a
    hybrid model's text is then what llama.cpp's op gives), and butter told to use it; else
    "llama.cpp (why)". Exactly, not within a tolerance: rows that sum in ggml's order either
    agree to the bit or were summed in another order, which a tolerance would let by."""
    widths = kernels.delta_net_widths()
    if not widths:
        return "llama.cpp (this CPU has neither AVX2 with FMA nor AVX-512)"
    try:
        theirs = [kernels.delta_net_probe(width=0, **probe) for probe in DELTA_NET_PROBES]
    except ValueError as exc:
        return f"llama.cpp ({exc})"
    why_not = "no width gives llama.cpp's bits: ggml summed in another order"
    for width in widths:
        try:
            ours = [kernels.delta_net_probe(width=width, **probe) for probe in DELTA_NET_PROBES]
        except (Unavailable, ValueError) as exc:
            why_not = str(exc)
            continue
        if all(map(_same_bits, ours, theirs)):
            kernels.use_delta_net(width)
            return f"butter ({_instruction_set(width)})"
    return f"llama.cpp ({why_not})"


def _same_bits(ours: list[float], theirs: list[float]) -> bool:
    """Whether two probes' floats are the same bits (0.0 and -0.0 differ; NaNs compare)."""
    return array("f", ours).tobytes() == array("f", theirs).tobytes()


# The short convolution probes: a decode step, a prompt step of whole tiles and a partial
# one, two sequences, LFM2's width of 3, and a width of 6 (a multiple of 4 and leftovers:
# the two roundings, CONV_ROUNDINGS, differ on it where they agree at 3).
CONV_PROBES: tuple[dict[str, Any], ...] = (
    {"tokens": 1, "channels": 64},
    {"tokens": 37, "channels": 48, "seqs": 2},
    {"tokens": 16, "channels": 32, "width": 3},
    {"tokens": 19, "channels": 16, "width": 6},
)
CONV_ROUNDINGS = (0, 4)  # how a build of llama.cpp may sum a convolution (use_short_conv)


def _checked_short_conv(kernels: LayerMatmul) -> str:
    """"butter (<set>)" at the widest vectors whose probes give llama.cpp's bits exactly,
    and butter told to use them; else "llama.cpp (why)"."""
    widths = kernels.delta_net_widths()
    if not widths:
        return "llama.cpp (this CPU has neither AVX2 with FMA nor AVX-512)"
    try:
        theirs = [kernels.conv_probe(lanes=0, **probe) for probe in CONV_PROBES]
    except ValueError as exc:
        return f"llama.cpp ({exc})"
    why_not = "butter's sums differ from llama.cpp's in the last bits"
    for lanes in widths:
        for rounding in CONV_ROUNDINGS:
            try:
                ours = [kernels.conv_probe(lanes=lanes, rounding=rounding, **probe)
                        for probe in CONV_PROBES]
            except (Unavailable, ValueError) as exc:
                why_not = str(exc)
                continue
            if all(map(_same_bits, ours, theirs)):
                kernels.use_short_conv(lanes, rounding)
                return f"butter ({_instruction_set(lanes)})"
    return f"llama.cpp ({why_not})"


def _instruction_set(lanes: int) -> str:
    """The instruction set whose vectors hold `lanes` floats."""
    return "AVX-512" if lanes == 16 else "AVX2"


def _drop_crashing_buffer_types(lib: Any) -> None:
    """Takes CRASHING_BUFFER_TYPES out of llama.cpp's list (the library refuses until its
    mirror check passed)."""
    for name in CRASHING_BUFFER_TYPES:
        status = lib.butter_layer_matmul_drop_buffer_type(name)
        if status == OK:
            dropped_buffer_types.append(name.decode())
        elif status != DECLINED:
            raise Unavailable(f"could not take {name.decode()} out (status {status})")


def _register() -> LayerMatmul:
    if llama_cpp.llama_supports_gpu_offload():
        raise Unavailable("a GPU build of llama.cpp")
    lib = _library()
    base, cpu = ggml_boundary.ggml_libraries()
    ggml_boundary.check_ggml_build(base)
    isa = _chosen_isa(lib)  # (none: nothing inside llama.cpp is touched either)
    ggml_boundary.check_mirror(lib, base, cpu)
    ggml_boundary.check_headers(lib)
    addresses = ggml_boundary.function_addresses(lib, base, cpu)
    if lib.butter_layer_matmul_bind(addresses, len(addresses)) != OK:
        raise Unavailable("the library refused ggml's functions")
    ggml_boundary.check_mirror_fields(lib)
    _drop_crashing_buffer_types(lib)  # only now: see CRASHING_BUFFER_TYPES
    device = ggml_boundary.cpu_device(base, cpu)
    wanted = sum(TYPE_BITS[name] for name in butter_layer_types(isa))
    status = lib.butter_layer_matmul_register(device, isa_number(isa), wanted)
    if status == DECLINED:
        raise Unavailable(f"this CPU lacks {isa.value}")
    if status != OK:
        raise Unavailable(f"registration failed (status {status})")
    listed = ggml_boundary.listed_extra_buffer_types(base, cpu, device)
    if lib.butter_layer_matmul_buffer_type() not in listed:
        raise Unavailable("llama.cpp listed its buffer types before butter registered")
    registered = LayerMatmul(lib, isa, _on_a_passing_thread(_self_checked_types, lib, isa))
    registered.attention = _on_a_passing_thread(_checked_attention, registered)
    registered.decode_attention(registered.attention == "butter")
    registered.prompt_attention(registered.attention == "butter")
    registered.delta_net = _on_a_passing_thread(_checked_delta_net, registered)
    registered.short_conv = _on_a_passing_thread(_checked_short_conv, registered)
    return registered


def _chosen_isa(lib: Any) -> Isa:
    """The kernels BUTTER_KERNEL_ISA asks for, at most this CPU's best; Unavailable for none."""
    try:
        isa, why = requested_isa(os.environ.get(ISA_VARIABLE),
                                 isa_of(int(lib.butter_layer_matmul_best_isa())))
    except ValueError as exc:
        raise Unavailable(str(exc)) from None
    if isa is Isa.NONE:
        raise Unavailable(why or "this CPU has neither AVX512-VNNI nor AVX2 (with FMA, F16C)")
    return isa


def _on_a_passing_thread(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on a thread that then exits. The self-check runs ggml graphs on 2 threads,
    and libgomp keeps a team of threads for every thread that ran a parallel region: a team
    left on the caller's thread would make more OpenMP threads than cores, and then libgomp
    barely spins at its barriers and sleeps instead, which made one-row decode steps on 2
    cores several times slower (docs/design/threads.md, "One llama.cpp thread")."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="butter-self-check") as once:
        return once.submit(fn, *args).result()  # (leaving the block joins the thread)
