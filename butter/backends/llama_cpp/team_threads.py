"""The kernel thread ids of llama.cpp's OpenMP team (butter/native/team.c says how), so
that the team sizer can read how long each waited for a CPU. Ask on the backend's thread,
the one that calls llama_decode: libgomp's pool belongs to it.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

from butter.backends import native
from butter.backends.native import Unavailable

ABI_VERSION = 2  # BUTTER_TEAM_ABI_VERSION in team.c
_I32, _P, _SIZE = ctypes.c_int32, ctypes.c_void_p, ctypes.c_size_t
_SIGNATURES: native.Signatures = {"butter_team_threads": (_I32, [_I32, _P, _SIZE])}
E_NO_OPENMP = -4
OPENMP_RUNTIMES = ("libgomp", "libomp", "libiomp5")


def team_thread_ids(most: int) -> list[int]:
    """The ids of the `most` threads a step's team runs on, thread 0 (the caller) first.
    Raises Unavailable where the extension is not built, has no OpenMP, or its OpenMP may
    not be llama.cpp's."""
    lib: Any = native.open_extension("_team", "butter_team_abi_version", ABI_VERSION,
                                     _SIGNATURES)
    import llama_cpp

    runtimes = linked_runtimes(openmp_runtimes(), Path(llama_cpp.__file__).parent)
    if len(runtimes) > 1:  # (then this extension's threads need not be llama.cpp's)
        raise Unavailable(f"more than one OpenMP runtime is loaded: {sorted(runtimes)}")
    tids = (ctypes.c_int32 * most)()
    got = int(lib.butter_team_threads(most, tids, ctypes.sizeof(tids)))
    if got == E_NO_OPENMP:
        raise Unavailable("butter's team extension was built without OpenMP")
    if got != most or not all(tids):
        raise Unavailable(f"butter_team_threads gave {got} threads of {most}")
    return list(tids)


def openmp_runtimes(maps: Path = Path("/proc/self/maps")) -> set[str]:
    """The OpenMP runtime libraries mapped into this process (empty where /proc says
    nothing): llama.cpp's team and this extension's regions share threads only in one."""
    try:
        text = maps.read_text()
    except OSError:
        return set()
    found = set()
    for line in text.splitlines():
        name = line.rsplit("/", 1)[-1] if "/" in line else ""
        if name.startswith(OPENMP_RUNTIMES):
            found.add(line[line.index("/"):])
    return found


def linked_runtimes(runtimes: set[str], llama_package: Path) -> set[str]:
    """Of the OpenMP runtimes loaded, those llama.cpp or this extension may be linked to:
    the ones loaded under their own names (`libgomp.so.1`), and any copy inside the
    llama_cpp package. A wheel's private copy elsewhere (auditwheel renames it
    `libgomp-<hash>.so`, as sentencepiece's) serves only that wheel."""
    def named_plainly(path: str) -> bool:
        name = path.rsplit("/", 1)[-1]
        return any(name.startswith(runtime + ".so") for runtime in OPENMP_RUNTIMES)

    return {path for path in runtimes
            if named_plainly(path) or Path(path).is_relative_to(llama_package)}
