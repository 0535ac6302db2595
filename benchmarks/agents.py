#!/usr/bin/env python3
"""Agent-shaped workloads, butter vs llama-server, each measured by ``butter serve-bench``.

Two workloads, every server started on its own (never two at once) with the same KV
size, slots and threads:

* replay: a coding agent's recorded conversations (``benchmarks/agent_workload.py``: a
  shared ~4k-token stem of system prompt and tool schemas, then per conversation a task,
  tool calls and tool results, each request resending the history) replayed by
  ``serve-bench --replay`` at each level (default c=4 and c=8): completion tok/s,
  requests/s, TTFT, latency, prompt tokens per request and the share of prompt tokens
  the server reports as cached (prefix reuse across turns and conversations);
* long arrival: C sessions stream long answers, then one request with a unique ~16k-token
  prompt arrives (``serve-bench --long-arrival``): its TTFT, and the sessions' aggregate
  tok/s before, during its prefill and after, and how many sessions got nothing while it
  prefilled (chunked prefill keeps them flowing; a monolithic prefill starves them).

Chat template: read from the GGUF (``tokenizer.chat_template``). With one, both servers
use it (llama-server ``--jinja``). Without one (the demo GGUF), butter uses its built-in
template for the architecture (``--chat-template gemma``) and describes tools with its
tools preamble; llama-server refuses ``tools`` without ``--jinja``, so it gets
``--jinja --chat-template-file`` with the same built-in template and the same preamble
written as jinja (``*.template.jinja`` in the log folder): both servers see the same
prompt text, which the per-request prompt token counts in the report confirm.

Usage (from the repository root)::

    benchmarks/build_llama_server.sh
    python benchmarks/agents.py --markdown benchmarks/RESULTS.md --json /tmp/agents.json
    python benchmarks/agents.py --only butter --levels 4 --conversations 4 --turns 3 \\
        --arrival-tokens 4000 --arrival-answer-tokens 64          # a quick smoke run
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: the repository root, not benchmarks/, on sys.path
    import _repo_root  # noqa: F401

import httpx
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from benchmarks import agent_workload
from benchmarks.harness import (
    BUILD,
    DEFAULT_LLAMA_SERVER_BIN,
    SERVE_BENCH,
    VENV_PYTHON,
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
    version_of,
    wait_quiet,
    wait_ready,
    write_markdown,
)
from butter.chat.template import (
    builtin_for_architecture,
    builtin_template_source,
    tools_preamble,
)

BUTTER = "butter"
LLAMA_SERVER = "llama-server"
SERVERS = (BUTTER, LLAMA_SERVER)
WORKLOADS = ("replay", "arrival")

def jinja_literal(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


def tools_preamble_jinja() -> str:
    """butter's tools preamble (butter/chat/template.py: tools_preamble, merged into the
    first system message as with_tools_preamble does) as jinja, to put before a built-in
    template for llama-server."""
    sentinel = {"sentinel": True}
    head, tail = tools_preamble([sentinel]).split(json.dumps(sentinel))
    return (
        "{#- butter's tools preamble, merged into the first system message -#}\n"
        "{%- if tools -%}\n"
        "  {%- set ns = namespace(lines=[]) -%}\n"
        "  {%- for tool in tools -%}{%- set ns.lines = ns.lines + [tool | tojson] -%}"
        "{%- endfor -%}\n"
        f"  {{%- set preamble = {jinja_literal(head)} ~ (ns.lines | join('\\n')) ~ "
        f"{jinja_literal(tail)} -%}}\n"
        "  {%- if messages and messages[0]['role'] in ['system', 'developer'] -%}\n"
        "    {%- set messages = [{'role': messages[0]['role'], 'content': "
        "((messages[0]['content'] or '') ~ '\\n\\n' ~ preamble) | trim}] + messages[1:] -%}\n"
        "  {%- else -%}\n"
        "    {%- set messages = [{'role': 'system', 'content': preamble}] + messages -%}\n"
        "  {%- endif -%}\n"
        "{%- endif -%}\n"
    )


@dataclass(frozen=True)
class Config:
    model: str
    host: str
    levels: tuple[int, ...]
    conversations: int
    turns: int
    seed: int
    replay_max_tokens: int
    arrival_tokens: int
    arrival_sessions: int
    arrival_answer_tokens: int
    arrival_max_tokens: int
    arrival_settle: float
    arrival_after: float
    temperature: float
    top_p: float
    parallel: int
    threads: int
    kv_size: int
    max_context: int
    request_timeout: float
    startup_timeout: float
    quiet_threshold: float
    quiet_wait: float
    log_dir: Path


@dataclass
class Run:
    """One serve-bench run: its records, the CPU other processes took meanwhile."""

    workload: str
    command: list[str]
    records: list[dict[str, Any]] = field(default_factory=list)
    other_cores: float | None = None
    error: str | None = None


@dataclass
class ServerResult:
    name: str
    command: list[str]
    template: str
    version: str | None = None
    model_id: str | None = None
    startup_s: float | None = None
    runs: list[Run] = field(default_factory=list)
    error: str | None = None
    log_file: str | None = None

    def records(self, workload: str) -> list[dict[str, Any]]:
        return [r for run in self.runs if run.workload == workload for r in run.records]


# ------------------------------------------------------------------ templates


def gguf_string(path: str, key: str) -> str | None:
    """A string field of the GGUF's header, None if absent."""
    import gguf

    reader = gguf.GGUFReader(path)
    entry = reader.fields.get(key)
    if entry is None or not entry.data:
        return None
    return bytes(entry.parts[entry.data[0]]).decode("utf-8")


@dataclass(frozen=True)
class TemplatePlan:
    """Template flags for each server, decided from the GGUF's own metadata."""

    description: str
    butter_args: list[str]
    llama_server_args: list[str]


def template_plan(model: str, log_dir: Path) -> TemplatePlan:
    if gguf_string(model, "tokenizer.chat_template"):
        return TemplatePlan("the GGUF's own chat template (llama-server --jinja)", [],
                            ["--jinja"])
    architecture = gguf_string(model, "general.architecture") or ""
    name = builtin_for_architecture(architecture)
    path = log_dir / f"{name}.template.jinja"
    log_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(tools_preamble_jinja() + builtin_template_source(name))
    return TemplatePlan(
        f"no template in the GGUF: butter's built-in {name!r} and its tools preamble; "
        f"llama-server --jinja with the same as a file",
        ["--chat-template", name], ["--jinja", "--chat-template-file", str(path)],
    )


# -------------------------------------------------------------------- servers


def butter_spec(cfg: Config, port: int, plan: TemplatePlan) -> ServerSpec:
    """butter: --kv-pool is the KV cells all sessions share; --max-context one request's."""
    argv = [
        VENV_PYTHON, "-m", "butter.cli", "serve", "--model", cfg.model,
        "--host", cfg.host, "--port", str(port),
        "--parallel", str(cfg.parallel), "--threads", str(cfg.threads),
        "--max-context", str(cfg.max_context), "--kv-pool", str(cfg.kv_size),
        *plan.butter_args,
    ]  # fmt: skip
    return ServerSpec(BUTTER, argv, "/health", [VENV_PYTHON, "-m", "pip", "show", "butter"])


def llama_server_spec(cfg: Config, port: int, binary: Path, plan: TemplatePlan) -> ServerSpec:
    """llama-server: with -np N the cache is split into N slots of -c / N tokens unless
    --kv-unified, which lets any slot use all -c cells (a 16k prompt fits)."""
    argv = llama_server_argv(binary, cfg.model, cfg.host, port, slots=cfg.parallel,
                             threads=cfg.threads, context=cfg.kv_size,
                             extra=["--kv-unified", *plan.llama_server_args])
    return ServerSpec(LLAMA_SERVER, argv, "/health", [str(binary), "--version"])


def make_spec(name: str, cfg: Config, port: int, args: argparse.Namespace,
              plan: TemplatePlan) -> ServerSpec:
    if name == BUTTER:
        return butter_spec(cfg, port, plan)
    return llama_server_spec(cfg, port, Path(args.llama_server_bin), plan)


# ------------------------------------------------------------------ measuring


def bench_argv(cfg: Config, workload: str, base_url: str, model_id: str, replay: Path,
               out: Path) -> list[str]:
    common = [
        *SERVE_BENCH, "--model", model_id, "--base-url", base_url,
        "--temperature", str(cfg.temperature), "--top-p", str(cfg.top_p),
        "--timeout", str(cfg.request_timeout), "--json", str(out),
    ]  # fmt: skip
    if workload == "warmup":
        return [*common, "--concurrency", "1", "--waves", "1", "--max-tokens", "8"]
    if workload == "stem-warmup":
        return [*common, "--replay", str(replay.with_suffix(".warmup.jsonl")),
                "--concurrency", "1", "--max-tokens", "8", "--replay-tag", "[warm-up] "]
    if workload == "replay":
        return [*common, "--replay", str(replay),
                "--concurrency", ",".join(map(str, cfg.levels)),
                "--max-tokens", str(cfg.replay_max_tokens)]
    return [
        *common, "--long-arrival", str(cfg.arrival_tokens),
        "--concurrency", str(cfg.arrival_sessions),
        "--max-tokens", str(cfg.arrival_answer_tokens),
        "--arrival-max-tokens", str(cfg.arrival_max_tokens),
        "--arrival-settle", str(cfg.arrival_settle), "--arrival-after", str(cfg.arrival_after),
    ]  # fmt: skip


def run_bench(cfg: Config, name: str, workload: str, argv: list[str], out: Path,
              pgid: int) -> Run:
    """serve-bench as a child process (its output appended to <server>.serve-bench.log)."""
    run = Run(workload, argv)
    out.unlink(missing_ok=True)
    log_path = cfg.log_dir / f"{name}.serve-bench.log"
    wait_quiet(pgid, cfg.quiet_threshold, cfg.quiet_wait)
    before = cpu_sample(pgid)
    with log_path.open("ab") as log:
        log.write(f"$ {shlex.join(argv)}\n".encode())
        log.flush()
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=log,
                              stderr=subprocess.STDOUT, check=False)
    run.other_cores = cpu_window(before, cpu_sample(pgid)).other_cores
    if done.returncode != 0 or not out.exists():
        run.error = (f"serve-bench exited with code {done.returncode}: "
                     + " ".join(log_tail(log_path, 3).split()))
    else:
        run.records = json.loads(out.read_text())
    return run


def summary_line(run: Run) -> str:
    load = f"other processes {run.other_cores or 0:.2f} cores"
    if run.error:
        return f"{run.workload}: failed: {run.error}"
    if run.workload == "replay":
        parts = [f"c={r['concurrency']} {r['completion_tok_s']:.1f} tok/s, TTFT p50 "
                 f"{fmt(r['ttft_p50'], 2)} s, cached {pct(r['cached_share'])}, "
                 f"{r['http_errors']} err" for r in run.records]
        return "replay: " + "; ".join(parts) + f"; {load}"
    if run.workload == "arrival":
        r = run.records[0]
        return (f"arrival: long TTFT {fmt(r['long_ttft'], 2)} s, sessions "
                f"{fmt(r['before_tok_s'], 1)} → {fmt(r['during_tok_s'], 1)} → "
                f"{fmt(r['after_tok_s'], 1)} tok/s, starved {r['starved_sessions']}/"
                f"{r['concurrency']}; {load}")
    return f"{run.workload}: done; {load}"


def bench_server(name: str, cfg: Config, args: argparse.Namespace, plan: TemplatePlan,
                 replay: Path) -> ServerResult:
    port = free_port(cfg.host)
    spec = make_spec(name, cfg, port, args, plan)
    template = " ".join(plan.butter_args if name == BUTTER else plan.llama_server_args)
    result = ServerResult(name, spec.argv, template or "(the GGUF's)",
                          version=version_of(spec))
    log_path = cfg.log_dir / f"{name}.log"
    result.log_file = str(log_path)
    (cfg.log_dir / f"{name}.serve-bench.log").unlink(missing_ok=True)
    base = f"http://{cfg.host}:{port}"
    console.rule(name)
    console.log("command: " + escape(shlex.join(spec.argv)))
    try:
        with running_server(spec, log_path) as proc:
            result.startup_s = wait_ready(proc, base, spec.ready_path, cfg.startup_timeout)
            result.model_id = served_model_id(base)
            console.log(f"{name}: ready after {result.startup_s:.1f} s, model id "
                        f"{result.model_id!r}")
            warmups = ("warmup", "stem-warmup") if "replay" in args.workloads else ("warmup",)
            for workload in (*warmups, *args.workloads):
                out = cfg.log_dir / f"{name}.{workload}.json"
                argv = bench_argv(cfg, workload, base + "/v1", result.model_id, replay, out)
                run = run_bench(cfg, name, workload, argv, out, proc.pid)
                result.runs.append(run)
                console.log(f"{name}: " + escape(summary_line(run)))
                if workload in warmups and (run.error or run.records[0]["http_errors"]):
                    raise RuntimeError(f"{workload} failed (see the serve-bench log)")
    except (OSError, RuntimeError, TimeoutError, httpx.HTTPError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        console.log(f"[red]{name}: failed: {escape(result.error)}[/red]")
        console.log(escape(log_tail(log_path)))
    return result


# -------------------------------------------------------------------- reports


def fmt(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def ratio(a: float | None, b: float | None) -> str:
    return "—" if a is None or b is None or b == 0 else f"{a / b:.2f}×"


def retried(record: dict[str, Any]) -> str:
    """Requests serve-bench sent twice because the server dropped a reused connection."""
    count = int(record.get("retried", 0))
    return f" ({count} retried)" if count else ""


def by_level(result: ServerResult, workload: str) -> dict[int, dict[str, Any]]:
    return {int(r["concurrency"]): r for r in result.records(workload)}


REPLAY_HEADERS = ["server", "c", "tok/s", "req/s", "TTFT p50 s", "TTFT p95 s",
                  "latency p95 s", "prompt tok/req", "cached share", "errors"]


def replay_rows(results: Sequence[ServerResult]) -> list[list[str]]:
    rows = []
    for res in results:
        for level, r in sorted(by_level(res, "replay").items()):
            rows.append([
                res.name, str(level), fmt(r["completion_tok_s"], 1), fmt(r["requests_per_s"]),
                fmt(r["ttft_p50"]), fmt(r["ttft_p95"]), fmt(r["latency_p95"]),
                fmt(r["prompt_tokens_per_request"], 0),
                f"{pct(r['cached_share'])} ({r['cached_source']})",
                f"{r['http_errors']}/{r['requests']}" + retried(r),
            ])
    return rows


TURN_HEADERS = ["server", "c", "per turn: prompt tokens / cached share"]


def turn_rows(results: Sequence[ServerResult]) -> list[list[str]]:
    rows = []
    for res in results:
        for level, r in sorted(by_level(res, "replay").items()):
            cells = [f"{fmt(p, 0)} / {pct(s)}" for p, s in
                     zip(r["turn_prompt_tokens"], r["turn_cached_share"], strict=True)]
            rows.append([res.name, str(level), "; ".join(cells)])
    return rows


ARRIVAL_HEADERS = ["server", "sessions", "long prompt", "long TTFT s", "tok/s before",
                   "tok/s during prefill", "tok/s after", "during / before", "starved",
                   "longest stall s", "errors"]


def arrival_rows(results: Sequence[ServerResult]) -> list[list[str]]:
    rows = []
    for res in results:
        for r in res.records("arrival"):
            before, during = r["before_tok_s"], r["during_tok_s"]
            rows.append([
                res.name, str(r["concurrency"]),
                f"{r['long_prompt_tokens']} ({r['long_cached_tokens']} cached)",
                fmt(r["long_ttft"]), fmt(before, 1), fmt(during, 1), fmt(r["after_tok_s"], 1),
                pct(during / before) if before and during is not None else "—",
                f"{r['starved_sessions']}/{r['concurrency']}", fmt(r["longest_stall_s"]),
                str(r["session_errors"] + (1 if r["long_error"] else 0)) + retried(r),
            ])
    return rows


RATIO_HEADERS = ["workload", "tok/s", "req/s", "TTFT p50", "TTFT p95", "latency p95"]


def ratio_rows(results: Sequence[ServerResult]) -> list[list[str]]:
    """butter / llama-server; tok/s and req/s: higher is better, times: lower."""
    named = {r.name: r for r in results}
    if BUTTER not in named or LLAMA_SERVER not in named:
        return []
    mine, base = by_level(named[BUTTER], "replay"), by_level(named[LLAMA_SERVER], "replay")
    rows = []
    for level in sorted(set(mine) & set(base)):
        a, b = mine[level], base[level]
        rows.append([f"replay c={level}"] + [ratio(a[k], b[k]) for k in (
            "completion_tok_s", "requests_per_s", "ttft_p50", "ttft_p95", "latency_p95")])
    arrivals = [named[n].records("arrival") for n in (BUTTER, LLAMA_SERVER)]
    if all(arrivals):
        a, b = arrivals[0][0], arrivals[1][0]
        rows.append(["arrival (tok/s: the sessions' during the prefill; TTFT: the long "
                     "request's)", ratio(a["during_tok_s"], b["during_tok_s"]), "",
                     ratio(a["long_ttft"], b["long_ttft"]), "", ""])
    return rows


def tables(results: Sequence[ServerResult]) -> list[tuple[str, list[str], list[list[str]]]]:
    return [
        ("Replay (coding-agent conversations)", REPLAY_HEADERS, replay_rows(results)),
        ("Replay by turn (k-th request of each conversation)", TURN_HEADERS,
         turn_rows(results)),
        ("Long arrival", ARRIVAL_HEADERS, arrival_rows(results)),
        ("Ratios butter / llama-server (tok/s, req/s: higher is better; times: lower)",
         RATIO_HEADERS, ratio_rows(results)),
    ]


def print_tables(results: Sequence[ServerResult], out: Console) -> None:
    for title, headers, rows in tables(results):
        if not rows:
            continue
        table = Table(title=title)
        for header in headers:
            table.add_column(header, justify="right")
        for row in rows:
            table.add_row(*map(escape, row))
        out.print(table)


def markdown(title: str, cfg: Config, plan: TemplatePlan, workload_lines: Sequence[str],
             results: Sequence[ServerResult], meta: dict[str, Any]) -> str:
    m = meta["machine"]
    lines = [
        f"## {title}", "",
        f"- Date: {meta['date']}; repository commit {meta['git_commit'] or 'none'}",
        f"- Machine: nproc {m['nproc']}, CPU {m['cpu_model']}, load average "
        f"{m['loadavg_at_start'][0]:.2f} at start",
        f"- Model: `{cfg.model}`; chat template: {plan.description}",
        f"- Servers: {cfg.parallel} slots, {cfg.threads} threads, {cfg.kv_size} KV cells "
        f"shared by all slots (butter `--kv-pool`, llama-server `-c` with `--kv-unified`), "
        f"butter `--max-context {cfg.max_context}`; one server at a time, a warm-up request "
        "first, and before the replay one request with the shared stem (so the measured "
        "levels start with it cached, as an agent's would).",
        f"- Replay: `benchmarks/agent_workload.py --conversations {cfg.conversations} "
        f"--turns {cfg.turns} --seed {cfg.seed} --max-tokens {cfg.replay_max_tokens}` "
        f"({workload_lines[0]}), replayed by `serve-bench --replay` at c = "
        f"{', '.join(map(str, cfg.levels))} (C lanes, conversations dealt round-robin, request "
        "k+1 after response k; each level tags its conversations so it cannot reuse the "
        "previous level's; the stem stays shared). Cached share = cached prompt tokens / "
        "prompt tokens, as each server reports them.",
        f"- Long arrival: {cfg.arrival_sessions} sessions streaming "
        f"`max_tokens` {cfg.arrival_answer_tokens} answers back to back; "
        f"{cfg.arrival_settle:g} s after all have output, one request with a unique "
        f"~{cfg.arrival_tokens}-token prompt and `max_tokens` {cfg.arrival_max_tokens}. "
        "Before = those settle seconds, during = its send to its first token (the prefill), "
        f"after = {cfg.arrival_after:g} s from its first token; starved = sessions that "
        "received nothing during the prefill; longest stall = the longest gap without "
        "output of any session in it.",
        f"- Sampling: temperature {cfg.temperature}, top_p {cfg.top_p}; `stream: true` with "
        "usage.",
        "", "### Commands", "",
    ]
    for res in results:
        version = f" ({res.version})" if res.version else ""
        lines.append(f"- {res.name}{version}: `{shlex.join(res.command)}`")
        lines += [f"  - `{shlex.join(run.command)}` (other processes: "
                  f"{run.other_cores or 0:.2f} cores)" for run in res.runs
                  if "warmup" not in run.workload]
        if res.error:
            lines.append(f"  - failed: {res.error}")
    for title_, headers, rows in tables(results):
        if rows:
            lines += ["", f"### {title_}", "", md_table(headers, rows)]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------ CLI


def int_list(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(",") if v.strip())
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"need positive integers, got {text!r}")
    return values


def name_list(choices: Sequence[str]) -> Any:
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(v.strip() for v in text.split(",") if v.strip())
        if not names or any(n not in choices for n in names):
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)}")
        return names
    return parse


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="GGUF path (default: the demo GGUF, via its package)")
    p.add_argument("--only", type=name_list(SERVERS), default=SERVERS,
                   help="comma-separated subset of butter,llama-server")
    p.add_argument("--workloads", type=name_list(WORKLOADS), default=WORKLOADS,
                   help="comma-separated subset of replay,arrival")
    p.add_argument("--levels", type=int_list, default=(4, 8), help="replay concurrency")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=6, help="requests per conversation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replay-max-tokens", type=int, default=128)
    p.add_argument("--arrival-tokens", type=int, default=16000, help="the long prompt, about")
    p.add_argument("--arrival-sessions", type=int, default=4)
    p.add_argument("--arrival-answer-tokens", type=int, default=256,
                   help="the sessions' max_tokens")
    p.add_argument("--arrival-max-tokens", type=int, default=16,
                   help="the long request's max_tokens")
    p.add_argument("--arrival-settle", type=float, default=2.0)
    p.add_argument("--arrival-after", type=float, default=3.0)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--parallel", type=int, default=8, help="server slots")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-size", type=int, default=49152,
                   help="KV cells shared by all slots (butter --kv-pool, llama-server -c)")
    p.add_argument("--max-context", type=int, default=20480,
                   help="butter --max-context: one request's prompt + completion")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--request-timeout", type=float, default=900.0)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--quiet-threshold", type=float, default=0.25,
                   help="before each run wait until other processes use fewer cores (0: no)")
    p.add_argument("--quiet-wait", type=float, default=120.0)
    p.add_argument("--llama-server-bin", default=str(DEFAULT_LLAMA_SERVER_BIN))
    p.add_argument("--log-dir", type=Path, default=BUILD / "agents-logs")
    p.add_argument("--markdown", type=Path, help="append a markdown section here")
    p.add_argument("--title", help="markdown section heading")
    p.add_argument("--json", type=Path, help="write raw numbers here")
    p.add_argument("--print-commands", action="store_true", help="print the commands and exit")
    return p.parse_args(argv)


def make_config(args: argparse.Namespace) -> Config:
    return Config(
        model=args.model or resolve_model(VENV_PYTHON), host=args.host, levels=args.levels,
        conversations=args.conversations, turns=args.turns, seed=args.seed,
        replay_max_tokens=args.replay_max_tokens, arrival_tokens=args.arrival_tokens,
        arrival_sessions=args.arrival_sessions,
        arrival_answer_tokens=args.arrival_answer_tokens,
        arrival_max_tokens=args.arrival_max_tokens, arrival_settle=args.arrival_settle,
        arrival_after=args.arrival_after, temperature=args.temperature, top_p=args.top_p,
        parallel=args.parallel, threads=args.threads, kv_size=args.kv_size,
        max_context=args.max_context, request_timeout=args.request_timeout,
        startup_timeout=args.startup_timeout, quiet_threshold=args.quiet_threshold,
        quiet_wait=args.quiet_wait, log_dir=args.log_dir,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = make_config(args)
    cfg.log_dir.mkdir(parents=True, exist_ok=True)
    plan = template_plan(cfg.model, cfg.log_dir)
    replay = cfg.log_dir / "agent_workload.jsonl"
    records = agent_workload.build(cfg.conversations, cfg.turns, cfg.seed,
                                   cfg.replay_max_tokens)
    agent_workload.write(replay, records)
    # The stem warm-up: the first request of the first conversation, under its own tag.
    agent_workload.write(replay.with_suffix(".warmup.jsonl"),
                         [{"id": "warmup", "requests": records[0]["requests"][:1]}])
    workload_lines = agent_workload.summary(records)
    for line in workload_lines:
        console.log(line)
    console.log(f"chat template: {plan.description}")
    if args.print_commands:
        for name in args.only:
            print(shlex.join(make_spec(name, cfg, 0, args, plan).argv))
            for workload in args.workloads:
                print("  " + shlex.join(bench_argv(cfg, workload, f"http://{cfg.host}:PORT/v1",
                                                   "MODEL_ID", replay, Path("OUT.json"))))
        return 0
    meta = run_meta()
    results = []
    for i, name in enumerate(args.only):
        if i:
            time.sleep(3.0)
        results.append(bench_server(name, cfg, args, plan, replay))
    print_tables(results, Console(width=200))
    if args.json:
        doc = {"meta": meta, "config": {**asdict(cfg), "log_dir": str(cfg.log_dir)},
               "template": asdict(plan), "workload": workload_lines,
               "servers": [asdict(r) for r in results]}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    if args.markdown:
        title = args.title or f"Agent workloads: butter vs llama-server ({meta['date']})"
        write_markdown(args.markdown, markdown(title, cfg, plan, workload_lines, results, meta))
    return 0 if all(r.error is None and not any(run.error for run in r.runs)
                    for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
