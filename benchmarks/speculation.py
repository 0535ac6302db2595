#!/usr/bin/env python3
"""Speculative decoding side by side: butter with and without its drafts against
llama-server plain and with its n-gram modes, on copy-shaped and non-copying traffic.

Workloads (greedy, streamed, c clients at once, each with its own text):

- ``copy``: the demo base model (/v1/completions) continues a 30-line file it has just
  been shown, from the file's first line: it repeats what it has seen (the issue's
  headline workload).
- ``edit``: the instruct model (SmolLM2-135M-Instruct, /v1/chat/completions) rewrites the
  same kind of file with every function renamed: it paraphrases rather than copies.
- ``chat``: the instruct model answers an ordinary question (little to copy).
- ``story``: the instruct model writes a short story on a subject of each client's own
  (nothing to copy).

Each server runs alone, one at a time, at its defaults except what makes the runs
comparable: the same threads, slots = clients (llama-server ``-np c``, butter
``--parallel c``), the same context per slot. Reported per server and level: decode
tokens per second per stream (tokens after the first over the time after the first, the
median of the rounds) and characters per second, time to first token, and butter's
drafted / accepted tokens from ``/v1/server``.

Usage (from the repository root, after benchmarks/build_llama_server.sh)::

    python benchmarks/speculation.py --markdown /tmp/spec.md --json /tmp/spec.json

On a hybrid model (Qwen3.5, LFM2: recurrent layers whose rejected drafts butter takes back
by checkpoint and replay, butter/backends/llama_cpp/batch.py), give its GGUF to every
workload; ``/v1/server``'s ``speculation`` says whether it drafts, and why not (a hybrid
whose float matrices llama.cpp multiplies does not)::

    python benchmarks/speculation.py --copy-model Qwen3.5-0.8B-Q4_K_M.gguf \
        --chat-model Qwen3.5-0.8B-Q4_K_M.gguf --workloads copy,edit,chat \
        --servers "butter,butter --draft-max 0" --interleave
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: the repository root, not benchmarks/, on sys.path
    import _repo_root  # noqa: F401

import httpx

from benchmarks.harness import (
    DEFAULT_LLAMA_SERVER_BIN,
    ServerSpec,
    llama_server_argv,
    md_table,
    run_meta,
    running_server,
    wait_ready,
)
from benchmarks.harness import free_port as _free_port

HOST = "127.0.0.1"
CONTEXT_PER_SLOT = 2048


def source_file(variant: int, lines: int = 30) -> str:
    """A file of `lines` short functions; `variant` changes the names and numbers, so that
    concurrent clients do not share one text."""
    names = ("scale", "shift", "blend", "clamp", "round", "wrap", "fold", "mix", "tilt")
    name = names[variant % len(names)]
    rows = []
    for i in range(lines // 2):
        rows.append(f"def {name}_{i}(x):")
        rows.append(f"    return x * {i + variant} + {(i * 7 + variant) % 23}")
    return "\n".join(rows)


@dataclass(frozen=True)
class Workload:
    name: str
    model: str  # butter's model id
    route: str  # "completions" or "chat/completions"
    max_tokens: int

    def body(self, variant: int) -> dict[str, Any]:
        code = source_file(variant)
        first_line = code.splitlines()[0]
        if self.name == "copy":
            prompt = f"# file: util_{variant}.py\n{code}\n\n# the same file, again:\n{first_line}\n"
            return {"prompt": prompt}
        if self.name == "edit":
            old = code.split("_")[0].split()[-1]
            text = (f"Rewrite this Python file with every function named {old}_N renamed "
                    f"to step_N, and nothing else changed:\n\n{code}")
        elif self.name == "story":
            subjects = ("a lighthouse keeper", "a retired astronaut", "a baker on Mars",
                        "a clockmaker's cat", "a shy dragon", "a river pilot",
                        "a night-shift nurse", "a chess-playing robot")
            text = (f"Write a short original story about {subjects[variant % 8]}, "
                    "with a twist at the end.")
        else:
            text = ("Explain to a curious twelve-year-old how a bicycle stays upright, "
                    f"and why riding it gets easier with speed. (Question {variant}.)")
        return {"messages": [{"role": "user", "content": text}]}


WORKLOADS = {
    "copy": Workload("copy", "gemma-3-270m", "completions", 300),
    "edit": Workload("edit", "smollm2-135m", "chat/completions", 300),
    "chat": Workload("chat", "smollm2-135m", "chat/completions", 200),
    # Nothing to copy: new text on a subject of the client's own.
    "story": Workload("story", "smollm2-135m", "chat/completions", 200),
}


@dataclass
class Stream:
    ttft: float
    decode_seconds: float
    tokens: int
    chars: int
    text: str

    @property
    def decode_tok_s(self) -> float:
        return (self.tokens - 1) / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def chars_s(self) -> float:
        return self.chars / self.decode_seconds if self.decode_seconds > 0 else 0.0


def stream_one(base: str, workload: Workload, variant: int, model: str) -> Stream:
    body = {"model": model, "max_tokens": workload.max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
            **workload.body(variant)}
    started = time.perf_counter()
    first = last = None
    chars = tokens = 0
    pieces = []
    with httpx.Client(timeout=600) as client, \
            client.stream("POST", f"{base}/v1/{workload.route}", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if text:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    chars += len(text)
                    pieces.append(text)
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
    if first is None or last is None:
        raise RuntimeError("the stream carried no text")
    return Stream(first - started, last - first, tokens, chars, "".join(pieces))


def run_level(base: str, workload: Workload, clients: int, model: str,
              texts: int = 1, stagger: float = 0.0) -> list[Stream]:
    """c clients at once, each asking for `texts` texts one after the other (client i:
    variants i, i + c, ...; starting i x `stagger` seconds late, so that the clients do
    not run in lockstep): the streams in variant order."""
    def client(first: int) -> list[Stream]:
        time.sleep(first * stagger)
        return [stream_one(base, workload, first + k * clients, model) for k in range(texts)]

    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(client, first) for first in range(clients)]
        done = [future.result() for future in futures]
    return [done[v % clients][v // clients] for v in range(clients * texts)]


@dataclass(frozen=True)
class Server:
    label: str
    kind: str  # "butter" or "llama-server"
    flags: tuple[str, ...] = ()


SERVERS = (
    Server("butter", "butter"),
    Server("butter --draft-max 0", "butter", ("--draft-max", "0")),
    Server("llama-server", "llama-server"),
    Server("llama-server ngram-simple", "llama-server", ("--spec-type", "ngram-simple")),
    Server("llama-server ngram-mod", "llama-server", ("--spec-type", "ngram-mod")),
)


def server_named(label: str) -> Server:
    """One of SERVERS by its label, else butter with the flags the label gives after
    "butter" (``"butter --draft-max 15"``); a label given twice is another server process
    with the same flags (``"butter --draft-max 0 "``, for an A/A run)."""
    known = next((server for server in SERVERS if server.label == label.strip()), None)
    if known is not None:
        return replace(known, label=label)
    kind, *flags = label.split()
    if kind != "butter":
        raise SystemExit(f"unknown server {label!r}: one of {[s.label for s in SERVERS]} "
                         "or 'butter FLAGS'")
    return Server(label, "butter", tuple(flags))


def model_path(model: str) -> str:
    from butter.models import resolve_model

    return str(resolve_model(model))


def server_argv(server: Server, args: argparse.Namespace, workload: Workload, clients: int,
                port: int) -> list[str]:
    if server.kind == "butter":
        return [sys.executable, "-m", "butter.cli", "serve", "--model", workload.model,
                "--host", HOST, "--port", str(port), "--parallel", str(clients),
                "--threads", str(args.threads), "--max-context", str(CONTEXT_PER_SLOT),
                *server.flags]
    return llama_server_argv(args.llama_server, model_path(workload.model), HOST, port,
                             slots=clients, threads=args.threads,
                             context=CONTEXT_PER_SLOT * clients, extra=["--jinja", *server.flags])


def served_model(base: str) -> str:
    """The id the server lists first (butter's alias or path; llama-server's file)."""
    models: dict[str, Any] = httpx.get(f"{base}/v1/models", timeout=10).json()
    return str(models["data"][0]["id"])


def butter_speculation(base: str) -> dict[str, Any] | None:
    try:
        info: dict[str, Any] = httpx.get(f"{base}/v1/server", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return None
    speculation: dict[str, Any] | None = info.get("speculation")
    return speculation


def measure(server: Server, workload: Workload, clients: int, args: argparse.Namespace,
            logs: Path) -> dict[str, Any]:
    return measure_together([server], workload, clients, args, logs)[0]


def measure_together(servers: Sequence[Server], workload: Workload, clients: int,
                     args: argparse.Namespace, logs: Path) -> list[dict[str, Any]]:
    """The servers started side by side, each warmed up, then their rounds in turns (one
    server at a time, the others idle; the order rotated every round, so that over as many
    rounds as there are servers each runs first, second, ... once): a machine whose speed
    drifts over minutes then slows every server's rounds alike (``--interleave``)."""
    with ExitStack() as stack:
        running = []
        for server in servers:
            port = _free_port(HOST)
            argv = server_argv(server, args, workload, clients, port)
            base = f"http://{HOST}:{port}"
            log = logs / f"{workload.name}-{server.label.replace(' ', '_')}-c{clients}.log"
            process = stack.enter_context(running_server_spec(argv, log))
            wait_ready(process, base, "/health", 300)
            model = served_model(base)
            run_level(base, workload, clients, model, args.texts,  # warm-up, prompts cached
                      args.stagger)
            running.append((server, argv, base, model))
        rounds: dict[str, list[list[Stream]]] = {server.label: [] for server in servers}
        walls: dict[str, list[float]] = {server.label: [] for server in servers}
        for index in range(args.rounds):
            # (A B C, B C A, C A B, ...: no server keeps a place in the order)
            shift = index % len(running)
            for server, _, base, model in running[shift:] + running[:shift]:
                began = time.perf_counter()
                rounds[server.label].append(run_level(base, workload, clients, model,
                                                      args.texts, args.stagger))
                walls[server.label].append(time.perf_counter() - began)
        return [summarize(server, workload, clients, argv, rounds[server.label],
                          walls[server.label],
                          butter_speculation(base) if server.kind == "butter" else None)
                for server, argv, base, _ in running]


def summarize(server: Server, workload: Workload, clients: int, argv: list[str],
              rounds: list[list[Stream]], walls: list[float],
              speculation: dict[str, Any] | None) -> dict[str, Any]:
    streams = [stream for level in rounds for stream in level]
    per_round = [statistics.mean(s.decode_tok_s for s in level) for level in rounds]
    # every client's tokens over the round's wall time (prompts and waits included)
    aggregate = [sum(s.tokens for s in level) / wall
                 for level, wall in zip(rounds, walls, strict=True)]
    return {
        "aggregate_tok_s": statistics.median(aggregate),
        "aggregate_tok_s_rounds": aggregate,
        "server": server.label, "workload": workload.name, "clients": clients,
        "command": argv,
        "decode_tok_s": statistics.median(per_round),
        "decode_tok_s_rounds": per_round,
        "chars_s": statistics.median(statistics.mean(s.chars_s for s in level)
                                     for level in rounds),
        "ttft_s": statistics.median(s.ttft for s in streams),
        "tokens": [s.tokens for s in streams],
        "texts": [s.text for s in rounds[-1]],  # the last round's, in variant order
        "speculation": speculation,
    }


def running_server_spec(argv: list[str], log: Path) -> Any:
    return running_server(ServerSpec(argv[0], argv, "/health"), log)


def fmt(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def report(results: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    machine = meta["machine"]
    lines = [f"Run {meta['date']}, commit {meta['git_commit']}, {machine.get('cpu_model')} "
             f"({machine.get('cpu_class')}), {machine.get('nproc')} cores"
             + (f"; run as: {machine['run_as']}" if machine.get("run_as") else "") + ".", ""]
    for workload in WORKLOADS:
        rows = [r for r in results if r["workload"] == workload]
        if not rows:
            continue
        levels = sorted({r["clients"] for r in rows})
        lines.append(f"### {workload}: decode tok/s per stream (chars/s), TTFT s")
        lines.append("")
        table = []
        baseline = {r["clients"]: r["decode_tok_s"] for r in rows
                    if r["server"] == BASELINE}
        for label in dict.fromkeys(r["server"] for r in rows):
            cells = [label]
            for clients in levels:
                r = next((x for x in rows if x["server"] == label and x["clients"] == clients),
                         None)
                if r is None:
                    cells.append("—")
                    continue
                ratio = (r["decode_tok_s"] / baseline[clients]
                         if baseline.get(clients) else None)
                spec = r.get("speculation") or {}
                accepted = ""
                if spec.get("drafted_tokens"):
                    accepted = (f", {spec['accepted_tokens']}/{spec['drafted_tokens']} "
                                "drafts kept")
                cells.append(f"{fmt(r['decode_tok_s'])} ({fmt(r['chars_s'], 0)}) ×"
                             f"{fmt(ratio, 2)}, {fmt(r['ttft_s'], 2)} s{accepted}")
            table.append(cells)
        lines.append(md_table(["server", *[f"c={c}" for c in levels]], table))
        lines.append("")
        for label in dict.fromkeys(r["server"] for r in rows):
            if label.startswith("butter") and label != BASELINE:
                lines.extend(against_baseline(label, rows, levels, meta))
    lines.append("× is the ratio to butter --draft-max 0 at the same c.")
    return "\n".join(lines)


BASELINE = "butter --draft-max 0"


def against_baseline(label: str, rows: list[dict[str, Any]], levels: list[int],
                     meta: dict[str, Any]) -> list[str]:
    """Lines comparing one butter server with BASELINE level by level: whether their last
    round's texts were the same, and (rounds interleaved) their ratio round by round."""
    same, paired = [], []
    for clients in levels:
        level = {r["server"]: r for r in rows if r["clients"] == clients}
        ours, plain = level.get(label), level.get(BASELINE)
        if not (ours and plain):
            continue
        if ours.get("texts") and plain.get("texts"):
            alike = sum(a == b for a, b in zip(ours["texts"], plain["texts"], strict=True))
            same.append(f"c={clients}: {alike} of {len(ours['texts'])}")
        if meta.get("interleaved"):
            ratios = [a / b for a, b in zip(ours["decode_tok_s_rounds"],
                                            plain["decode_tok_s_rounds"], strict=True)]
            totals = [a / b for a, b in zip(ours["aggregate_tok_s_rounds"],
                                            plain["aggregate_tok_s_rounds"], strict=True)]
            paired.append(f"c={clients}: ×{statistics.median(ratios):.2f} "
                          f"({', '.join(f'{r:.2f}' for r in ratios)}); all clients' "
                          f"tokens over the round's time ×{statistics.median(totals):.2f} "
                          f"({', '.join(f'{r:.2f}' for r in totals)})")
    lines = []
    if same:
        lines += [f"{label}'s texts the same as {BASELINE}'s (last round): " + ", ".join(same),
                  ""]
    if paired:
        lines += [f"{label} / {BASELINE}, round by round (rounds interleaved): "
                  + "; ".join(paired), ""]
    return lines


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="copy,edit,chat")
    parser.add_argument("--clients", default="1,2,4,8")
    parser.add_argument("--servers", default=",".join(s.label for s in SERVERS),
                        help="labels, comma-separated")
    parser.add_argument("--copy-model", help="a GGUF for the copy workload instead of the demo "
                        "(e.g. a benchmarks/model_matrix.py file)")
    parser.add_argument("--chat-model", help="a GGUF with a chat template for the edit, chat "
                        "and story workloads instead of the instruct model (e.g. a hybrid)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--interleave", action="store_true",
                        help="run the servers side by side, their rounds in turns")
    parser.add_argument("--stagger", type=float, default=0.0,
                        help="seconds between one client's start and the next's")
    parser.add_argument("--texts", type=int, default=1,
                        help="texts each client asks for in turn per round (more subjects)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-server", type=Path, default=DEFAULT_LLAMA_SERVER_BIN)
    parser.add_argument("--logs", type=Path, default=Path("/tmp/speculation-logs"))
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--json", type=Path)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    servers = [server_named(label) for label in args.servers.split(",")]
    results = []
    for name in args.workloads.split(","):
        workload = WORKLOADS[name]
        if name == "copy" and args.copy_model:
            workload = replace(workload, model=args.copy_model)
        elif name != "copy" and args.chat_model:
            workload = replace(workload, model=args.chat_model)
        for clients in (int(c) for c in args.clients.split(",")):
            groups = [servers] if args.interleave else [[server] for server in servers]
            for group in groups:
                try:
                    measured = measure_together(group, workload, clients, args, args.logs)
                except Exception as exc:  # a server that fails is reported, not fatal
                    measured = [{"server": server.label, "workload": name, "clients": clients,
                                 "error": repr(exc), "decode_tok_s": None, "chars_s": None,
                                 "ttft_s": None} for server in group]
                for result in measured:
                    results.append(result)
                    print(json.dumps({k: result.get(k) for k in (
                        "workload", "server", "clients", "decode_tok_s", "chars_s", "ttft_s",
                        "error")}), flush=True)
    meta = {**run_meta(), "interleaved": args.interleave, "texts_per_client": args.texts,
            "stagger_s": args.stagger}
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    text = report([r for r in results if r.get("decode_tok_s") is not None], meta)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
