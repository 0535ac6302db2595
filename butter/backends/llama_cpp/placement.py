"""Where the threads of llama.cpp's OpenMP team run (butter/native/team.c says why).

A team that fills every CPU this process may use gets one CPU per thread; a smaller one
may run anywhere in the mask, so the scheduler can keep it off the cores other programs
took. Call `place` on the backend's thread, the one that calls llama_decode: libgomp's
pool belongs to it.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from butter.backends import native
from butter.backends.native import Unavailable

log = logging.getLogger("butter.engine")

ABI_VERSION = 1  # BUTTER_TEAM_ABI_VERSION in team.c
_I32, _P, _SIZE = ctypes.c_int32, ctypes.c_void_p, ctypes.c_size_t
_SIGNATURES: native.Signatures = {
    "butter_team_place": (_I32, [_I32, _P, _SIZE, _I32, _I32, _P, _SIZE]),
}
E_NO_OPENMP = -4


class TeamPlacement:
    """Pins the team one thread per CPU when it has one for each, and frees it to run
    anywhere in the mask when it shrinks."""

    def __init__(self, cpus: Iterable[int]) -> None:
        """Raises Unavailable where the extension is not built or has no OpenMP."""
        self._lib: Any = native.open_extension("_team", "butter_team_abi_version",
                                               ABI_VERSION, _SIGNATURES)
        import llama_cpp

        runtimes = linked_runtimes(openmp_runtimes(), Path(llama_cpp.__file__).parent)
        if len(runtimes) > 1:  # (then this extension's threads need not be llama.cpp's)
            raise Unavailable(f"more than one OpenMP runtime is loaded: {sorted(runtimes)}")
        self.cpus = sorted(cpus)
        self.pinned = False
        self.tids: list[int] = []  # the team's kernel thread ids, thread 0 first

    def place(self, threads: int, most: int) -> None:
        """Pin a team of `threads` when it is one thread per CPU (and the most it may
        be); otherwise free its threads to run anywhere in the mask. Either way `tids`
        then names the pool's `most` threads."""
        pin = threads == most == len(self.cpus)
        if not pin and not self.pinned and len(self.tids) >= most:
            return  # (already anywhere in the mask, and known)
        cpus = (ctypes.c_int32 * len(self.cpus))(*self.cpus)
        tids = (ctypes.c_int32 * most)()
        got = int(self._lib.butter_team_place(most, cpus, ctypes.sizeof(cpus), len(self.cpus),
                                              int(pin), tids, ctypes.sizeof(tids)))
        if got == E_NO_OPENMP:
            raise Unavailable("butter's team extension was built without OpenMP")
        if got < 0:
            raise Unavailable(f"butter_team_place failed with status {got}")
        self.tids = list(tids[:got])
        self.pinned = pin and got == most and all(self.tids)
        if pin and not self.pinned:
            log.warning("could not pin the compute team to CPUs %s (threads: %s)",
                        self.cpus, self.tids)


OPENMP_RUNTIMES = ("libgomp", "libomp", "libiomp5")


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
