#!/usr/bin/env python3
"""Whether a served model answers the same with and without speculative decoding, and the
same when asked again: greedy chat requests (benchmarks/speculation.py's ``story``
workload, one subject per request) sent one after the other to a fresh `butter serve` with
drafts and to one with ``--draft-max 0``, each request asked ``--rounds`` times in turn.
Prints, per request, whether the two servers' texts agree, and whether each server's
later answers equal its first (benchmarks/RESULTS.md, "butter's decode attention")::

    python benchmarks/served_identity.py --model smollm2-135m --requests 4 --rounds 2
"""

from __future__ import annotations

import argparse
import subprocess
import sys

if not __package__:  # run as a file: the repository root, not benchmarks/, on sys.path
    import _repo_root  # noqa: F401

import httpx

from benchmarks.harness import free_port, wait_ready
from benchmarks.speculation import HOST, WORKLOADS


def answers(flags: list[str], model: str, requests: int, rounds: int) -> list[list[str]]:
    """Each round's texts, request by request, from a fresh server."""
    port = free_port(HOST)
    base = f"http://{HOST}:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "butter.cli", "serve", "--model", model, "--host", HOST,
         "--port", str(port), "--parallel", "1", "--threads", "2", "--max-context", "2048",
         *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(server, base, "/health", 300)
        story = WORKLOADS["story"]
        texts: list[list[str]] = []
        for _ in range(rounds):
            texts.append([])
            for variant in range(requests):
                body = {"model": model, "max_tokens": story.max_tokens, "temperature": 0,
                        **story.body(variant)}
                reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=600)
                reply.raise_for_status()
                texts[-1].append(reply.json()["choices"][0]["message"]["content"])
        return texts
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    drafted = answers([], args.model, args.requests, args.rounds)
    plain = answers(["--draft-max", "0"], args.model, args.requests, args.rounds)
    for index in range(args.requests):
        alike = [d[index] == p[index] for d, p in zip(drafted, plain, strict=True)]
        again = [[r[index] == runs[0][index] for r in runs[1:]] for runs in (drafted, plain)]
        print(f"request {index}: drafts vs none, round by round {alike}; asked again, the "
              f"same as first: with drafts {again[0]}, without {again[1]}")


if __name__ == "__main__":
    main()
