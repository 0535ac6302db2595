"""Soak: mixed traffic against a real `butter serve` for a fixed time.

Streams and non-streams on both APIs, some cancelled by their client mid-way, at a fixed
concurrency; samples the server's RSS every second; reports errors, 5xx, latency p95 and
RSS over time. Exits 1 on any 5xx or transport error.

    python benchmarks/soak.py --model gemma-3-270m --seconds 60 --concurrency 6
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import trio

BANNER = re.compile(r"base URL for OpenAI clients: (http://\S+)/v1")


def start_server(model: str, extra: list[str]) -> tuple[subprocess.Popen[str], str]:
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
            threading.Thread(target=lambda: process.stdout and process.stdout.read(),
                             daemon=True).start()
            return process, match.group(1)
    process.kill()
    raise SystemExit("the server did not start")


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(x for x in status.splitlines() if x.startswith("VmRSS")).split()[1]) / 1024


class Soak:
    def __init__(self, base: str, seconds: float, seed: int) -> None:
        self.base, self.deadline = base, time.monotonic() + seconds
        self.rng = random.Random(seed)
        self.latencies: list[float] = []
        self.statuses: dict[int, int] = {}
        self.errors: list[str] = []
        self.cancelled = 0

    def body(self, anthropic: bool, stream: bool) -> dict[str, object]:
        content = f"soak {self.rng.randint(0, 10**6)}: " + "tell me more. " * self.rng.randint(
            1, 40)
        body: dict[str, object] = {"messages": [{"role": "user", "content": content}],
                                   "max_tokens": self.rng.randint(4, 48), "stream": stream}
        return body

    async def one(self, http: httpx.AsyncClient) -> None:
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
                        status = r.status_code
                else:
                    status = (await http.post(url, json=self.body(anthropic, False))).status_code
            if scope.cancelled_caught:
                self.cancelled += 1
                return
        except httpx.HTTPError as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")
            return
        self.statuses[status] = self.statuses.get(status, 0) + 1
        self.latencies.append(time.monotonic() - start)

    async def lane(self, http: httpx.AsyncClient) -> None:
        while time.monotonic() < self.deadline:
            await self.one(http)


async def run(base: str, pid: int, seconds: float, concurrency: int) -> dict[str, object]:
    soak = Soak(base, seconds, seed=1)
    rss: list[tuple[float, float]] = []

    async def sample() -> None:
        start = time.monotonic()
        while time.monotonic() < soak.deadline:
            rss.append((round(time.monotonic() - start, 1), round(rss_mib(pid), 1)))
            await trio.sleep(1)

    async with httpx.AsyncClient(timeout=120) as http:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sample)
            for _ in range(concurrency):
                nursery.start_soon(soak.lane, http)
        engine = (await http.get(f"{base}/v1/server")).json()["engine"]
    latencies = sorted(soak.latencies)
    p95 = latencies[int(0.95 * (len(latencies) - 1))] if latencies else None
    return {"requests": sum(soak.statuses.values()), "statuses": soak.statuses,
            "client_cancelled": soak.cancelled, "transport_errors": soak.errors[:5],
            "latency_p95_s": p95, "rss_mib": rss, "engine_after": engine}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    process, base = start_server(args.model, ["--parallel", "4", "--max-queue", "64"])
    try:
        report = trio.run(run, base, process.pid, args.seconds, args.concurrency)
    finally:
        process.terminate()
        process.wait(30)
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    statuses: dict[int, int] = report["statuses"]  # type: ignore[assignment]
    server_errors = sum(n for status, n in statuses.items() if status >= 500)
    engine: dict[str, int] = report["engine_after"]  # type: ignore[assignment]
    leaked = engine["active"] or engine["queued"] or engine["reserved_cells"]
    return 1 if server_errors or report["transport_errors"] or leaked else 0


if __name__ == "__main__":
    sys.exit(main())
