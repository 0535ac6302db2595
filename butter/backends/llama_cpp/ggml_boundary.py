"""The boundary between butter's layer library and the running ggml: which ggml it is
(commit and version, before anything else), and whether the structures and numbers the
library mirrors (butter/native/ggml_mirror.h) are that ggml's. Each check raises Unavailable
with the reason; nothing here changes llama.cpp's state."""

from __future__ import annotations

import ctypes
import logging
import os
import re
from typing import Any

import llama_cpp

from butter.backends import native
from butter.backends.llama_cpp import ggml_abi as abi
from butter.backends.native import Unavailable

log = logging.getLogger("butter.backends.llama_cpp.layer_matmul")

_P, _I32, _SIZE = native.P, native.I32, native.SIZE
OK = abi.OK
MIRRORED = abi.MIRRORED
# ggml_tensor_overhead() is a ggml_object (32 bytes) plus a ggml_tensor.
GGML_OBJECT_BYTES = 32
# Set to 1, butter's kernels may run on a ggml other than the one they mirror (a build of
# another llama.cpp known to be compatible): the structure checks and self-checks decide. At
# the user's risk: those checks read ggml's objects through the mirror, and a ggml whose
# layout moved can crash there.
GGML_COMMIT_OK_VARIABLE = "BUTTER_GGML_COMMIT_OK"

# butter_layer_matmul_check_mirror's bits: the mirrored fields that disagree.
MIRROR_FIELDS = {
    abi.FIELD_TYPE: "type", abi.FIELD_NE: "ne", abi.FIELD_NB: "nb", abi.FIELD_DATA: "data",
    abi.FIELD_NAME: "name", abi.FIELD_VIEW: "view_src/view_offs", abi.FIELD_OP: "op/src",
    abi.FIELD_BUFFER: "buffer", abi.FIELD_BUFT: "buffer type", abi.FIELD_EXTRA: "extra",
    abi.FIELD_SETUP: "(ggml could not make the probes)",
}


def ggml_libraries() -> tuple[Any, Any]:
    """libggml-base and libggml-cpu as llama.cpp loaded them."""
    return native.loaded_library("libggml-base.so.0"), native.loaded_library("libggml-cpu.so.0")


def ggml_build(base: Any) -> tuple[str, str]:
    """The loaded ggml's ggml_commit() and ggml_version() ("" for one it lacks)."""
    found = []
    for name in ("ggml_commit", "ggml_version"):
        try:
            function = getattr(base, name)
        except AttributeError:
            found.append("")
            continue
        function.argtypes, function.restype = [], ctypes.c_char_p
        value = function()
        found.append(value.decode(errors="replace") if value else "")
    return found[0], found[1]


def ggml_differs(commit: str, version: str, package: str) -> str:
    """Why a ggml of this commit and version, in this llama-cpp-python release, is not the
    one butter's mirror was copied from (ggml_abi.h); "" if it is. A build records git's
    short hash of the llama.cpp it compiled ("-dirty" added where the tree had changed, as a
    build from the sdist always has), or "unknown" where it was built outside git: then the
    llama-cpp-python release vouches for the commit."""
    short = commit.removesuffix("-dirty")
    if short == "unknown":
        same = package == abi.LLAMA_CPP_PYTHON_VERSION
    else:
        same = bool(re.fullmatch(r"[0-9a-f]{7,40}", short)) and abi.GGML_COMMIT.startswith(short)
    if same and version == abi.GGML_VERSION:
        return ""
    return (f"not the llama.cpp butter's kernels mirror: ggml {version or '(no version)'} at "
            f"commit {commit or '(none)'} in llama-cpp-python {package} (they mirror ggml "
            f"{abi.GGML_VERSION} at {abi.GGML_COMMIT[:7]}, llama-cpp-python "
            f"{abi.LLAMA_CPP_PYTHON_VERSION})")


def check_ggml_build(base: Any) -> None:
    """The running ggml must be the one the library mirrors, before anything reads or
    changes its state through the mirror; else Unavailable, and a line in the log."""
    why = ggml_differs(*ggml_build(base), llama_cpp.__version__)
    if not why:
        return
    if os.environ.get(GGML_COMMIT_OK_VARIABLE) == "1":
        log.warning("%s; %s=1: butter's structure checks and self-checks decide", why,
                    GGML_COMMIT_OK_VARIABLE)
        return
    log.warning("butter's layer kernels and attention are off, llama.cpp computes them: %s "
                "(%s=1 tries butter's anyway, after its structure checks)", why,
                GGML_COMMIT_OK_VARIABLE)
    raise Unavailable(why)


def ggml_type_name(number: int) -> str:
    """ggml's own name of a type number ("q8_0", "q6_K", "f16"; ggml does not check the
    number: only types of a file llama.cpp loaded)."""
    base, _ = ggml_libraries()
    base.ggml_type_name.argtypes, base.ggml_type_name.restype = [_I32], ctypes.c_char_p
    name = base.ggml_type_name(number)
    return name.decode() if name else f"type {number}"


# The mirror's place of each type butter has kernels for.
TYPE_PLACES = {"q8_0": abi.MIRROR_TYPE_Q8_0, "q6_K": abi.MIRROR_TYPE_Q6_K,
                "q5_K": abi.MIRROR_TYPE_Q5_K, "q4_K": abi.MIRROR_TYPE_Q4_K,
                "q4_1": abi.MIRROR_TYPE_Q4_1, "q5_0": abi.MIRROR_TYPE_Q5_0}


def mirror_figures(lib: Any) -> list[int]:
    mirror = (ctypes.c_int64 * MIRRORED)()
    if lib.butter_layer_matmul_mirror(mirror, ctypes.sizeof(mirror)) != OK:
        raise Unavailable("the library refused to report its mirror")
    return [int(value) for value in mirror]


def check_mirror(lib: Any, base: Any, cpu: Any) -> None:
    """The library mirrors a few ggml structures and numbers; they must be this ggml's."""
    mirror = mirror_figures(lib)
    tensor_bytes, f32, f16 = (mirror[abi.MIRROR_TENSOR_BYTES], mirror[abi.MIRROR_TYPE_F32],
                              mirror[abi.MIRROR_TYPE_F16])
    q8_0, q6_k, q5_k, q4_k, q4_1, q5_0 = (mirror[place] for place in TYPE_PLACES.values())
    mul_mat, attention = mirror[abi.MIRROR_OP_MUL_MAT], mirror[abi.MIRROR_OP_FLASH_ATTN_EXT]
    delta_net, conv = mirror[abi.MIRROR_OP_GATED_DELTA_NET], mirror[abi.MIRROR_OP_SSM_CONV]
    concat = mirror[abi.MIRROR_OP_CONCAT]
    base.ggml_tensor_overhead.restype = _SIZE
    base.ggml_type_name.argtypes, base.ggml_type_name.restype = [_I32], ctypes.c_char_p
    base.ggml_op_name.argtypes, base.ggml_op_name.restype = [_I32], ctypes.c_char_p
    cpu.ggml_backend_cpu_buffer_type.restype = _P
    found = {
        "tensor size": int(base.ggml_tensor_overhead()) - GGML_OBJECT_BYTES,
        "type F32": base.ggml_type_name(f32),
        "type F16": base.ggml_type_name(f16),
        "type Q8_0": base.ggml_type_name(q8_0),
        "type Q6_K": base.ggml_type_name(q6_k),
        "type Q5_K": base.ggml_type_name(q5_k),
        "type Q4_1": base.ggml_type_name(q4_1),
        "type Q5_0": base.ggml_type_name(q5_0),
        "type Q4_K": base.ggml_type_name(q4_k),
        "op MUL_MAT": base.ggml_op_name(mul_mat),
        "op FLASH_ATTN_EXT": base.ggml_op_name(attention),
        "op GATED_DELTA_NET": base.ggml_op_name(delta_net),
        "op SSM_CONV": base.ggml_op_name(conv),
        "op CONCAT": base.ggml_op_name(concat),
    }
    expected = {
        "tensor size": tensor_bytes, "type F32": b"f32", "type F16": b"f16", "type Q8_0": b"q8_0",
        "type Q6_K": b"q6_K", "type Q5_K": b"q5_K", "type Q4_1": b"q4_1",
        "type Q5_0": b"q5_0", "type Q4_K": b"q4_K", "op MUL_MAT": b"MUL_MAT",
        "op FLASH_ATTN_EXT": b"FLASH_ATTN_EXT", "op GATED_DELTA_NET": b"GATED_DELTA_NET",
        "op SSM_CONV": b"SSM_CONV", "op CONCAT": b"CONCAT",
    }
    wrong = [name for name in expected if found[name] != expected[name]]
    # Read through the mirror only once ggml's own answers agree with it.
    if not wrong and lib.butter_layer_matmul_buffer_type_name(
            cpu.ggml_backend_cpu_buffer_type()) != b"CPU":
        wrong.append("CPU buffer type")
    if wrong:
        raise Unavailable(f"this ggml differs from the one the kernel mirrors ({', '.join(wrong)})")


def cpu_device(base: Any, cpu: Any) -> int:
    cpu.ggml_backend_cpu_reg.restype = _P
    base.ggml_backend_reg_dev_get.argtypes, base.ggml_backend_reg_dev_get.restype = [_P, _SIZE], _P
    device = base.ggml_backend_reg_dev_get(cpu.ggml_backend_cpu_reg(), 0)
    if not device:
        raise Unavailable("llama.cpp has no CPU device")
    return int(device)


def listed_extra_buffer_types(base: Any, cpu: Any, device: int) -> list[int]:
    """The extra buffer types llama.cpp offers weights to at load (a list it makes once)."""
    get_proc = base.ggml_backend_reg_get_proc_address
    get_proc.argtypes, get_proc.restype = [_P, ctypes.c_char_p], _P
    address = get_proc(cpu.ggml_backend_cpu_reg(), b"ggml_backend_dev_get_extra_bufts")
    if not address:
        return []
    listing = ctypes.CFUNCTYPE(ctypes.POINTER(_P), _P)(address)(device)
    found: list[int] = []
    while listing and listing[len(found)]:
        found.append(int(listing[len(found)]))
    return found


def listed_buffer_type_names() -> list[str]:
    """The names of the extra buffer types llama.cpp offers weights to (after `register`)."""
    base, cpu = ggml_libraries()
    base.ggml_backend_buft_name.argtypes = [_P]
    base.ggml_backend_buft_name.restype = ctypes.c_char_p
    listed = listed_extra_buffer_types(base, cpu, cpu_device(base, cpu))
    return [base.ggml_backend_buft_name(buft).decode() for buft in listed]


def function_addresses(lib: Any, base: Any, cpu: Any) -> ctypes.Array[ctypes.c_void_p]:
    """The ggml functions the library asks for, by the names it lists, in its order."""
    names = lib.butter_layer_matmul_function_names().decode().split(",")
    addresses = (_P * len(names))()
    for i, name in enumerate(names):
        for library in (cpu, base):
            try:
                addresses[i] = ctypes.cast(getattr(library, name), _P).value
                break
            except AttributeError:
                continue
        else:
            raise Unavailable(f"llama.cpp's ggml lacks {name}")
    return addresses


def check_mirror_fields(lib: Any) -> None:
    wrong = ctypes.c_int32()
    if lib.butter_layer_matmul_check_mirror(ctypes.byref(wrong)) != OK:
        raise Unavailable("the mirror check could not run")
    fields = [name for bit, name in sorted(MIRROR_FIELDS.items()) if wrong.value & (1 << bit)]
    if fields:
        raise Unavailable(f"this ggml's structures differ from the mirror ({', '.join(fields)})")


def check_headers(lib: Any) -> None:
    """A library compiled against ggml's headers (BUTTER_GGML_SOURCE) checked the mirror's
    layout at build; what only runs, the vtable slots, is checked here."""
    if lib.butter_layer_matmul_header_check() == abi.HEADERS_DISAGREE:
        raise Unavailable("the mirror's virtual functions are not in the slots of ggml's")


