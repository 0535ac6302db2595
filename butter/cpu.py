"""The CPU class of this machine: what every speed figure must name (pure, no model).

butter's kernels are chosen by instruction set (butter/backends/kernels.py), and a figure
measured on one class says little about another: the same model steps at very different
speeds on an AVX512-VNNI server and an AVX2 laptop. So `/v1/server` and every benchmark
record carry this: the CPU's model name, the instruction-set flags that decide which
kernels run, and the cores.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

import attrs

# The flags that decide a kernel (x86: /proc/cpuinfo `flags`; ARM: `Features`).
KERNEL_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni",
                "amx_int8", "asimd", "asimddp", "i8mm", "sve")


@attrs.frozen
class CpuClass:
    model: str  # e.g. "AMD EPYC", "Intel(R) Xeon(R) Platinum 8481C"
    flags: tuple[str, ...]  # the KERNEL_FLAGS it has, in that order
    cores: int  # usable by this process

    @property
    def isa(self) -> str:
        """The class in one word: AVX512-VNNI, AVX2, NEON or generic."""
        present = set(self.flags)
        if {"avx2", "fma", "f16c"} <= present:
            if {"avx512f", "avx512bw", "avx512_vnni"} <= present:
                return "AVX512-VNNI"
            return "AVX2"
        if "asimd" in present:
            return "NEON"
        return "generic"

    @property
    def label(self) -> str:
        """For a benchmark row: "AMD EPYC, 2 cores, AVX2 (avx2 fma f16c)"."""
        return f"{self.model}, {self.cores} cores, {self.isa} ({' '.join(self.flags) or 'none'})"

    def as_dict(self) -> dict[str, object]:
        return {"model": self.model, "isa": self.isa, "flags": list(self.flags),
                "cores": self.cores}


def parse_cpuinfo(text: str, *, cores: int) -> CpuClass:
    """The class described by a /proc/cpuinfo text (its first processor)."""
    model, flags = "", set[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "hardware", "cpu model") and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    return CpuClass(model=model or platform.processor() or platform.machine(),
                    flags=tuple(flag for flag in KERNEL_FLAGS if flag in flags), cores=cores)


@functools.cache
def this_cpu() -> CpuClass:
    """This machine's class (from /proc/cpuinfo where there is one; read once: `/v1/server`
    asks on every poll)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    return parse_cpuinfo(text, cores=cores or 1)
