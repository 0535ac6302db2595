"""The CPU class of this machine: what every speed figure must name (pure, no model).

butter's kernels are chosen by instruction set (butter/backends/kernels.py), and a figure
measured on one class says little about another: the same model steps at very different
speeds on an AVX512-VNNI server and an AVX2 laptop. So `/v1/server` and every benchmark
record carry this: the CPU's model name, the instruction-set flags that decide which
kernels run, and the cores.
"""

from __future__ import annotations

import functools
import math
import os
import platform
from collections.abc import Callable
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


def allowed_cpus() -> frozenset[int]:
    """The CPU numbers this process may run on (its affinity mask; every CPU where the
    platform has no masks)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no sched_getaffinity
        return frozenset(range(os.cpu_count() or 1))


def cgroup_cpu_limit(cgroup_root: Path = Path("/sys/fs/cgroup"),
                     membership: Path = Path("/proc/self/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup and the groups above it, in cores (the
    tightest), or None where none is set. A container started with `--cpus 2` runs on all
    of the host's CPUs, but only two cores' worth of time: more threads than that are
    throttled (stopped for the rest of each period), the way a busy machine stops them.
    Reads cgroup v2 (`cpu.max`) and v1 (`cpu.cfs_quota_us` / `cpu.cfs_period_us`)."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # v2, unified
            limits += _quotas(cgroup_root, path, _v2_quota)
        elif "cpu" in controllers.split(","):
            for mount in (cgroup_root / "cpu", cgroup_root / "cpu,cpuacct"):
                if mount.is_dir():
                    limits += _quotas(mount, path, _v1_quota)
                    break
    return min(limits, default=None)


def _quotas(root: Path, path: str, quota_in: Callable[[Path], float | None]) -> list[float]:
    """The quotas of `path`'s group and every group above it, under `root`."""
    parts = [part for part in path.strip("/").split("/") if part]
    found = []
    for depth in range(len(parts), -1, -1):
        quota = quota_in(root.joinpath(*parts[:depth]))
        if quota is not None:
            found.append(quota)
    return found


def _v2_quota(group: Path) -> float | None:
    try:
        quota, _, period = (group / "cpu.max").read_text().strip().partition(" ")
        return None if quota == "max" else int(quota) / int(period or 100000)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _v1_quota(group: Path) -> float | None:
    try:
        quota = int((group / "cpu.cfs_quota_us").read_text())
        period = int((group / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None



def usable_cores(cpus: frozenset[int] | None = None, quota: float | None = None) -> int:
    """How many threads this process can keep running at once: the CPUs of its affinity
    mask, and no more than its cgroup quota's whole cores (at least one). Defaults: this
    process's mask and quota."""
    count = len(allowed_cpus() if cpus is None else cpus)
    limit = cgroup_cpu_limit() if quota is None else quota
    if limit is not None:
        count = min(count, max(1, math.floor(limit + 1e-9)))
    return max(1, count)


@functools.cache
def this_cpu() -> CpuClass:
    """This machine's class (from /proc/cpuinfo where there is one; read once: `/v1/server`
    asks on every poll)."""
    cores = usable_cores()
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    return parse_cpuinfo(text, cores=cores or 1)
