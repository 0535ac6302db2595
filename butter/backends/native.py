"""The boundary with butter's compiled kernels and the ggml that llama.cpp loaded.

Both native libraries (the output projection, `lmhead.py`, and the layer matmuls,
`llama_cpp/layer_matmul.py`) are opened the same way: ctypes checks nothing, so a library
must report the ABI version its Python side was written for, and every function gets its
signature before the first call. ggml's own libraries are found only as llama.cpp already
loaded them: the wheel ships each under three names as separate files, and opening
another one would load a second copy with its own state.
"""

from __future__ import annotations

import ctypes
import importlib
import os
from typing import Any

P = ctypes.c_void_p
I32, I64, SIZE = ctypes.c_int32, ctypes.c_int64, ctypes.c_size_t

Signatures = dict[str, tuple[Any, list[Any]]]


class Unavailable(Exception):
    """Why one of butter's kernels does not apply here (llama.cpp's code is used)."""


def open_extension(module: str, abi_function: str, abi_version: int,
                   signatures: Signatures) -> Any:
    """The extension `butter.backends.<module>`, refused unless `abi_function()` returns
    `abi_version` and it has every function of `signatures` (which it then declares)."""
    try:
        extension = importlib.import_module(f"butter.backends.{module}")
    except ImportError:
        raise Unavailable("butter's native extension is not built") from None
    lib = ctypes.CDLL(extension.__file__)
    try:
        version = getattr(lib, abi_function)
    except AttributeError:  # built from a source older than the versioned ABI
        raise Unavailable(f"butter's native extension reports no ABI version (expected "
                          f"{abi_version}): rebuild it") from None
    version.argtypes, version.restype = [], I32
    found = int(version())
    if found != abi_version:
        raise Unavailable(f"butter's native extension has ABI version {found}, expected "
                          f"{abi_version}: rebuild it")
    for name, (restype, argtypes) in signatures.items():
        try:
            function = getattr(lib, name)
        except AttributeError:
            raise Unavailable(f"butter's native extension lacks {name}: rebuild it") from None
        function.argtypes, function.restype = argtypes, restype
    return lib


def loaded_library(soname: str) -> Any:
    """One of ggml's libraries as llama.cpp loaded it ("libggml-cpu.so.0"), never a copy."""
    try:
        return ctypes.CDLL(soname, mode=os.RTLD_NOLOAD)
    except OSError:
        raise Unavailable(f"llama.cpp's ggml is not loaded as {soname}") from None
