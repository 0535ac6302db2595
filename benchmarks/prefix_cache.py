#!/usr/bin/env python3
"""Prefix caching on a chat UI's traffic, butter vs llama-server, by ``serve-bench --interleave``.

K conversations with long histories take turns, one request at a time, and every answer is
followed by S short side requests with unrelated prompts (the title and tags Open WebUI
asks for). Reported per server: the share of a returning turn's prompt served from cache,
and its TTFT; the first turns' TTFT (a cold prefill) beside it, so that a restore from host
RAM can be compared with prefilling the same prompt.

Both servers run one at a time, at their defaults except for what makes the run
comparable: the same context per request (butter --max-context, llama-server -c), one
slot (butter --parallel 1, llama-server -np 1: the issue's setting; llama-server's
--cache-ram stays at its default 8192 MiB, butter's --cache-ram at its default), the same
threads, greedy sampling.

``--variants`` runs each case in more than one way (#51): ``default`` (the template's own
thinking default), ``thinking-on`` and ``thinking-off`` (``chat_template_kwargs``), and
``tools`` (``serve-bench --tool-rounds``: an agent's tool call and result after every
answer); ``--cases`` picks the conversations, history sizes and contexts instead of the
default set. A hybrid model's run records butter's context checkpoints (``/v1/server``).
Each run records the cores other processes took meanwhile (``--wait-quiet`` waits for a
quieter machine first).

Usage (from the repository root)::

    SERVER_DIR=llama-server-noamx benchmarks/build_llama_server.sh   # (see RESULTS.md)
    python benchmarks/prefix_cache.py \\
        --llama-server benchmarks/.build/llama-server-noamx/bin/llama-server \\
        --markdown /tmp/prefix_cache.md --json /tmp/prefix_cache.json

    # Qwen3.5 (a hybrid), ~1k and ~5k-token histories, thinking on and off, tool rounds:
    python benchmarks/prefix_cache.py --model qwen3.5.gguf --no-gemma-template \
        --cases 2x1000@8192,2x5000@16384 --side-requests 1 \
        --variants default,thinking-off,tools
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: the repository root, not benchmarks/, on sys.path
    import _repo_root  # noqa: F401

import httpx

from benchmarks.harness import (
    DEFAULT_LLAMA_SERVER_BIN,
    SERVE_BENCH,
    ServerSpec,
    cpu_sample,
    cpu_window,
    free_port,
    llama_server_argv,
    md_table,
    run_meta,
    running_server,
    served_model_id,
    wait_quiet,
    wait_ready,
)

HOST = "127.0.0.1"

# What each --variants name adds to serve-bench's command line.
VARIANTS: dict[str, list[str]] = {
    "default": [],
    "thinking-on": ["--enable-thinking"],
    "thinking-off": ["--no-enable-thinking"],
    "tools": ["--tool-rounds"],
    "tools-thinking-off": ["--tool-rounds", "--no-enable-thinking"],
}


def butter_spec(args: argparse.Namespace, port: int, context: int) -> ServerSpec:
    return ServerSpec("butter", [
        sys.executable, "-m", "butter.cli", "serve", "--model", args.model, "--host", HOST,
        "--port", str(port), "--parallel", str(args.parallel), "--threads", str(args.threads),
        "--max-context", str(context), *args.butter_arg,
    ], "/health")


def llama_server_spec(args: argparse.Namespace, port: int, context: int) -> ServerSpec:
    # (with jinja on, "gemma" would be taken as the template's text: RESULTS.md)
    template = ["--no-jinja", "--chat-template", "gemma"] if args.gemma_template else ["--jinja"]
    if args.parallel > 1:  # one KV pool for every slot, as butter's (-c is then the total)
        template.append("--kv-unified")
    return ServerSpec("llama-server", llama_server_argv(
        args.llama_server, args.model_path, HOST, port, slots=args.parallel, threads=args.threads,
        context=context, extra=template), "/health")


def interleave(base_url: str, model: str, case: dict[str, Any], out: Path,
               args: argparse.Namespace) -> dict[str, Any]:
    import subprocess

    argv = [*SERVE_BENCH, "--model", model, "--base-url", base_url + "/v1",
            "--interleave", str(case["conversations"]), "--side-requests",
            str(case["side_requests"]), "--history-tokens", str(case["history_tokens"]),
            "--turns", str(case["turns"]), "--max-tokens", str(args.max_tokens),
            "--temperature", "0", "--timeout", "900", "--json", str(out),
            *VARIANTS[case.get("variant", "default")]]
    subprocess.run(argv, check=True)
    (record,) = json.loads(out.read_text())
    return dict(record)


def run_case(name: str, case: dict[str, Any], args: argparse.Namespace,
             log_dir: Path) -> dict[str, Any]:
    port = free_port(HOST)
    spec = (butter_spec if name == "butter" else llama_server_spec)(args, port, case["context"])
    base_url = f"http://{HOST}:{port}"
    label = f"{name}-k{case['conversations']}-h{case['history_tokens']}"
    if case.get("variant", "default") != "default":
        label += f"-{case['variant']}"
    with running_server(spec, log_dir / f"{label}.log") as proc:
        wait_ready(proc, base_url, spec.ready_path, timeout=300)
        wait_quiet(proc.pid, args.wait_quiet, args.wait_quiet_s, label)
        started, cpu = time.monotonic(), cpu_sample(proc.pid)
        model = args.model_id if name == "butter" else served_model_id(base_url)
        record = interleave(base_url, model, case, log_dir / f"{label}.json", args)
        record["wall_s"] = round(time.monotonic() - started, 1)
        # cores that other processes took meanwhile (the machine is shared: harness.py)
        record["other_cores"] = round(cpu_window(cpu, cpu_sample(proc.pid)).other_cores, 2)
        if name == "butter":  # where its cached prompts were served from, and its kernels
            info = httpx.get(base_url + "/v1/server", timeout=10).json()
            record["prefix_cache"] = info["prefix_cache"]
            record["layer_matmuls"] = info["model"]["meta"].get("layer_matmuls")
    record["server_name"] = name
    record["case"] = case
    return record


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def restored(record: dict[str, Any]) -> str:
    host = (record.get("prefix_cache") or {}).get("host_ram")
    return "-" if not host else f"{host['restored']} ({host['restored_tokens']} tok)"


def checkpointed(record: dict[str, Any]) -> str:
    """butter's context checkpoints (hybrid and recurrent models): taken / restored
    (prompt tokens they served)."""
    points = (record.get("prefix_cache") or {}).get("checkpoints")
    if not points or not points.get("per_sequence"):
        return "-"
    return f"{points['taken']} / {points['restored']} ({points['restored_tokens']} tok)"


def workload(case: dict[str, Any]) -> str:
    text = f"K={case['conversations']}, {case['history_tokens']}-token histories"
    variant = case.get("variant", "default")
    return text if variant == "default" else f"{text}, {variant}"


def rows(records: Sequence[dict[str, Any]]) -> list[list[str]]:
    out = []
    for r in records:
        share = r["returning_cached_share"]
        out.append([
            workload(r["case"]), r["server_name"], "-" if share is None else f"{share:.1%}",
            fmt(r["returning_ttft_p50"]), fmt(r["returning_ttft_p95"]),
            fmt(r["first_turn_ttft_p50"]), fmt(r["side_ttft_p50"]), restored(r),
            checkpointed(r), fmt(r.get("other_cores")), str(r["http_errors"]),
        ])
    return out


HEADERS = ["workload", "server", "returning prompt cached", "returning TTFT p50 s", "p95 s",
           "first-turn TTFT p50 s", "side TTFT p50 s", "butter host restores",
           "butter checkpoints taken / restored", "other load (cores)", "errors"]


def parse_cases(spec: str, context: int) -> list[tuple[int, int, int]]:
    """``KxHISTORY[@CONTEXT],...`` → (conversations, history tokens, context) each; the
    context defaults to ``context``."""
    cases = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        try:
            shape, _, size = item.partition("@")
            k, history = shape.lower().split("x")
            cases.append((int(k), int(history), int(size) if size else context))
        except ValueError:
            raise SystemExit(f"--cases: {item!r} is not KxHISTORY[@CONTEXT]") from None
    if not cases:
        raise SystemExit("--cases names no case")
    return cases


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma-3-270m", help="butter's --model")
    parser.add_argument("--model-path", help="the GGUF for llama-server (default: --model "
                                             "resolved by butter)")
    parser.add_argument("--model-id", help="the model id sent (default: --model)")
    parser.add_argument("--llama-server", type=Path, default=DEFAULT_LLAMA_SERVER_BIN)
    parser.add_argument("--only", choices=["butter", "llama-server"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--parallel", type=int, default=1,
                        help="butter's --parallel and llama-server's -np (default 1)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--conversations", default="2,4,8")
    parser.add_argument("--history-tokens", type=int, default=2000)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--side-requests", type=int, default=2)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--long-history-tokens", type=int, default=15000,
                        help="the Claude-Code-sized case: 2 conversations this long "
                             "(0: skip it)")
    parser.add_argument("--cases", metavar="KxHISTORY[@CONTEXT],...",
                        help="these cases instead of --conversations at --history-tokens and "
                             "the long case, e.g. 2x1000@8192,2x5000@16384 (CONTEXT: "
                             "default --context)")
    parser.add_argument("--variants", default="default",
                        help="comma-separated, each case runs once per variant: "
                             f"{', '.join(VARIANTS)} (default %(default)s)")
    parser.add_argument("--gemma-template", action=argparse.BooleanOptionalAction,
                        default=True, help="llama-server --no-jinja --chat-template gemma "
                                           "(the demo GGUF has no template of its own)")
    parser.add_argument("--butter-arg", action="append", default=[],
                        help="one more butter serve argument (repeatable)")
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="CORES",
                        help="before each run, wait until other processes use fewer cores "
                             "than this (0: do not wait; the run records what they took)")
    parser.add_argument("--wait-quiet-s", type=float, default=300.0,
                        help="wait at most this long for --wait-quiet (default %(default)s)")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/butter-prefix-cache"))
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.model_path is None:
        from butter.models import resolve_model

        args.model_path = str(resolve_model(args.model))
    args.model_id = args.model_id or args.model
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or not args.variants:
        parser.error(f"--variants: {', '.join(unknown) or 'none given'}; choose from "
                     f"{', '.join(VARIANTS)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cases:
        cases = [{"conversations": k, "side_requests": args.side_requests,
                  "history_tokens": history, "turns": args.turns, "context": context}
                 for k, history, context in parse_cases(args.cases, args.context)]
    else:
        cases = [{"conversations": int(k), "side_requests": args.side_requests,
                  "history_tokens": args.history_tokens, "turns": args.turns,
                  "context": args.context} for k in args.conversations.split(",")]
        if args.long_history_tokens:
            cases.append({"conversations": 2, "side_requests": args.side_requests,
                          "history_tokens": args.long_history_tokens, "turns": 3,
                          "context": 2 ** (args.long_history_tokens + 1024).bit_length()})
    cases = [{**case, "variant": variant} for case in cases for variant in args.variants]
    names = [args.only] if args.only else ["butter", "llama-server"]
    records = [run_case(name, case, args, args.log_dir) for case in cases for name in names]
    table = md_table(HEADERS, rows(records))
    print(table)
    meta = run_meta()
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "records": records}, indent=2))
    if args.markdown:
        args.markdown.write_text(f"{meta['date']}, {meta['machine']}, commit "
                                 f"{meta['git_commit']}\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
