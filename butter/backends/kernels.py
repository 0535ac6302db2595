"""Which kernel multiplies each weight on a llama.cpp CPU build: one table by instruction
set, quant type and role (pure: what it says is checked at load, see layer_matmul.py).

butter brings its own kernels where llama.cpp's x86 code has only generic paths for a type:
the layer matrices in Q8_0, Q6_K, Q5_K, Q4_1 and Q5_0 (layer_matmul.cpp; Q5_0 is what
llama.cpp's quantizer writes where a K-quant does not fit a row), and the output projection
(lmhead.c). Where llama.cpp repacks a type into an interleaved layout of its own (Q4_0,
IQ4_NL and MXFP4 on AVX2 and up, Q2_K on AVX512), its kernel is already the fast one and
butter leaves it. Q4_K is the exception: llama.cpp repacks it too, but its kernel's cost
grows with every row of a step and it rounds rows otherwise from four rows on, while
butter's computes each row alone at any count, with a few rows costing little more than
one (docs/design/kernels.md, "Q4_K"). Everything else is llama.cpp's generic code.

ARM (NEON) is planned here, not built: llama.cpp's repacking there covers Q4_0, Q4_K, Q5_K,
Q6_K, Q8_0, IQ4_NL and MXFP4 (with the dotprod and i8mm extensions), so a NEON port of
butter's tile kernels would only pay for the output projection and for CPUs without those
extensions. The tile layout (16 rows x 4 bytes per group) maps onto NEON's `sdot` as two
registers of 8 rows, like the AVX2 halves; a NEON row in this table and a kernel with the
same entry points are all it takes.
"""

from __future__ import annotations

from enum import StrEnum


class Isa(StrEnum):
    AVX512_VNNI = "AVX512-VNNI"
    AVX2 = "AVX2"
    NEON = "NEON"
    NONE = "none"


class Kernel(StrEnum):
    BUTTER = "butter"
    REPACKED = "llama.cpp (repacked)"  # llama.cpp's interleaved layout and kernel
    GENERIC = "llama.cpp"


# ggml's type names (ggml_type_name) of the layer matrices butter's kernels take on each ISA.
BUTTER_LAYER_TYPES: dict[Isa, tuple[str, ...]] = {
    Isa.AVX512_VNNI: ("q8_0", "q6_K", "q5_K", "q4_1", "q5_0", "q4_K"),
    Isa.AVX2: ("q8_0", "q6_K", "q5_K", "q4_1", "q5_0", "q4_K"),
    Isa.NEON: (),  # (planned: no butter kernel runs on ARM yet)
    Isa.NONE: (),
}
# The layer types llama.cpp's own repacking takes on each ISA (with repacking on), where
# butter's kernels do not take them first.
LLAMA_CPP_REPACKS: dict[Isa, tuple[str, ...]] = {
    Isa.AVX512_VNNI: ("q4_0", "q4_K", "iq4_nl", "mxfp4", "q2_K"),
    Isa.AVX2: ("q4_0", "q4_K", "iq4_nl", "mxfp4"),
    Isa.NEON: ("q8_0", "q6_K", "q5_K", "q4_0", "q4_K", "iq4_nl", "mxfp4"),
    Isa.NONE: (),
}

# The output projection: butter's kernel reads Q8_0 and Q6_K in their own bytes; other
# types it can dequantize are requantized to Q8_0 at load (lmhead.py).
OUTPUT_NATIVE_TYPES = ("q8_0", "q6_K")
OUTPUT_ISAS = (Isa.AVX512_VNNI, Isa.AVX2)

# The layer types butter has kernels for, as the C library numbers them (TYPE_BIT_*).
TYPE_BITS = {"q8_0": 1, "q6_K": 2, "q5_K": 4, "q4_1": 8, "q5_0": 16, "q4_K": 32}


def isa_of(number: int) -> Isa:
    """The C libraries' ISA numbers (ISA_NONE, ISA_AVX2, ISA_AVX512_VNNI)."""
    return {0: Isa.NONE, 1: Isa.AVX2, 2: Isa.AVX512_VNNI}[number]


def isa_number(isa: Isa) -> int:
    return {Isa.NONE: 0, Isa.AVX2: 1, Isa.AVX512_VNNI: 2}[isa]


def layer_kernel(isa: Isa, ggml_type: str) -> Kernel:
    """Who multiplies a layer type on this ISA with butter's kernels and repacking on."""
    if ggml_type in BUTTER_LAYER_TYPES[isa]:
        return Kernel.BUTTER
    return llama_cpp_kernel(isa, ggml_type, repack=True)


def llama_cpp_kernel(isa: Isa, ggml_type: str, *, repack: bool) -> Kernel:
    """Who multiplies a layer type where butter's kernels do not take it."""
    return Kernel.REPACKED if repack and ggml_type in LLAMA_CPP_REPACKS[isa] else Kernel.GENERIC


def butter_layer_types(isa: Isa) -> list[str]:
    """The layer types butter's kernels take on this ISA."""
    return list(BUTTER_LAYER_TYPES[isa])


def requested_isa(wanted: str | None, best: Isa) -> tuple[Isa, str]:
    """The ISA to run given BUTTER_KERNEL_ISA (`wanted`: auto or unset, avx512-vnni, avx2,
    none) and the CPU's best: the ISA, and why it is not the best ("" when it is)."""
    if wanted is None or wanted.strip().lower() in ("", "auto"):
        return best, ""
    names = {isa.value.lower(): isa for isa in (Isa.AVX512_VNNI, Isa.AVX2, Isa.NONE)}
    isa = names.get(wanted.strip().lower())
    if isa is None:
        raise ValueError(f"BUTTER_KERNEL_ISA={wanted}: expected auto, "
                         f"{', '.join(names)}")
    if isa is Isa.NONE:
        return isa, f"BUTTER_KERNEL_ISA={wanted}: butter's kernels are off, as asked"
    if isa_number(isa) > isa_number(best):
        return Isa.NONE, f"BUTTER_KERNEL_ISA={wanted}: this CPU lacks it"
    return isa, "" if isa is best else f"BUTTER_KERNEL_ISA={wanted}"
