"""Soak: mixed, partly hostile traffic against a real `butter serve` for a fixed time.

At a fixed concurrency: streams and non-streams on both APIs, a fifth of the streams
dropped by their client after 0.05-0.5 s, and one request in twenty a bad body (4xx
expected). At a steady rate besides: a client that sends a streaming request and never
reads (4 KiB receive buffer; the server must close it, --write-timeout), a model swap
between two names of the same file (requests in flight then end with 503 "model replaced",
which is expected and counted apart), and a poller scraping what routers and UIs read
(/v1/models, /v1/server, /metrics, /health, /ready; a round a second): any 5xx there
fails the run, except /ready's 503 "swapping" while a swap is under way (its job).

Samples the server's RSS, open file descriptors and threads every second. The baseline is
taken after a warm-up (each kind of request once, a swap there and back) once the server
is idle; the end values once it is idle again after the traffic (at most SETTLE_SECONDS).
Prints a table of both with the bounds, and exits 1 on an unexpected 5xx, a transport
error, a non-reader the server did not close, or anything not back within its bound.

    python benchmarks/soak.py --model gemma-3-270m --minutes 60 --concurrency 6
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import attrs
import httpx
import trio

BANNER = re.compile(r"base URL for OpenAI clients: (http://\S+)/v1")
# After the traffic, how long the server gets to become idle again (keep-alive connections
# close after 5 s, idle worker threads after 10 s).
SETTLE_SECONDS = 60.0
# The end values must be within these of the baseline. RSS may also grow by the KV pool:
# its pages become resident as requests use them (a swap starts a fresh, untouched pool).
# The CI-sized run (tests/test_reliability.py, 8 s, swaps every 5 s) ends 67-105 MiB above
# its baseline on 2 cores, with 555a055's code as with later code (measured 2026-12-07: the
# 64 MiB bound failed one run in two with either), so the bound is 96: a leak of tens of
# MiB in 8 seconds still fails it. Where the swaps' growth goes is not yet known.
RSS_BOUND_MIB = 96.0
FD_BOUND = 0
THREAD_BOUND = 0
BAD_BODIES = (
    b"{not json",
    b'{"messages": "not a list", "max_tokens": 4}',
    b'{"messages": [{"role": "robot", "content": "x"}], "max_tokens": 4}',
    b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}',
    b"[" * 5000,
)
NON_READER_PROMPT = "Count from 1 to 3000, one number per line, and say nothing else."
# A non-reader is closed once its output fills the socket buffers (~150 tokens on the
# demo model) and then --write-timeout passes; on a loaded machine generating them takes
# long. Past this (plus the write timeout) it counts as kept by the server.
NON_READER_PATIENCE_SECONDS = 600.0
POLLED_PATHS = ("/v1/models", "/v1/server", "/metrics", "/health", "/ready")
POLL_EVERY_SECONDS = 1.0


def start_server(model: str, extra: list[str],
                 log: Path | None = None) -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "butter.cli", "serve", "--model", model, "--port", "0", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        match = BANNER.search(line)
        if match:
            # Keep reading the server's log, or it blocks once the pipe is full.
            threading.Thread(target=_keep, args=(process, log), daemon=True).start()
            return process, match.group(1)
    process.kill()
    raise SystemExit("the server did not start")


def _keep(process: subprocess.Popen[str], log: Path | None) -> None:
    assert process.stdout is not None
    with open(log or os.devnull, "w") as out:
        for line in process.stdout:
            out.write(line)
            out.flush()


def rss_mib(pid: int) -> float:
    return _status_field(pid, "VmRSS") / 1024


def _status_field(pid: int, name: str) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(x for x in status.splitlines() if x.startswith(name + ":")).split()[1])


@attrs.frozen
class Sample:
    at: float
    rss_mib: float
    fds: int
    threads: int

    @classmethod
    def of(cls, pid: int, at: float = 0.0) -> Sample:
        return cls(at=round(at, 1), rss_mib=round(rss_mib(pid), 1),
                   fds=len(os.listdir(f"/proc/{pid}/fd")), threads=_status_field(pid, "Threads"))


def model_names(model: str) -> tuple[str, list[str]]:
    """A models dir with two names for the model's file, so swaps reload it each time."""
    from butter.models import resolve_model

    path = resolve_model(model).resolve()
    folder = Path(tempfile.mkdtemp(prefix="butter-soak-"))
    for name in ("soak-a", "soak-b"):
        (folder / f"{name}.gguf").symlink_to(path)
    return str(folder), ["soak-a", "soak-b"]


class Soak:
    def __init__(self, base: str, seconds: float, seed: int, names: list[str]) -> None:
        self.base, self.deadline = base, time.monotonic() + seconds
        self.rng = random.Random(seed)
        self.names = names
        self.latencies: list[float] = []
        self.statuses: dict[int, int] = {}
        self.errors: list[str] = []
        self.cancelled = 0
        self.bad_bodies: dict[int, int] = {}
        self.replaced = 0  # 503 "model replaced": in flight during a swap (expected)
        self.swaps = 0
        self.swap_failures: list[str] = []
        self.non_readers = {"sent": 0, "closed_by_server": 0, "still_open": 0}
        self.non_reader_close_s: list[float] = []
        self.polled: dict[str, dict[str, int]] = {}  # path -> status (reason) -> count

    def body(self, anthropic: bool, stream: bool) -> dict[str, object]:
        content = f"soak {self.rng.randint(0, 10**6)}: " + "tell me more. " * self.rng.randint(
            1, 40)
        body: dict[str, object] = {"messages": [{"role": "user", "content": content}],
                                   "max_tokens": self.rng.randint(4, 48), "stream": stream}
        return body

    async def one(self, http: httpx.AsyncClient) -> None:
        if self.rng.random() < 0.05:
            await self.bad_body(http)
            return
        anthropic, stream = self.rng.random() < 0.3, self.rng.random() < 0.6
        cancel = stream and self.rng.random() < 0.2
        url = f"{self.base}/v1/messages" if anthropic else f"{self.base}/v1/chat/completions"
        start = time.monotonic()
        try:
            with trio.move_on_after(self.rng.uniform(0.05, 0.5) if cancel else 120) as scope:
                if stream:
                    async with http.stream("POST", url, json=self.body(anthropic, True)) as r:
                        async for _ in r.aiter_bytes():
                            pass
                        status, text = r.status_code, ""
                else:
                    response = await http.post(url, json=self.body(anthropic, False))
                    status, text = response.status_code, response.text
            if scope.cancelled_caught:
                self.cancelled += 1
                return
        except httpx.HTTPError as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")
            return
        if status == 503 and "replaced" in text:
            self.replaced += 1
            return
        self.statuses[status] = self.statuses.get(status, 0) + 1
        self.latencies.append(time.monotonic() - start)

    async def bad_body(self, http: httpx.AsyncClient) -> None:
        body = self.rng.choice(BAD_BODIES)
        try:
            response = await http.post(f"{self.base}/v1/chat/completions", content=body,
                                       headers={"Content-Type": "application/json"})
        except httpx.HTTPError as exc:
            self.errors.append(f"bad body: {type(exc).__name__}: {exc}")
            return
        self.bad_bodies[response.status_code] = self.bad_bodies.get(response.status_code, 0) + 1

    async def lane(self, http: httpx.AsyncClient) -> None:
        while time.monotonic() < self.deadline:
            await self.one(http)

    async def every(self, interval: float, action: Callable[[], Awaitable[None]]) -> None:
        """Run `action` every `interval` seconds until the deadline (0: never)."""
        if interval <= 0:
            return
        while time.monotonic() + interval < self.deadline:
            await trio.sleep(interval)
            await action()

    async def swap(self, http: httpx.AsyncClient) -> None:
        name = self.names[(self.swaps + 1) % len(self.names)]
        response = await http.post(f"{self.base}/v1/chat/completions", json={
            "model": name, "messages": [{"role": "user", "content": "swap"}], "max_tokens": 4})
        if response.status_code == 200:
            self.swaps += 1
        else:
            self.swap_failures.append(f"{name}: {response.status_code} {response.text[:200]}")

    async def poll(self, http: httpx.AsyncClient) -> None:
        """What a router or a chat UI scrapes, once each."""
        for path in POLLED_PATHS:
            try:
                response = await http.get(f"{self.base}{path}")
            except httpx.HTTPError as exc:
                self.errors.append(f"poll {path}: {type(exc).__name__}: {exc}")
                continue
            status = str(response.status_code)
            if path == "/ready" and response.status_code != 200:
                status += f" {response.json().get('reason')}"  # e.g. "503 swapping"
            counts = self.polled.setdefault(path, {})
            counts[status] = counts.get(status, 0) + 1

    async def non_reader(self, write_timeout: float, pid: int, nursery: trio.Nursery) -> None:
        nursery.start_soon(self._non_reader, write_timeout, pid)

    async def _non_reader(self, write_timeout: float, pid: int) -> None:
        """Send a long streaming request, never read; see whether the server lets go."""
        host, port = self.base.removeprefix("http://").rsplit(":", 1)
        body = json.dumps({"messages": [{"role": "user", "content": NON_READER_PROMPT}],
                           "max_tokens": 1000, "stream": True}).encode()
        request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                   f"application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
        sock = trio.socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.non_readers["sent"] += 1
        try:
            await sock.connect((host, int(port)))
            await sock.send(request)  # small: one send takes it
            # Closed by the server within its write timeout once the output fills the
            # buffers, or by keep-alive (5 s) after the answer if it fits in them (then the
            # kernel still holds the unread tail, FIN behind it: only the server's
            # descriptor table tells).
            start, client_port = time.monotonic(), sock.getsockname()[1]
            with trio.move_on_after(write_timeout + NON_READER_PATIENCE_SECONDS):
                accepted = False
                while not peer_closed(sock):
                    held = server_holds(pid, int(port), client_port)
                    if accepted and not held:
                        break
                    accepted = accepted or held
                    await trio.sleep(0.25)
                self.non_readers["closed_by_server"] += 1
                self.non_reader_close_s.append(round(time.monotonic() - start, 1))
                return
            self.non_readers["still_open"] += 1
        except OSError as exc:
            self.errors.append(f"non-reader: {exc}")
        finally:
            sock.close()


def peer_closed(sock: trio.socket.SocketType) -> bool:
    """Reset or FIN from the server, seen without reading what is buffered."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(0))


def fd_targets(pid: int) -> list[str]:
    """What the server's descriptors point at ("socket:[inode]", files, pipes)."""
    folder = Path(f"/proc/{pid}/fd")
    targets = []
    for name in os.listdir(folder):
        try:
            targets.append(os.readlink(folder / name))
        except OSError:
            continue  # closed meanwhile
    return targets


def tcp_lines(targets: list[str]) -> list[str]:
    """/proc/net/tcp's lines (addresses, state) for these "socket:[inode]" targets."""
    inodes = {t.removeprefix("socket:[").removesuffix("]") for t in targets}
    lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return [" ".join(line.split()[1:4]) for line in lines if line.split()[9] in inodes]


def server_holds(pid: int, server_port: int, client_port: int) -> bool:
    """Whether the server process still has a descriptor for this connection (Linux)."""
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = fields[1], fields[2]
        if (int(local.split(":")[1], 16) == server_port
                and int(remote.split(":")[1], 16) == client_port):
            inode = fields[9]
    if inode is None or inode == "0":  # gone, or orphaned (closed by the process)
        return False
    target = f"socket:[{inode}]"
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in os.listdir(fd_dir):
        try:
            if os.readlink(fd_dir / fd) == target:
                return True
        except OSError:
            continue  # closed meanwhile
    return False


def probe_client() -> httpx.AsyncClient:
    """For the figures: the server closes each of its connections at once (a kept-alive
    one would hold a descriptor for the keep-alive timeout, even once closed here)."""
    return httpx.AsyncClient(timeout=30, headers={"Connection": "close"},
                             limits=httpx.Limits(max_keepalive_connections=0))


async def settled(http: httpx.AsyncClient, base: str, pid: int, limit: Sample | None,
                  seconds: float) -> tuple[Sample, dict[str, object] | None]:
    """The server's figures once it is idle: no work, and (given a baseline) FDs and threads
    back within their bounds; after `seconds` at most, whatever they are."""
    deadline = time.monotonic() + seconds
    await trio.sleep(12 if limit is None else 1)  # keep-alive and idle threads end first
    while True:
        engine = (await http.get(f"{base}/v1/server")).json()["engine"]
        await trio.sleep(0.5)  # the server sees that scrape's connection close
        sample = Sample.of(pid)
        # (No engine between a swap's unload and load: not settled.)
        idle = engine is not None and not (
            engine["active"] or engine["queued"] or engine["reserved_cells"])
        back = limit is None or (sample.fds <= limit.fds + FD_BOUND
                                 and sample.threads <= limit.threads + THREAD_BOUND)
        if (idle and back) or time.monotonic() > deadline:
            return sample, engine
        await trio.sleep(1)


async def warm_up(soak: Soak, http: httpx.AsyncClient, swaps: bool) -> None:
    for anthropic in (False, True):
        for stream in (False, True):
            url = f"{soak.base}/v1/messages" if anthropic else f"{soak.base}/v1/chat/completions"
            await http.post(url, json=soak.body(anthropic, stream))
    await soak.bad_body(http)
    if swaps:
        await soak.swap(http)
        await soak.swap(http)
    soak.swaps, soak.bad_bodies = 0, {}


async def run(base: str, pid: int, seconds: float, concurrency: int, *, write_timeout: float,
              non_reader_every: float, swap_every: float,
              names: list[str]) -> dict[str, object]:
    samples: list[Sample] = []
    async with httpx.AsyncClient(timeout=120) as http:
        await warm_up(Soak(base, 0, seed=0, names=names), http, swap_every > 0)
    async with probe_client() as probe:
        model = (await probe.get(f"{base}/v1/models")).json()["data"][0]
        kv_pool_mib = float(model["meta"]["kv"]["pool_mib"])
        baseline, engine_before = await settled(probe, base, pid, None, SETTLE_SECONDS)
        baseline_fds = fd_targets(pid)
    print(f"baseline after warm-up: {baseline}", flush=True)
    soak = Soak(base, seconds, seed=1, names=names)

    async def sample() -> None:
        start = time.monotonic()
        while time.monotonic() < soak.deadline:
            samples.append(Sample.of(pid, time.monotonic() - start))
            if len(samples) % 60 == 0:
                progress(soak, samples[-1])
            await trio.sleep(1)

    async with httpx.AsyncClient(timeout=120) as http:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sample)
            for _ in range(concurrency):
                nursery.start_soon(soak.lane, http)
            nursery.start_soon(soak.every, swap_every, lambda: soak.swap(http))
            nursery.start_soon(soak.every, POLL_EVERY_SECONDS, lambda: soak.poll(http))
            nursery.start_soon(soak.every, non_reader_every,
                               lambda: soak.non_reader(write_timeout, pid, nursery))
    async with probe_client() as probe:
        end, engine = await settled(probe, base, pid, baseline, SETTLE_SECONDS)
        extra_fds = sorted(set(fd_targets(pid)) - set(baseline_fds))
        extra_fds += tcp_lines(extra_fds)
        metrics = (await probe.get(f"{base}/metrics")).text
    latencies = sorted(soak.latencies)
    p95 = latencies[int(0.95 * (len(latencies) - 1))] if latencies else None
    return {"seconds": seconds, "requests": sum(soak.statuses.values()),
            "statuses": soak.statuses, "client_cancelled": soak.cancelled,
            "bad_bodies": soak.bad_bodies, "replaced_by_swap": soak.replaced,
            "swaps": soak.swaps, "swap_failures": soak.swap_failures,
            "polled": soak.polled,
            "non_readers": soak.non_readers,
            "non_reader_close_s_max": max(soak.non_reader_close_s, default=None),
            "server_counters": counters(metrics),
            "transport_errors": soak.errors[:5], "transport_error_count": len(soak.errors),
            "latency_p95_s": p95, "kv_pool_mib": kv_pool_mib,
            "host_cache_mib_before": host_cache_mib(engine_before),
            "baseline": attrs.asdict(baseline),
            "end": attrs.asdict(end), "peak": attrs.asdict(peak(samples)),
            "fds_not_in_baseline": extra_fds,
            "samples": [attrs.astuple(s) for s in samples], "engine_after": engine}


def progress(soak: Soak, now: Sample) -> None:
    """One line a minute, for long runs."""
    print(f"{now.at / 60:5.1f} min: rss {now.rss_mib} MiB, fds {now.fds}, threads "
          f"{now.threads}; requests {sum(soak.statuses.values())} {soak.statuses}, cancelled "
          f"{soak.cancelled}, bad bodies {soak.bad_bodies}, swaps {soak.swaps} (replaced "
          f"{soak.replaced}), non-readers {soak.non_readers}, errors {len(soak.errors)}",
          flush=True)


def counters(metrics: str) -> dict[str, float]:
    wanted = ("butter_abandoned_responses_total", "butter_cancellations_total",
              "butter_refused_connections_total", "butter_swaps_total")
    found = {}
    for line in metrics.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            found[name] = float(value)
    return found


def peak(samples: list[Sample]) -> Sample:
    if not samples:
        return Sample(at=0, rss_mib=0, fds=0, threads=0)
    return Sample(at=0, rss_mib=max(s.rss_mib for s in samples),
                  fds=max(s.fds for s in samples), threads=max(s.threads for s in samples))


def host_cache_mib(engine: dict[str, object] | None) -> float:
    """What the host tier of the prefix cache holds: conversations saved off the KV pool are
    memory the server keeps on purpose, up to its own budget, not a leak."""
    host = engine.get("host") if engine is not None else None
    return float(host["bytes"]) / 2**20 if isinstance(host, dict) else 0.0


def verdicts(report: dict[str, object]) -> list[tuple[str, object, object, object, str, bool]]:
    """(what, baseline, peak, end, bound, ok) per resource."""
    base, top, end = (report[key] for key in ("baseline", "peak", "end"))
    assert isinstance(base, dict) and isinstance(top, dict) and isinstance(end, dict)
    engine = report["engine_after"]
    assert isinstance(engine, dict | None)
    work = ("no model resident" if engine is None
            else f"{engine['active']} / {engine['queued']} / {engine['reserved_cells']}")
    pool = float(report["kv_pool_mib"])  # type: ignore[arg-type]
    before = report["host_cache_mib_before"]
    assert isinstance(before, float)
    host = max(0.0, host_cache_mib(engine) - before)
    return [
        ("RSS (MiB)", base["rss_mib"], top["rss_mib"], end["rss_mib"],
         f"+{RSS_BOUND_MIB:.0f} + KV pool {pool:.0f} + host cache growth {host:.0f}",
         end["rss_mib"] - base["rss_mib"] <= RSS_BOUND_MIB + pool + host),
        ("open FDs", base["fds"], top["fds"], end["fds"], f"+{FD_BOUND}",
         end["fds"] - base["fds"] <= FD_BOUND),
        ("threads", base["threads"], top["threads"], end["threads"], f"+{THREAD_BOUND}",
         end["threads"] - base["threads"] <= THREAD_BOUND),
        ("active / queued / reserved", "0 / 0 / 0", "-", work, "0 / 0 / 0",
         work == "0 / 0 / 0"),
    ]


def table(report: dict[str, object]) -> str:
    lines = ["| resource | baseline | peak | end | bound | ok |", "|---|---|---|---|---|---|"]
    for what, base, top, end, bound, ok in verdicts(report):
        lines.append(f"| {what} | {base} | {top} | {end} | {bound} | {'yes' if ok else 'NO'} |")
    readers = report["non_readers"]
    assert isinstance(readers, dict)
    lines += [
        "",
        f"requests {report['requests']} {report['statuses']}, client-cancelled "
        f"{report['client_cancelled']}, bad bodies {report['bad_bodies']}, swaps "
        f"{report['swaps']} (503 model replaced: {report['replaced_by_swap']}), non-readers "
        f"{readers}, transport errors {report['transport_error_count']}, latency p95 "
        f"{report['latency_p95_s']}",
        f"polled: {report['polled']}",
        f"server counters: {report['server_counters']}",
    ]
    return "\n".join(lines)


def failed(report: dict[str, object]) -> bool:
    statuses: dict[int, int] = report["statuses"]  # type: ignore[assignment]
    bad: dict[int, int] = report["bad_bodies"]  # type: ignore[assignment]
    readers: dict[str, int] = report["non_readers"]  # type: ignore[assignment]
    server_errors = sum(n for status, n in {**statuses, **bad}.items() if int(status) >= 500)
    return bool(server_errors or poll_errors(report) or report["transport_error_count"]
                or report["swap_failures"]
                or readers["still_open"]
                or not all(ok for *_, ok in verdicts(report)))


def poll_errors(report: dict[str, object]) -> int:
    """5xx answers to the poller, but /ready's 503 while a swap is under way (by design)."""
    polled: dict[str, dict[str, int]] = report["polled"]  # type: ignore[assignment]
    return sum(n for counts in polled.values() for status, n in counts.items()
               if int(status.split()[0]) >= 500 and status != "503 swapping")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma-3-270m")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--seconds", type=float)
    length.add_argument("--minutes", type=float)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--write-timeout", type=float, default=5.0,
                        help="the server's --write-timeout (default %(default)s)")
    parser.add_argument("--non-reader-every", type=float, default=15.0,
                        help="seconds between clients that never read (0: none)")
    parser.add_argument("--swap-every", type=float, default=120.0,
                        help="seconds between model swaps (0: none)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--server-log", type=Path, help="write the server's log here")
    args = parser.parse_args()
    seconds = args.minutes * 60 if args.minutes is not None else args.seconds or 60.0
    models_dir, names = model_names(args.model)
    process, base = start_server(names[0], [
        "--models-dir", models_dir, "--parallel", "4", "--max-queue", "64",
        "--write-timeout", str(args.write_timeout)], args.server_log)
    try:
        report = trio.run(lambda: run(
            base, process.pid, seconds, args.concurrency, write_timeout=args.write_timeout,
            non_reader_every=args.non_reader_every, swap_every=args.swap_every, names=names))
    finally:
        process.terminate()
        process.wait(30)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=1))
    print(table(report))
    return 1 if failed(report) else 0


if __name__ == "__main__":
    sys.exit(main())
