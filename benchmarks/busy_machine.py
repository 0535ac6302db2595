#!/usr/bin/env python3
"""Decoding on a busy machine: each server quiet, beside one CPU-bound program at normal
priority, beside one at `nice 19`, and how fast it recovers when the program stops.

The other program is `python -c 'while True: pass'`, the stand-in for a build, a browser
tab or a second server taking one core. Workloads are speculation.py's (greedy, streamed):
``story`` on SmolLM2 (nothing to copy, so drafts do not blur the picture) by default.

Reported per server, client count and condition: decode tok/s per stream (tokens after the
first over the time after the first, the median of the streams and rounds), the aggregate
(all streams' tokens over the round's wall time) and each as a share of the same server's
quiet figure; butter's /v1/server thread count after the condition. The conditions run in
the order quiet, nice, busy (a niced program that follows a busy one finds butter's team
smaller, and is seen only at its next try). Recovery: with the program running, streams run
until the team has shrunk (or 3 rounds), the program is stopped 0.6 s into a long stream,
and its token times tell how long until tokens come at the stream's own pace again (the
first token from which every 32-token stretch runs at 85% or more of the rate of the
stream's last quarter).

Usage (from the repository root, after benchmarks/build_llama_server.sh)::

    python benchmarks/busy_machine.py --markdown /tmp/busy.md --json /tmp/busy.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: the repository root, not benchmarks/, on sys.path
    import _repo_root  # noqa: F401

import httpx

from benchmarks.harness import DEFAULT_LLAMA_SERVER_BIN, md_table, run_meta, wait_ready
from benchmarks.harness import free_port as _free_port
from benchmarks.speculation import (
    HOST,
    WORKLOADS,
    Server,
    Workload,
    running_server_spec,
    served_model,
    server_argv,
    server_named,
)

SPINNER = [sys.executable, "-c", "while True: pass"]
CONDITIONS = ("quiet", "nice", "busy")
RECOVERY_STRETCH = 32  # tokens
RECOVERY_SHARE = 0.85
RECOVERY_TOKENS = 400  # the stream during which the program stops...
RECOVERY_STOP_AFTER = 0.6  # ...this many seconds after it was sent


def start_spinner(nice: int) -> subprocess.Popen[bytes]:
    """The other program, in a session of its own, as a build started from another terminal
    is. Where the kernel groups each session's processes (sched autogroup, on by default on
    desktop Linux) a nice value only ranks a process within its own group, and the groups
    share the CPUs equally; so a niced program's group is niced too, as `nice` means it."""
    process = subprocess.Popen(["nice", "-n", str(nice), *SPINNER], stdin=subprocess.DEVNULL,
                               start_new_session=True)
    with contextlib.suppress(OSError):
        Path(f"/proc/{process.pid}/autogroup").write_text(str(nice))
    return process


@contextlib.contextmanager
def spinning(nice: int | None) -> Iterator[subprocess.Popen[bytes] | None]:
    """One CPU-bound program for the length of the block (none for nice=None)."""
    if nice is None:
        yield None
        return
    process = start_spinner(nice)
    try:
        time.sleep(0.3)  # (let it take its core before the first request)
        yield process
    finally:
        stop(process)


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGKILL)
        process.wait()


def stream_times(base: str, workload: Workload, variant: int, model: str,
                 budget: float = 1e9) -> dict[str, Any]:
    """One greedy stream: its completion tokens and when each piece of text arrived. A
    stream still running after `budget` seconds is closed there (a server decoding at
    0.5 tok/s would take minutes): its tokens are then the pieces received (a butter piece
    may hold more than one token: a rate that counts low)."""
    body = {"model": model, "max_tokens": workload.max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
            **workload.body(variant)}
    started = time.perf_counter()
    times: list[float] = []
    tokens = 0
    with httpx.Client(timeout=1800) as client, \
            client.stream("POST", f"{base}/v1/{workload.route}", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    times.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
            if time.perf_counter() - started > budget:
                tokens = len(times)
                break
    if not times:
        raise RuntimeError("the stream carried no text")
    decode = times[-1] - times[0]
    return {"started": started, "times": times, "tokens": tokens,
            "decode_tok_s": (tokens - 1) / decode if decode > 0 else None}


def one_round(base: str, workload: Workload, clients: int, model: str,
              budget: float = 1e9) -> dict[str, Any]:
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        streams = list(pool.map(lambda v: stream_times(base, workload, v, model, budget),
                                range(clients)))
    wall = time.perf_counter() - started
    return {"per_stream": [s["decode_tok_s"] for s in streams if s["decode_tok_s"]],
            "aggregate": sum(s["tokens"] for s in streams) / wall, "wall": wall}


def team(base: str) -> dict[str, Any] | None:
    """butter's compute team as /v1/server shows it (None for other servers)."""
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
        info = httpx.get(f"{base}/v1/server", timeout=10).json()
        threads: dict[str, Any] | None = info["engine"]["threads"]
        return threads
    return None


def measure_condition(base: str, workload: Workload, clients: int, model: str, rounds: int,
                      nice: int | None, budget: float) -> dict[str, Any]:
    with spinning(nice):
        done = [one_round(base, workload, clients, model, budget) for _ in range(rounds)]
        threads = team(base)
    per_stream = [rate for r in done for rate in r["per_stream"]]
    return {"per_stream": statistics.median(per_stream) if per_stream else None,
            "aggregate": statistics.median(r["aggregate"] for r in done),
            "walls": [round(r["wall"], 2) for r in done], "threads": threads}


def recovery_seconds(times: Sequence[float], stopped: float) -> float | None:
    """Seconds from `stopped` to the first token from which every stretch of
    RECOVERY_STRETCH tokens runs at RECOVERY_SHARE or more of the rate of the stream's
    last quarter (long after the stop: the rate at that context length on a quiet
    machine); None where the stream ended too soon to tell."""
    tail = times[len(times) * 3 // 4:]
    if len(tail) < RECOVERY_STRETCH or tail[0] <= stopped:
        return None
    rate = (len(tail) - 1) / (tail[-1] - tail[0])
    longest = RECOVERY_STRETCH / (RECOVERY_SHARE * rate)
    gaps_ok = [times[i + RECOVERY_STRETCH] - times[i] <= longest
               for i in range(len(times) - RECOVERY_STRETCH)]
    for i in range(len(gaps_ok)):
        if all(gaps_ok[i:]):
            return max(0.0, times[i] - stopped)
    return None


def measure_recovery(base: str, workload: Workload, model: str) -> dict[str, Any]:
    """The program runs until butter's team has shrunk (at most 3 streams; any server: 2),
    then stops while one stream is decoding."""
    spinner = start_spinner(0)
    try:
        for _ in range(3):
            stream_times(base, workload, 0, model, budget=10)
            threads = team(base)
            if threads is None or threads["now"] < threads["most"]:
                break
        long = Workload(workload.name, workload.model, workload.route, RECOVERY_TOKENS)
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(stream_times, base, long, 1, model)
            time.sleep(RECOVERY_STOP_AFTER)  # (the stream is decoding beside the program)
            stop(spinner)
            stopped = time.perf_counter()
            full_team = seconds_to_full_team(base, future)
            stream = future.result()
    finally:
        stop(spinner)
    return {"seconds": recovery_seconds(stream["times"], stopped),
            "full_team_seconds": full_team, "after": team(base)}


def seconds_to_full_team(base: str, stream: Any) -> float | None:
    """butter: how long after now /v1/server shows the full team again, polled every
    50 ms while `stream` (a future) runs; None for other servers, or if it never does."""
    started = time.perf_counter()
    while not stream.done():
        threads = team(base)
        if threads is None:
            return None
        if threads["now"] == threads["most"]:
            return time.perf_counter() - started
        time.sleep(0.05)
    return None


def measure_server(server: Server, workload: Workload, clients: Sequence[int],
                   args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    for c in clients:
        port = _free_port(HOST)
        argv = server_argv(server, args, workload, c, port)
        base = f"http://{HOST}:{port}"
        log = args.logs / f"busy-{server.label.replace(' ', '_')}-c{c}.log"
        with running_server_spec(argv, log) as process:
            wait_ready(process, base, "/health", 300)
            model = served_model(base)
            one_round(base, workload, c, model)  # warm-up
            row: dict[str, Any] = {"server": server.label, "clients": c}
            for condition in args.conditions:
                nice = {"quiet": None, "busy": 0, "nice": 19}[condition]
                row[condition] = measure_condition(base, workload, c, model, args.rounds, nice,
                                                   args.budget)
                print(f"{server.label} c={c} {condition}: {row[condition]}", file=sys.stderr)
            if c == 1 and args.recovery:
                row["recovery"] = measure_recovery(base, workload, model)
                print(f"{server.label} recovery: {row['recovery']}", file=sys.stderr)
        results.append(row)
    return results


def share(value: float | None, quiet: float | None) -> str:
    if value is None or not quiet:
        return "—"
    return f"{value:.1f} ({100 * value / quiet:.1f}%)"


def report(results: Sequence[dict[str, Any]], meta: dict[str, Any], workload: Workload,
           conditions: Sequence[str]) -> str:
    machine = meta["machine"]
    lines = [f"Run {meta['date']}, commit {meta['git_commit']}, {machine.get('cpu_class')} "
             f"(run as: {machine.get('run_as')}), "
             f"workload {workload.name} on {workload.model}, {workload.max_tokens} tokens, "
             "greedy.", ""]
    headers = ["server", "c", *(f"{c} per stream" for c in conditions),
               *(f"{c} aggregate" for c in conditions if c != "quiet"),
               "threads " + "/".join(c for c in conditions if c != "quiet"),
               "recovery s (full team)"]
    rows = []
    for r in results:
        quiet = r.get("quiet", {})
        threads = "/".join(str((r.get(c, {}).get("threads") or {}).get("now", "—"))
                           for c in conditions if c != "quiet")
        recovery = r.get("recovery", {}).get("seconds")
        full_team = r.get("recovery", {}).get("full_team_seconds")
        rows.append([
            r["server"], str(r["clients"]),
            *(share(r.get(c, {}).get("per_stream"), quiet.get("per_stream")) for c in conditions),
            *(share(r.get(c, {}).get("aggregate"), quiet.get("aggregate"))
              for c in conditions if c != "quiet"),
            threads, ("—" if recovery is None else f"{recovery:.2f}")
            + ("" if full_team is None else f" ({full_team:.2f})"),
        ])
    lines.append(md_table(headers, rows))
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="story", choices=sorted(WORKLOADS))
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--model", help="a model id or GGUF path instead of the workload's")
    parser.add_argument("--clients", default="1,8")
    parser.add_argument("--servers", default="butter --draft-max 0,"
                        "butter --draft-max 0 --no-fit-threads,llama-server")
    parser.add_argument("--conditions", default=",".join(CONDITIONS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budget", type=float, default=20.0,
                        help="seconds a stream may run before it is cut (default %(default)s)")
    parser.add_argument("--no-recovery", dest="recovery", action="store_false")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--llama-server", type=Path, default=DEFAULT_LLAMA_SERVER_BIN)
    parser.add_argument("--logs", type=Path, default=Path("/tmp/busy-machine-logs"))
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    args.conditions = [c for c in args.conditions.split(",") if c]
    unknown = set(args.conditions) - set(CONDITIONS)
    if unknown or "quiet" not in args.conditions:
        parser.error(f"--conditions: quiet plus any of {CONDITIONS}")
    args.texts, args.stagger = 1, 0.0  # (speculation.py's server_argv reads these)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    base = WORKLOADS[args.workload]
    workload = Workload(base.name, args.model or base.model, base.route, args.max_tokens)
    clients = [int(c) for c in args.clients.split(",")]
    servers = [server_named(label) for label in args.servers.split(",")]
    results = [row for server in servers for row in measure_server(server, workload, clients, args)]
    meta = run_meta()
    text = report(results, meta, workload, args.conditions)
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
