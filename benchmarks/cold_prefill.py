#!/usr/bin/env python3
"""Cold prefill at several prompt lengths, butter vs llama-server, optionally under perf (#54).

Starts one server at a time, warms it with a short request, then sends one fresh prompt of
random words per length (a new seed each, so no prefix is cached) with max_tokens 1 and
times the request (TTFT plus one sampled token). llama-server's own ``timings.prompt_ms``
is reported beside it. With ``--perf`` the lengths listed are recorded with
``perf record -F <freq> -p <server pid>`` for that request only::

    python benchmarks/cold_prefill.py --server butter --model M.gguf --lengths 2048,8192,16384 \
        --perf 8192,16384 --out /tmp/cp

With ``--claude-code BODY.json`` (a request benchmarks/claude_code_body.py captured from the
pinned Claude Code) the prompt is instead that real first request of an agent, sent to
``/v1/messages`` as it came but for ``max_tokens`` 1, no streaming and no extended thinking
(a 1-token answer leaves no room for a thinking budget), with a short system block of its
own so that nothing of it is cached; ``--repeat N`` sends N such new conversations, one
after another (the first request after start is slower on both servers)::

    python benchmarks/cold_prefill.py --server butter --model M.gguf \
        --claude-code /tmp/claude-code-body.json --repeat 2 --out /tmp/cc
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

if not __package__:
    import _repo_root  # noqa: F401

from benchmarks.harness import ServerSpec, free_port, running_server, wait_ready

LLAMA_SERVER = Path(__file__).parent / ".build/llama-server/bin/llama-server"
SYLL = ["ka", "to", "ri", "ne", "mo", "sa", "lu", "pe", "di", "ga", "vo", "shi", "ran", "tel",
        "mar", "cor", "bel", "fin", "wod", "pra"]


def words(n_tokens: int, seed: int) -> str:
    """Roughly ``n_tokens`` tokens of random pseudo-words (about 2.2 tokens a word here)."""
    rng = random.Random(seed)
    out = []
    for _ in range(int(n_tokens / 2.2)):
        out.append("".join(rng.choice(SYLL) for _ in range(rng.randint(1, 3))))
    return " ".join(out)


def claude_code_turn(client: httpx.Client, base: str, a: argparse.Namespace,
                     run: int) -> dict[str, object]:
    """The captured Claude Code request, answered with one token: a new conversation each
    run (a system block of its own after the billing header, so neither server has any of
    it cached), the model the server serves, no streaming and no extended thinking."""
    body = {key: value for key, value in json.loads(a.claude_code.read_text()).items()
            if key != "thinking"}
    system = list(body["system"])
    body["system"] = [system[0], {"type": "text", "text": f"Session {a.seed * 1000 + run}."},
                      *system[1:]]
    # (the captured body names the CLI's model: ask for the one served instead)
    served = client.get(base + "/v1/models").json()["data"][0]["id"]
    t0 = time.perf_counter()
    r = client.post(base + "/v1/messages", json={**body, "model": served, "max_tokens": 1,
                                                 "stream": False})
    secs = time.perf_counter() - t0
    if r.status_code != 200:
        raise SystemExit(f"{a.server} answered {r.status_code}: {r.text[:2000]}")
    usage = r.json().get("usage", {})
    ptoks = sum(usage.get(key) or 0 for key in (
        "input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"))
    return {"server": a.server, "model": Path(a.model).name, "extra": a.extra,
            "target": "claude-code", "run": run, "prompt_tokens": ptoks,
            "seconds": round(secs, 3), "tok_s": round(ptoks / secs, 1) if ptoks else None}


def record(out: Path, rec: dict[str, object]) -> None:
    print(json.dumps(rec), flush=True)
    with (out / "results.jsonl").open("a") as f:
        f.write(json.dumps(rec) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", choices=["butter", "llama-server"], required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--lengths", default="2048,8192,16384")
    ap.add_argument("--perf", default="", help="lengths to record under perf")
    ap.add_argument("--perf-freq", type=int, default=999)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--extra", default="", help="extra server args")
    ap.add_argument("--llama-server", default=str(LLAMA_SERVER),
                    help="the llama-server binary (e.g. an AVX2-only build for that class)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="/tmp/cold_prefill")
    ap.add_argument("--claude-code", type=Path,
                    help="a captured Claude Code request body to send instead of --lengths")
    ap.add_argument("--repeat", type=int, default=1,
                    help="with --claude-code: new conversations one after another")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port("127.0.0.1")
    if a.server == "butter":
        argv = [sys.executable, "-m", "butter.cli", "serve", "--model", a.model, "--host",
                "127.0.0.1", "--port", str(port), "--threads", str(a.threads),
                "--max-context", "20000", "--parallel", "1", *a.extra.split()]
    else:
        argv = [a.llama_server, "-m", a.model, "--host", "127.0.0.1", "--port", str(port),
                "-np", "1", "-t", str(a.threads), "-tb", str(a.threads), "-c", "20480",
                *a.extra.split()]
    base = f"http://127.0.0.1:{port}"
    perf_lengths = {int(x) for x in a.perf.split(",") if x}
    suffix = ("-" + a.extra.replace(" ", "").replace("-", "")) if a.extra else ""
    tag = f"{a.server}-{Path(a.model).stem}{suffix}"
    spec = ServerSpec(name=a.server, argv=argv, ready_path="/v1/models")
    with running_server(spec, out / f"{tag}.log") as proc:
        wait_ready(proc, base, "/v1/models", 300)
        client = httpx.Client(timeout=1200)

        def ask(text: str) -> tuple[float, dict]:
            t0 = time.perf_counter()
            r = client.post(base + "/v1/completions", json={
                "prompt": text, "max_tokens": 1, "temperature": 0, "cache_prompt": True})
            r.raise_for_status()
            return time.perf_counter() - t0, r.json()

        ask(words(64, 999))  # warm: threads started, weights paged in
        if a.claude_code is not None:
            for run in range(a.repeat):
                record(out, claude_code_turn(client, base, a, run))
            return
        for i, n in enumerate(int(x) for x in a.lengths.split(",")):
            text = words(n, a.seed * 1000 + i)
            perf = None
            if n in perf_lengths:
                perf = subprocess.Popen(["perf", "record", "-F", str(a.perf_freq), "-p",
                                         str(proc.pid),
                                         "-o", str(out / f"{tag}-{n}.perf.data")],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1.0)
            secs, body = ask(text)
            if perf is not None:
                perf.send_signal(signal.SIGINT)
                perf.wait()
            ptoks = body.get("usage", {}).get("prompt_tokens")
            tim = body.get("timings", {})
            rec = {"server": a.server, "model": Path(a.model).name, "extra": a.extra, "target": n,
                   "prompt_tokens": ptoks, "seconds": round(secs, 3),
                   "tok_s": round(ptoks / secs, 1) if ptoks else None,
                   "server_prompt_ms": tim.get("prompt_ms"), "server_prompt_n": tim.get("prompt_n"),
                   "server_prompt_tok_s": tim.get("prompt_per_second"), "perf": n in perf_lengths}
            print(json.dumps(rec), flush=True)
            with (out / "results.jsonl").open("a") as f:
                f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
