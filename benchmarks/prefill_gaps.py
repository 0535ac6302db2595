#!/usr/bin/env python3
"""How smooth other streams stay while one long prompt is prefilled (#54), butter or
llama-server.

Starts one server with ``--streams + 1`` slots, starts ``--streams`` clients that stream
completions one after another (short prompts, ``--stream-tokens`` each), waits until each
has streamed a few tokens, then sends one fresh prompt of ``--prompt`` tokens (random
pseudo-words, nothing cached) with max_tokens 1. Every streamed token's arrival time is
kept; the gaps between consecutive tokens of one response that end while the long prompt
is in flight are the figure (a response sent meanwhile counts its wait for the first token
as one gap): their p50, p95 and largest, and how long the long prompt took beside the
streams. llama.cpp issue 29175: one prefill chunk there stalls every other slot.

    python benchmarks/prefill_gaps.py --server butter --model M.gguf --prompt 16384
    python benchmarks/prefill_gaps.py --server llama-server --model M.gguf --prompt 16384
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

if not __package__:
    import _repo_root  # noqa: F401

from benchmarks.cold_prefill import LLAMA_SERVER, words
from benchmarks.harness import ServerSpec, free_port, running_server, wait_ready

STREAM_PROMPT = 48  # tokens of each streaming client's own prompt


def server_argv(server: str, model: str, port: int, slots: int, context: int,
                threads: int, extra: list[str]) -> list[str]:
    if server == "butter":
        return [sys.executable, "-m", "butter.cli", "serve", "--model", model, "--host",
                "127.0.0.1", "--port", str(port), "--threads", str(threads),
                "--max-context", str(context), "--parallel", str(slots), *extra]
    return [str(LLAMA_SERVER), "-m", model, "--host", "127.0.0.1", "--port", str(port),
            "-np", str(slots), "-t", str(threads), "-tb", str(threads),
            "-c", str(context * slots), *extra]


def stream_until(base: str, seed: int, tokens: int, stop: threading.Event,
                 arrivals: list[list[float]]) -> None:
    """Streams completions one after another until `stop`; each response's send time and
    then its tokens' arrival times go to `arrivals` as one list."""
    with httpx.Client(timeout=3600) as client:
        round_ = 0
        while not stop.is_set():
            times = [time.perf_counter()]
            arrivals.append(times)
            body = {"prompt": words(STREAM_PROMPT, seed * 100 + round_), "max_tokens": tokens,
                    "temperature": 0, "stream": True}
            with client.stream("POST", base + "/v1/completions", json=body) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if any(choice.get("text") for choice in event.get("choices", [])):
                        times.append(time.perf_counter())
                    if stop.is_set():
                        break
            round_ += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", choices=["butter", "llama-server"], required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", type=int, default=16384, help="tokens of the long prompt")
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--stream-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=20480, help="context per slot")
    ap.add_argument("--extra", default="", help="extra server arguments")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--out", default="/tmp/prefill_gaps")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port("127.0.0.1")
    base = f"http://127.0.0.1:{port}"
    argv = server_argv(a.server, a.model, port, a.streams + 1, a.context, a.threads,
                       a.extra.split())
    spec = ServerSpec(name=a.server, argv=argv, ready_path="/v1/models")
    with running_server(spec, out / f"{a.server}-{Path(a.model).stem}.log") as proc:
        wait_ready(proc, base, "/v1/models", 300)
        stop = threading.Event()
        arrivals: list[list[float]] = []
        streams = [threading.Thread(target=stream_until,
                                    args=(base, a.seed + i, a.stream_tokens, stop, arrivals))
                   for i in range(a.streams)]
        for thread in streams:
            thread.start()
        while sum(len(times) >= 5 for times in arrivals) < a.streams:
            time.sleep(0.05)  # (polling the streams' progress, not waiting for an outcome)
        began = time.perf_counter()
        with httpx.Client(timeout=7200) as client:
            response = client.post(base + "/v1/completions", json={
                "prompt": words(a.prompt, a.seed * 1000), "max_tokens": 1, "temperature": 0})
            response.raise_for_status()
        ended = time.perf_counter()
        stop.set()
        for thread in streams:
            thread.join()
    gaps = sorted(later - earlier for times in arrivals
                  for earlier, later in itertools.pairwise(times)
                  if began < later <= ended)
    prompt_tokens = response.json().get("usage", {}).get("prompt_tokens")
    record = {
        "server": a.server, "model": Path(a.model).name, "extra": a.extra,
        "prompt_tokens": prompt_tokens, "prefill_seconds": round(ended - began, 2),
        "streams": a.streams, "gaps": len(gaps),
        "gap_p50_s": round(statistics.median(gaps), 3) if gaps else None,
        "gap_p95_s": round(gaps[int(0.95 * (len(gaps) - 1))], 3) if gaps else None,
        "gap_max_s": round(gaps[-1], 3) if gaps else None,
    }
    print(json.dumps(record), flush=True)
    with (out / "results.jsonl").open("a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
