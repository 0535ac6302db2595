#!/usr/bin/env python3
"""Side-by-side streaming throughput benchmark: butter vs llama-server vs
llama-cpp-python's own server, each measured by ``butter serve-bench``.

Each server is started on its own (never two at once) on 127.0.0.1 with a free
port and waited for; then ``butter serve-bench`` runs against it, once as a
warm-up (c=1, one wave, not reported) and once per concurrency level ``c``
(``--waves`` synchronized waves of ``c`` concurrent streaming chat requests).
There is no second request driver here: every number in the tables is a field
of serve-bench's JSON record for that level (see ``butter/bench/metrics.py``):

* agg tok/s = ``completion_tok_s`` (usage completion tokens / sum of wave walls);
* TTFT p50/p95 and latency p95 (``ttft_p50``, ``ttft_p95``, ``latency_p95``);
* tok/req and prompt tok/req (``completion_tokens`` and ``prompt_tokens`` per
  successful request) and errors (``http_errors``, plus leaked markers, empty
  responses and invalid UTF-8 when there are any).

serve-bench counts tokens from the final ``usage`` chunk; for a server that sends
none (llama-cpp-python's server ignores ``stream_options.include_usage``) it counts
content deltas (one per token there) and says so: such rates are marked "(deltas)"
and its prompt tokens are n/a.

The machine is shared (2 cores) and llama.cpp's spinning threads slow down by an
order of magnitude when another process takes a core, so CPU use of everything
but the server and serve-bench is read from /proc around every serve-bench run:
before each run the script waits for a quiet machine (``--quiet-threshold``
cores, ``--quiet-wait`` seconds at most), a run disturbed by other processes is
aborted or discarded and redone (``--level-retries``), and the "other load"
column reports what remained.

Usage (from the repository root)::

    benchmarks/build_llama_server.sh && benchmarks/setup_lcp_venv.sh
    /work/venv/bin/python benchmarks/compare.py --markdown benchmarks/RESULTS.md
    /work/venv/bin/python benchmarks/compare.py --only llama-server --levels 1,8

With ``--matrix`` (or ``--matrix-only NAME,...``) the same comparison runs for the
demo GGUF and then for every model of ``benchmarks/model_matrix.py`` (random weights,
real shapes, written on first use), one markdown section per model and, at the end, a
summary of butter's ratios per baseline that ran (llama-server, llama-cpp-python). The
chat-template flags follow what each file contains: without ``tokenizer.chat_template``
(the demo GGUF) the servers get the built-in gemma template as above; with one, butter
and llama-cpp-python's server use the embedded template (no flag) and llama-server gets
``--jinja``::

    python benchmarks/compare.py --matrix --markdown benchmarks/RESULTS.md
    python benchmarks/compare.py --matrix-only demo,qwen3-0.6b-shape-Q4_K_M --print-commands
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

if not __package__:  # run as a file: the repository root, not benchmarks/, on sys.path
    import _repo_root  # noqa: F401

import httpx
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from benchmarks.harness import (
    ABORT_WINDOWS,
    BUILD,
    DEFAULT_LLAMA_SERVER_BIN,
    SERVE_BENCH,
    VENV_PYTHON,
    CpuWindow,
    ServerSpec,
    console,
    cpu_sample,
    cpu_window,
    free_port,
    llama_server_argv,
    log_tail,
    md_table,
    resolve_model,
    run_meta,
    running_server,
    served_model_id,
    stop_process,
    version_of,
    wait_quiet,
    wait_ready,
    write_markdown,
)

BUTTER = "butter"
LLAMA_SERVER = "llama-server"
LCP = "llama-cpp-python"
ALL_SERVERS = (BUTTER, LLAMA_SERVER, LCP)

DEFAULT_BUTTER_CMD = (
    f"{sys.executable} -m butter.cli serve --model {{model}} --host {{host}} --port {{port}}"
    " --parallel {parallel} --threads {threads} {template_flags}"
)
# butter's {template_flags} for a GGUF without a chat template (the demo GGUF); for a
# file with one (only chosen in --matrix runs) they are empty.
BUTTER_GEMMA_FLAGS = "--chat-template gemma"
DEMO = "demo"  # the --matrix name of the demo GGUF (or of --model)
# the --matrix name of the real instruct model the demo extra installs (butter/models.py)
INSTRUCT = "smollm2-135m"
DEFAULT_LCP_PYTHON = BUILD / "lcp-venv" / "bin" / "python"

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
    level_retries: int
    log_dir: Path
    # The GGUF carries tokenizer.chat_template and the servers use it (--matrix runs);
    # otherwise every server gets the built-in gemma template.
    embedded_template: bool = False


@dataclass(frozen=True)
class Target:
    """A running server as serve-bench sees it."""

    name: str
    base_url: str  # ends in /v1
    model_id: str
    pgid: int


# -------------------------------------------------------------------- results


@dataclass
class LevelResult:
    """serve-bench's record for one level, with the CPU other processes took
    during the kept run and the contended runs redone before it."""

    level: int
    record: dict[str, Any]
    command: list[str]
    other_cores: float
    steal_cores: float
    redone: int
    discarded: list[dict[str, Any]] = field(default_factory=list)


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
    warmup: LevelResult | None = None
    levels: list[LevelResult] = field(default_factory=list)
    log_file: str | None = None
    log_notes: list[str] = field(default_factory=list)


# ------------------------------------------------------------------- servers


def butter_spec(cfg: BenchConfig, port: int, template: str, ready: str) -> ServerSpec:
    """butter's command, from a template with {model} {host} {port}
    {parallel} {threads} {ctx_per_slot} {template_flags} placeholders."""
    command = template.format(
        model=shlex.quote(cfg.model),
        host=cfg.host,
        port=port,
        parallel=cfg.parallel,
        threads=cfg.threads,
        ctx_per_slot=cfg.ctx_per_slot,
        template_flags="" if cfg.embedded_template else BUTTER_GEMMA_FLAGS,
    )
    argv = shlex.split(command)
    return ServerSpec(BUTTER, argv, ready, [VENV_PYTHON, "-m", "pip", "show", "butter"])


def llama_server_spec(cfg: BenchConfig, port: int, binary: Path) -> ServerSpec:
    """llama-server: -c is the total KV size; with an explicit -np the cache is
    not unified and each slot gets c / np tokens."""
    # The demo GGUF has no chat template. With jinja on (the default) a
    # --chat-template value is taken as the template text itself, so "gemma" would
    # render every prompt as the literal word "gemma": switch jinja off to select the
    # built-in gemma template. A file with its own template gets it through jinja.
    template = ["--jinja"] if cfg.embedded_template else ["--no-jinja", "--chat-template", "gemma"]
    argv = llama_server_argv(binary, cfg.model, cfg.host, port, slots=cfg.parallel,
                             threads=cfg.threads, context=cfg.ctx_per_slot * cfg.parallel,
                             extra=template)
    return ServerSpec(LLAMA_SERVER, argv, "/health", [str(binary), "--version"])


def lcp_spec(cfg: BenchConfig, port: int, python: Path) -> ServerSpec:
    """llama-cpp-python's server: one sequence at a time (no slots).
    interrupt_requests is switched off: by default a queued request makes the
    server cut the running stream short, which would corrupt the numbers. Without
    --chat_format it formats chats with the GGUF's own template."""
    template = [] if cfg.embedded_template else ["--chat_format", "gemma"]
    argv = [
        str(python), "-m", "llama_cpp.server",
        "--model", cfg.model,
        "--host", cfg.host,
        "--port", str(port),
        "--n_threads", str(cfg.threads),
        "--n_threads_batch", str(cfg.threads),
        "--n_ctx", str(cfg.ctx_per_slot),
        *template,
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


# ----------------------------------------------------------------- measuring


def serve_bench_argv(
    cfg: BenchConfig, base_url: str, model_id: str, level: int | str, waves: int, out: str
) -> list[str]:
    """The ``butter serve-bench`` command for one level, its record written to ``out``."""
    return [
        *SERVE_BENCH,
        "--model", model_id,
        "--base-url", base_url,
        "--concurrency", str(level),
        "--max-tokens", str(cfg.max_tokens),
        "--temperature", str(cfg.temperature),
        "--top-p", str(cfg.top_p),
        "--waves", str(waves),
        "--timeout", str(cfg.request_timeout),
        "--json", out,
    ]  # fmt: skip


def serve_bench_template(cfg: BenchConfig) -> str:
    """The serve-bench command line with PORT, MODEL_ID and C standing for the
    server's port, its model id and the concurrency level."""
    base_url = f"http://{cfg.host}:PORT/v1"
    return shlex.join(serve_bench_argv(cfg, base_url, "MODEL_ID", "C", cfg.waves, "OUT.json"))


def run_serve_bench(
    cfg: BenchConfig, target: Target, argv: list[str], out: Path, abortable: bool
) -> tuple[dict[str, Any] | None, CpuWindow]:
    """Run serve-bench (output appended to ``<server>.serve-bench.log``) and
    return its one level record with the CPU other processes took meanwhile.
    When ``abortable``, sustained contention kills it (record None)."""
    out.unlink(missing_ok=True)
    log_path = cfg.log_dir / f"{target.name}.serve-bench.log"
    before = cpu_sample(target.pgid)
    with log_path.open("ab") as log:
        log.write(f"$ {shlex.join(argv)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        previous, streak = before, 0
        while proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1.0)
            now = cpu_sample(target.pgid, proc.pid)
            contended = cpu_window(previous, now).other_cores >= cfg.quiet_threshold
            previous, streak = now, streak + 1 if contended else 0
            if abortable and streak >= ABORT_WINDOWS:
                stop_process(proc, grace=5.0)
                return None, cpu_window(before, cpu_sample(target.pgid))
    except BaseException:
        if proc.poll() is None:
            stop_process(proc, grace=5.0)
        raise
    window = cpu_window(before, cpu_sample(target.pgid))
    if proc.returncode != 0 or not out.exists():
        last = " ".join(log_tail(log_path, 3).split()) or "no output"
        raise RuntimeError(f"serve-bench exited with code {proc.returncode}: {last}")
    records: list[dict[str, Any]] = json.loads(out.read_text())
    return records[0], window


def measure_level(
    cfg: BenchConfig, target: Target, level: int, waves: int, what: str = ""
) -> LevelResult:
    """One serve-bench run of ``waves`` waves at ``level``. A run during which
    other processes took ``quiet_threshold`` cores or more is aborted or
    discarded and redone (``level_retries`` times at most) after waiting for a
    quiet machine; the last attempt always runs to the end and is kept."""
    out = cfg.log_dir / f"{target.name}.serve-bench.json"
    argv = serve_bench_argv(cfg, target.base_url, target.model_id, level, waves, str(out))
    gate = cfg.quiet_threshold > 0
    label = f"{target.name}: {what or f'c={level}'}"
    discarded: list[dict[str, Any]] = []
    attempt = 0
    while True:
        if gate:
            wait_quiet(target.pgid, cfg.quiet_threshold, cfg.quiet_wait, target.name)
        last = attempt == cfg.level_retries
        record, window = run_serve_bench(cfg, target, argv, out, abortable=gate and not last)
        load = f"other processes took {window.other_cores:.2f} cores"
        if record is None:
            console.log(f"[yellow]{label}: aborted, {load}[/yellow]")
        else:
            console.log(
                f"{label}: {tok_s_cell(record)} tok/s, TTFT p95 {fmt(record['ttft_p95'], 3)} s, "
                f"{record['http_errors']} error(s), {load}"
            )
            if not (gate and window.other_cores >= cfg.quiet_threshold and not last):
                return LevelResult(
                    level, record, argv, window.other_cores, window.steal_cores, attempt,
                    discarded,
                )  # fmt: skip
            console.log(f"[yellow]{label}: discarding the contended run[/yellow]")
            discarded.append(record)
        attempt += 1


def bench_server(name: str, cfg: BenchConfig, args: argparse.Namespace) -> ServerResult:
    """Start one server, warm it up and measure it with serve-bench, stop it."""
    port = free_port(cfg.host)
    spec = make_spec(name, cfg, port, args)
    result = ServerResult(name=name, command=spec.argv, version=version_of(spec))
    log_path = cfg.log_dir / f"{name}.log"
    result.log_file = str(log_path)
    (cfg.log_dir / f"{name}.serve-bench.log").unlink(missing_ok=True)
    base_url = f"http://{cfg.host}:{port}"
    console.rule(f"{name}")
    console.log("command: " + escape(shlex.join(spec.argv)))
    try:
        with running_server(spec, log_path) as proc:
            result.startup_s = wait_ready(proc, base_url, spec.ready_path, cfg.startup_timeout)
            model_id = args.model_id or served_model_id(base_url)
            result.model_id = model_id
            console.log(f"{name}: ready after {result.startup_s:.1f} s, model id {model_id!r}")
            target = Target(name, base_url + "/v1", model_id, proc.pid)
            result.warmup = measure_level(cfg, target, 1, 1, "warm-up")
            if result.warmup.record["http_errors"]:
                raise RuntimeError("warm-up request failed (see the serve-bench log)")
            for level in cfg.levels:
                result.levels.append(measure_level(cfg, target, level, cfg.waves))
            if name == BUTTER:
                result.log_notes += butter_choices(base_url)
            result.ok = True
    except (OSError, RuntimeError, TimeoutError, httpx.HTTPError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        console.log(f"[red]{name}: failed: {escape(result.error)}[/red]")
        console.log(escape(log_tail(log_path)))
    result.log_notes = log_notes(log_path) + result.log_notes
    return result


def butter_choices(base_url: str) -> list[str]:
    """What butter chose while it ran (its /v1/server): the step shape per number of decode
    rows, which output projection computes the logits, and who multiplies the layers' Q8_0
    and Q6_K matrices. The c=1 cells move with the one-row choice, so a round should say
    which one served."""
    try:
        meta = httpx.get(f"{base_url}/v1/server", timeout=10).json()["model"]["meta"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return ["/v1/server: unreadable after the run"]
    kernels = meta.get("kernels") or {}
    return [f"after the run: step shapes {meta.get('step_shapes')}, output projection "
            f"{meta.get('lm_head')}, layer matmuls {meta.get('layer_matmuls')}",
            f"kernels by layer matrix type: {kernels.get('layers')}"]


# ------------------------------------------------------------------- reports


def fmt(value: float | None, digits: int = 2) -> str:
    """A number for a table cell, or an em dash."""
    return "—" if value is None else f"{value:.{digits}f}"


def no_usage(record: dict[str, Any]) -> bool:
    """True when the server sent no usage chunk: serve-bench then counted content
    deltas as completion tokens and has no prompt token counts."""
    return int(record.get("usage_missing", 0)) > 0


def tok_s(record: dict[str, Any]) -> float | None:
    """serve-bench's completion tok/s (counted deltas when the server sent no usage)."""
    return float(record["completion_tok_s"])


def tok_s_cell(record: dict[str, Any]) -> str:
    cell = fmt(tok_s(record), 1)
    return f"{cell} (deltas)" if no_usage(record) else cell


def per_ok_request(record: dict[str, Any], key: str) -> str:
    """``record[key]`` per successful request; prompt tokens are n/a without usage."""
    ok = record["requests"] - record["http_errors"]
    if no_usage(record) and key != "completion_tokens":
        return "n/a"
    return fmt(record[key] / ok if ok else None, 1)


def errors_cell(record: dict[str, Any]) -> str:
    """HTTP errors, with serve-bench's other failure counts when not zero."""
    others = [
        f"{record[key]} {label}"
        for key, label in (
            ("marker_leaks", "leaked"), ("empty_responses", "empty"), ("invalid_utf8", "bad UTF-8")
        )
        if record[key]
    ]  # fmt: skip
    return str(record["http_errors"]) + (f" ({', '.join(others)})" if others else "")


def level_of(result: ServerResult, level: int) -> LevelResult | None:
    """The result for ``level``, if that server measured it."""
    return next((s for s in result.levels if s.level == level), None)


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is zero."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def other_load_cell(s: LevelResult) -> str:
    """Other processes' load, with the number of contended runs redone."""
    redone = f" ({s.redone} redone)" if s.redone else ""
    return fmt(s.other_cores, 2) + redone


def results_rows(results: Sequence[ServerResult]) -> list[list[str]]:
    """Table rows: one per server and level."""
    rows: list[list[str]] = []
    for res in results:
        if not res.ok and not res.levels:
            rows.append([res.name, "—", "failed", *["—"] * 6, (res.error or "")[:80]])
            continue
        for s in res.levels:
            r = s.record
            rows.append([
                res.name,
                str(s.level),
                tok_s_cell(r),
                fmt(r["ttft_p50"], 3),
                fmt(r["ttft_p95"], 3),
                fmt(r["latency_p95"], 2),
                per_ok_request(r, "completion_tokens"),
                per_ok_request(r, "prompt_tokens"),
                other_load_cell(s),
                errors_cell(r),
            ])  # fmt: skip
    return rows


RESULT_HEADERS = [
    "server",
    "c",
    "agg tok/s",
    "TTFT p50 (s)",
    "TTFT p95 (s)",
    "latency p95 (s)",
    "tok/req",
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
            if mine and base:
                tok = ratio(tok_s(mine.record), tok_s(base.record))
                p95 = ratio(mine.record["ttft_p95"], base.record["ttft_p95"])
                row += [fmt(tok, 2), fmt(p95, 2)]
            else:
                row += ["—", "—"]
        rows.append(row)
    return rows


RATIO_HEADERS = [
    "c",
    "tok/s vs llama-server",
    "TTFT p95 vs llama-server",
    "tok/s vs llama-cpp-python",
    "TTFT p95 vs llama-cpp-python",
]


def report_notes(results: Sequence[ServerResult]) -> list[str]:
    """Caveats the tables need."""
    return [
        f"{r.name} sent no usage chunk in its streams (llama-cpp-python's server ignores "
        "`stream_options.include_usage`), so serve-bench counted its content deltas (one "
        "per token on that server) as completion tokens, marked \"(deltas)\"; its prompt "
        "tokens are n/a."
        for r in results
        if any(no_usage(s.record) for s in r.levels)
    ]


def print_tables(results: Sequence[ServerResult], levels: Sequence[int]) -> None:
    """Rich tables on the terminal."""
    out = Console() if sys.stdout.isatty() else Console(width=150)
    table = Table(title="Streaming throughput (butter serve-bench)")
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
    for note in report_notes(results):
        out.print("Note: " + escape(note.replace("`", "")))


def markdown_report(
    title: str,
    cfg: BenchConfig,
    results: Sequence[ServerResult],
    meta: dict[str, Any],
    model_notes: Sequence[str] = (),
) -> str:
    """The markdown section: setup, commands, results, ratios, notes;
    ``model_notes`` are bullets after the model's."""
    m = meta["machine"]
    mem = f", {m['mem_total_gib']:.0f} GiB RAM" if m["mem_total_gib"] else ""
    lines = [
        f"## {title}",
        "",
        f"- Date: {meta['date']}",
        (
            f"- Machine: nproc {m['nproc']}, CPU {m.get('cpu_class', m['cpu_model'])}{mem}, "
            f"Linux {m['kernel']}; load average {m['loadavg_at_start'][0]:.2f} at start"
            + (f"; run as: {m['run_as']}" if m.get("run_as") else "")
        ),
        f"- Repository commit: {meta['git_commit'] or 'none'}",
        f"- Model: `{cfg.model}`",
        *(f"- {note}" for note in model_notes),
        (
            f"- Workload: concurrency levels {', '.join(map(str, cfg.levels))}; "
            f"{cfg.waves} synchronized waves per level; each request a unique prompt, "
            f"`max_tokens` {cfg.max_tokens}, `temperature` {cfg.temperature}, "
            f"`top_p` {cfg.top_p}, `stream: true`, `stream_options.include_usage`; "
            "servers run one at a time. Measurement: `butter serve-bench`, one run per "
            "server and level after a warm-up run (c=1, one wave): "
            f"`{serve_bench_template(cfg)}` (PORT: the server's port, MODEL_ID: its model "
            "id below, C: the level)."
        ),
        (
            "- Columns are serve-bench's record for the level: agg tok/s = `completion_tok_s` "
            "(usage completion tokens of all waves / sum of wave wall times); TTFT = time to "
            "the first non-empty content delta; latency p95 = whole-request p95; tok/req and "
            "prompt tok/req = usage tokens per successful request; errors = `http_errors`. "
            "Other load = mean CPU cores used during the kept run by processes other than "
            "the server and serve-bench (from /proc; above ~0.1 the numbers are disturbed, "
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
    notes = report_notes(results)
    if notes:
        lines += ["", "### Notes", "", *(f"- {note}" for note in notes)]
    log_lines = [(r.name, n) for r in results for n in r.log_notes]
    if log_lines:
        lines += ["", "### Server log notes", ""]
        lines += [f"- {name}: `{note}`" for name, note in log_lines]
    return "\n".join(lines) + "\n"


def write_json(
    path: Path, cfg: BenchConfig, results: Sequence[ServerResult], meta: dict[str, Any]
) -> None:
    """Raw numbers: serve-bench's records, discarded runs included."""
    doc = {
        "meta": meta,
        "config": {**asdict(cfg), "log_dir": str(cfg.log_dir)},
        "serve_bench": serve_bench_template(cfg),
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


def name_list(text: str) -> tuple[str, ...]:
    """Comma-separated names (checked against the matrix when it is built)."""
    names = tuple(v.strip() for v in text.split(",") if v.strip())
    if not names:
        raise argparse.ArgumentTypeError("need at least one name")
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
        help="before each serve-bench run wait until other processes use fewer cores than "
        "this, and redo runs disturbed by more (0 disables)",
    )
    p.add_argument("--quiet-wait", type=float, default=300.0, help="max seconds per quiet wait")
    p.add_argument(
        "--level-retries",
        "--wave-retries",
        type=int,
        default=5,
        help="reruns of a contended serve-bench run",
    )
    p.add_argument(
        "--butter-cmd",
        default=DEFAULT_BUTTER_CMD,
        help="template; placeholders {model} {host} {port} {parallel} {threads} {ctx_per_slot} "
        "{template_flags} (--chat-template gemma, or nothing for a --matrix model with its "
        "own chat template)",
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
    p.add_argument("--print-commands", action="store_true", help="print the commands and exit")
    p.add_argument(
        "--matrix",
        action="store_true",
        help="run the comparison for the demo GGUF (or --model) and every model of "
        "benchmarks/model_matrix.py, one markdown section each, then a ratio summary",
    )
    p.add_argument(
        "--matrix-only",
        type=name_list,
        metavar="NAME,...",
        help=f"implies --matrix: only these models ({DEMO}, a matrix model, or a shape "
        "for all its quantizations)",
    )
    p.add_argument(
        "--matrix-dir",
        type=Path,
        help="where the matrix models are cached (default: model_matrix.py's, "
        "~/.cache/butter-bench/models)",
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
        level_retries=args.level_retries,
        log_dir=args.log_dir,
    )


def run_all(cfg: BenchConfig, args: argparse.Namespace) -> list[ServerResult]:
    """Benchmark the selected servers one after another."""
    cfg.log_dir.mkdir(parents=True, exist_ok=True)
    results: list[ServerResult] = []
    for i, name in enumerate(args.only):
        if i and cfg.cooldown > 0:
            time.sleep(cfg.cooldown)
        results.append(bench_server(name, cfg, args))
    return results


# --------------------------------------------------------------------- matrix


@dataclass(frozen=True)
class MatrixEntry:
    """One model of a --matrix run."""

    name: str
    path: str
    embedded_template: bool
    notes: tuple[str, ...]


def matrix_entries(args: argparse.Namespace, demo_path: str) -> list[MatrixEntry]:
    """The demo GGUF (or --model) and the matrix models, as selected by --matrix-only.
    Matrix files are written first if missing (not for --print-commands). The
    template choice comes from each file's metadata."""
    from benchmarks import model_matrix as mm
    only = set(args.matrix_only or ())
    matrix_only = sorted(only - {DEMO, INSTRUCT})
    try:
        mm.selected(matrix_only)
    except ValueError as exc:
        raise SystemExit(f"--matrix-only: {exc}; or {DEMO} (the demo GGUF), or {INSTRUCT}"
                         ) from None
    entries: list[MatrixEntry] = []
    if not only or DEMO in only:
        embedded = mm.has_chat_template(Path(demo_path))
        entries.append(MatrixEntry(DEMO, demo_path, embedded, ()))
    if not only or INSTRUCT in only:
        from butter.models import bundled_model

        bundled = bundled_model(INSTRUCT)
        if bundled is not None and bundled.installed():
            path = bundled.path()
            note = (f"The real {bundled.summary} (the demo extra's `{INSTRUCT}`), "
                    f"{path.stat().st_size / 1e6:.0f} MB, its own chat template")
            entries.append(MatrixEntry(INSTRUCT, str(path), True, (note,)))
    if only and not matrix_only:
        return entries
    out_dir = args.matrix_dir or mm.DEFAULT_DIR
    write = not args.print_commands
    for model in mm.matrix_models(out_dir, matrix_only or None, write=write):
        if not model.path.exists():  # --print-commands before the files are written
            note = f"Matrix model `{model.name}` (not written yet)"
            entries.append(MatrixEntry(model.name, str(model.path), model.chat_template, (note,)))
            continue
        embedded = mm.has_chat_template(model.path)
        types = mm.tensor_types(model.path)
        note = (
            f"Matrix model `{model.name}` (benchmarks/model_matrix.py: random weights, the "
            f"real model's shape): {model.path.stat().st_size / 1e6:.0f} MB, output matrix "
            f"{types['output']}, chat template {'embedded' if embedded else 'none'}"
        )
        entries.append(MatrixEntry(model.name, str(model.path), embedded, (note,)))
    return entries


def summary_title(baseline: str) -> str:
    return f"butter / {baseline} per model (tok/s: higher is better; TTFT: lower)"


def summary_headers(levels: Sequence[int]) -> list[str]:
    return ["model", *(f"tok/s c={c}" for c in levels), f"TTFT p95 c={max(levels)}"]


def summary_baselines(runs: Sequence[tuple[MatrixEntry, Sequence[ServerResult]]]) -> list[str]:
    """The baselines that ran beside butter in a matrix run, llama-server first."""
    ran = {r.name for _, results in runs for r in results}
    return [name for name in (LLAMA_SERVER, LCP) if name in ran and BUTTER in ran]


def summary_rows(
    runs: Sequence[tuple[MatrixEntry, Sequence[ServerResult]]],
    levels: Sequence[int],
    baseline: str = LLAMA_SERVER,
) -> list[list[str]]:
    """Per model: butter's tok/s over the baseline's at each level, and the TTFT p95
    ratio at the highest level."""
    rows: list[list[str]] = []
    for entry, results in runs:
        by_name = {r.name: r for r in results}
        mine_res, base_res = by_name.get(BUTTER), by_name.get(baseline)
        row = [entry.name]
        for level in levels:
            mine = level_of(mine_res, level) if mine_res else None
            base = level_of(base_res, level) if base_res else None
            row.append(fmt(ratio(tok_s(mine.record), tok_s(base.record)), 2)
                       if mine and base else "—")  # fmt: skip
        mine = level_of(mine_res, max(levels)) if mine_res else None
        base = level_of(base_res, max(levels)) if base_res else None
        row.append(fmt(ratio(mine.record["ttft_p95"], base.record["ttft_p95"]), 2)
                   if mine and base else "—")  # fmt: skip
        rows.append(row)
    return rows


def print_summary(
    runs: Sequence[tuple[MatrixEntry, Sequence[ServerResult]]], levels: Sequence[int]
) -> None:
    out = Console() if sys.stdout.isatty() else Console(width=150)
    for baseline in summary_baselines(runs):
        table = Table(title=summary_title(baseline))
        for header in summary_headers(levels):
            table.add_column(header, justify="left" if header == "model" else "right")
        for row in summary_rows(runs, levels, baseline):
            table.add_row(*row)
        out.print(table)


def summary_markdown(
    title: str, runs: Sequence[tuple[MatrixEntry, Sequence[ServerResult]]], levels: Sequence[int]
) -> str:
    """One ratio table per baseline that ran (llama-cpp-python's tok/s are its content
    deltas: it sends no usage in streams)."""
    lines: list[str] = []
    for baseline in summary_baselines(runs):
        lines += [
            f"## {title}: {summary_title(baseline)}",
            "",
            "One row per model of the sections above (same run): butter's `completion_tok_s` "
            f"over {baseline}'s at each concurrency level, and butter's TTFT p95 over "
            f"{baseline}'s at c={max(levels)}. — where either server has no number.",
            "",
            md_table(summary_headers(levels), summary_rows(runs, levels, baseline)),
            "",
        ]
    return "\n".join(lines)


def write_matrix_json(
    path: Path,
    runs: Sequence[tuple[MatrixEntry, BenchConfig, Sequence[ServerResult]]],
    meta: dict[str, Any],
    levels: Sequence[int],
) -> None:
    """Raw numbers of a --matrix run: per model its config and serve-bench's records."""
    pairs = [(e, r) for e, _, r in runs]
    doc = {
        "meta": meta,
        "models": [
            {
                **asdict(entry),
                "config": {**asdict(cfg), "log_dir": str(cfg.log_dir)},
                "serve_bench": serve_bench_template(cfg),
                "servers": [asdict(r) for r in results],
            }
            for entry, cfg, results in runs
        ],
        "summary": {
            baseline: {
                "headers": summary_headers(levels),
                "rows": summary_rows(pairs, levels, baseline),
            }
            for baseline in summary_baselines(pairs)
        },
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")


def print_commands(cfg: BenchConfig, args: argparse.Namespace, stdout: TextIO) -> None:
    print("# --port 0 stands for the free port picked at run time", file=stdout)
    for name in args.only:
        print(shlex.join(make_spec(name, cfg, 0, args).argv), file=stdout)
    print("# each server is measured once per level C with:", file=stdout)
    print(serve_bench_template(cfg), file=stdout)


def run_matrix(cfg: BenchConfig, args: argparse.Namespace, stdout: TextIO) -> int:
    """The comparison for every model of the matrix, one after another."""
    entries = matrix_entries(args, cfg.model)
    configs = [
        (e, replace(cfg, model=e.path, embedded_template=e.embedded_template,
                    log_dir=cfg.log_dir / e.name))
        for e in entries
    ]  # fmt: skip
    if args.print_commands:
        for entry, model_cfg in configs:
            template = "embedded" if entry.embedded_template else "none (gemma flags)"
            print(f"# model {entry.name}: {entry.path} (chat template: {template})", file=stdout)
            print_commands(model_cfg, args, stdout)
        return 0
    meta = run_meta()
    title = args.title or f"Throughput comparison, {meta['date']}"
    runs: list[tuple[MatrixEntry, BenchConfig, list[ServerResult]]] = []
    for i, (entry, model_cfg) in enumerate(configs):
        if i and cfg.cooldown > 0:
            time.sleep(cfg.cooldown)
        console.rule(f"model {entry.name}")
        results = run_all(model_cfg, args)
        runs.append((entry, model_cfg, results))
        print_tables(results, model_cfg.levels)
        if args.markdown:
            section = markdown_report(
                f"{title}: {entry.name}", model_cfg, results, meta, entry.notes
            )
            write_markdown(args.markdown, section)
            console.log(f"markdown for {entry.name} appended to {args.markdown}")
    pairs = [(e, r) for e, _, r in runs]
    print_summary(pairs, cfg.levels)
    if args.markdown:
        summary = summary_markdown(title, pairs, cfg.levels)
        write_markdown(args.markdown, summary)
        console.log(f"summary appended to {args.markdown}")
    if args.json:
        write_matrix_json(args.json, runs, meta, cfg.levels)
        console.log(f"raw numbers written to {args.json}")
    return 0 if all(r.ok for _, _, results in runs for r in results) else 1


def main(argv: Sequence[str] | None = None, stdout: TextIO = sys.stdout) -> int:
    args = parse_args(argv)
    cfg = make_config(args)
    if args.matrix or args.matrix_only:
        return run_matrix(cfg, args, stdout)
    if args.print_commands:
        print("# --port 0 stands for the free port picked at run time", file=stdout)
        for name in args.only:
            print(shlex.join(make_spec(name, cfg, 0, args).argv), file=stdout)
        print("# each server is measured once per level C with:", file=stdout)
        print(serve_bench_template(cfg), file=stdout)
        return 0
    meta = run_meta()
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
