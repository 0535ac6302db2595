"""`butter serve-bench ...`: parse, run the workload with a progress bar, report.

Four workloads: synchronized waves (the default), `--replay FILE` (recorded agent
conversations), `--long-arrival TOKENS` (one long prompt arriving amid streams) and
`--interleave K` (conversations taking turns amid side requests: prefix caching)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import trio
from rich.console import Console
from rich.progress import Progress

from butter.bench.arrival import ArrivalConfig, run_arrival
from butter.bench.client import BenchConfig, BenchError, run_levels
from butter.bench.interleave import InterleaveConfig, run_interleave
from butter.bench.metrics import (
    LevelReport,
    Timeline,
    arrival_report,
    interleave_report,
    level_report,
    replay_report,
)
from butter.bench.replay import DEFAULT_TAG, load_replay, run_replay
from butter.bench.report import (
    print_arrival,
    print_interleave,
    print_replay,
    print_table,
    write_json,
    write_plot,
)


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = commands.add_parser(
        "serve-bench", help="measure a running OpenAI-compatible server with request waves"
    )
    bench.add_argument("--model", required=True, help="the resident model id (never swapped)")
    bench.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    bench.add_argument("--concurrency", default="1,2,4,8",
                       help="comma-separated levels (default %(default)s)")
    bench.add_argument("--max-tokens", type=int, default=128)
    bench.add_argument("--temperature", type=float, default=0.7)
    bench.add_argument("--top-p", type=float, default=0.9)
    bench.add_argument("--waves", type=int, default=3, help="waves per level")
    bench.add_argument("--shared-prompt", action="store_true",
                       help="all lanes share one long prompt stem (prefix reuse)")
    bench.add_argument("--long-prompt", help="a long prompt text for some lanes")
    bench.add_argument("--long-prompt-lanes", type=int, default=0,
                       help="lanes per wave that use --long-prompt")
    bench.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    bench.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction,
                       default=None,
                       help="send chat_template_kwargs.enable_thinking on every request "
                            "(default: not sent, the template's own default)")
    bench.add_argument("--json", type=Path, help="write one record per level here")
    bench.add_argument("--plot", type=Path, help="write a PNG plot here (extra [plot])")
    workload = bench.add_mutually_exclusive_group()
    workload.add_argument(
        "--replay", type=Path, metavar="FILE",
        help="replay recorded conversations (JSONL: {\"id\", \"requests\": [chat bodies "
             "without model/stream]}) on C lanes per level; --max-tokens applies to bodies "
             "without max_tokens")
    bench.add_argument(
        "--replay-tag", default=DEFAULT_TAG,
        help="prefixed to each conversation's first user message, {level} = C, so a level "
             "cannot reuse the previous level's conversations ('' sends the file as it is; "
             "default %(default)r)")
    workload.add_argument(
        "--long-arrival", type=int, metavar="TOKENS",
        help="C sessions stream --max-tokens answers; then one request with a unique prompt "
             "of about TOKENS tokens arrives: the sessions' tok/s before, during its prefill "
             "and after")
    workload.add_argument(
        "--interleave", type=int, metavar="K",
        help="K conversations with long histories take turns, one request at a time, each "
             "answer followed by --side-requests short unrelated requests (a chat UI's "
             "title and tags): the cached share and TTFT of returning turns")
    bench.add_argument("--side-requests", type=int, default=2,
                       help="--interleave: side requests after each answer (default %(default)s)")
    bench.add_argument("--history-tokens", type=int, default=2000,
                       help="--interleave: about this many tokens in each conversation's "
                            "first prompt (default %(default)s)")
    bench.add_argument("--turns", type=int, default=4,
                       help="--interleave: requests per conversation (default %(default)s)")
    bench.add_argument("--tool-rounds", action="store_true",
                       help="--interleave: every turn offers a tool, and every answer comes "
                            "back as an assistant message calling it (structured tool_calls) "
                            "followed by the tool's result, as an agent's")
    bench.add_argument("--arrival-max-tokens", type=int, default=16,
                       help="the long request's max_tokens (default %(default)s)")
    bench.add_argument("--arrival-settle", type=float, default=1.0,
                       help="seconds from every session's first token to the arrival, the "
                            "'before' window (default %(default)s)")
    bench.add_argument("--arrival-after", type=float, default=2.0,
                       help="seconds measured after the long request's first token "
                            "(default %(default)s)")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    try:
        levels = tuple(int(x) for x in args.concurrency.split(",") if x.strip())
    except ValueError:
        raise SystemExit("--concurrency must look like 1,2,4,8") from None
    if not levels or min(levels) < 1:
        raise SystemExit("--concurrency levels must be positive")
    if args.long_prompt_lanes and not args.long_prompt:
        raise SystemExit("--long-prompt-lanes needs --long-prompt")
    return BenchConfig(
        base_url=args.base_url.rstrip("/"), model=args.model, concurrency=levels,
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        waves=args.waves, shared_prompt=args.shared_prompt, long_prompt=args.long_prompt,
        long_prompt_lanes=args.long_prompt_lanes, timeout=args.timeout,
        enable_thinking=args.enable_thinking,
    )


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    if args.plot and (args.replay is not None or args.long_arrival is not None
                      or args.interleave is not None):
        Console(stderr=True).print("serve-bench: --plot draws the waves only; ignored")
    if args.replay is not None:
        return run_replay_command(args, config)
    if args.long_arrival is not None:
        return run_arrival_command(args, config)
    if args.interleave is not None:
        return run_interleave_command(args, config)
    console = Console(stderr=True)
    total = len(config.concurrency) * config.waves
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("waves", total=total)

        def on_wave(level: int, wave: int, timelines: list[Timeline]) -> None:
            progress.update(task, advance=1, description=f"c={level} wave {wave}")

        try:
            server, results = trio.run(run_levels, config, on_wave)
        except BenchError as exc:
            console.print(f"[red]serve-bench: {exc}[/red]")
            return 2
    reports: list[LevelReport] = [level_report(level, waves) for level, waves in
                                  results.items()]
    print_table(reports, Console())
    if args.json:
        write_json(args.json, reports, sys.argv, server)
    if args.plot:
        write_plot(args.plot, reports)
    return 0


def run_replay_command(args: argparse.Namespace, config: BenchConfig) -> int:
    console = Console(stderr=True)
    try:
        args.replay_tag.format(level=1)
    except (KeyError, IndexError, ValueError):
        console.print("[red]serve-bench: --replay-tag may use {level} and no other field[/red]")
        return 2
    try:
        conversations = load_replay(args.replay)
    except BenchError as exc:
        console.print(f"[red]serve-bench: {exc}[/red]")
        return 2
    per_level = sum(len(c.requests) for c in conversations)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("replay", total=per_level * len(config.concurrency))

        def on_request(timeline: Timeline) -> None:
            progress.update(task, advance=1, description=f"{timeline.marker} #{timeline.turn}")

        try:
            server, results = trio.run(run_replay, config, conversations, args.replay_tag,
                                       on_request)
        except BenchError as exc:
            console.print(f"[red]serve-bench: {exc}[/red]")
            return 2
    reports = [replay_report(level, timelines) for level, timelines in results.items()]
    print_replay(reports, args.replay.name, Console())
    if args.json:
        write_json(args.json, reports, sys.argv, server)
    return 0


def run_arrival_command(args: argparse.Namespace, config: BenchConfig) -> int:
    console = Console(stderr=True)
    if args.long_arrival < 1 or args.arrival_max_tokens < 1:
        console.print("[red]serve-bench: --long-arrival and --arrival-max-tokens must be "
                      "positive[/red]")
        return 2
    arrival = ArrivalConfig(tokens=args.long_arrival, max_tokens=args.arrival_max_tokens,
                            settle=args.arrival_settle, after=args.arrival_after)
    with console.status("long arrival") as status:

        def on_phase(text: str) -> None:
            status.update(text)

        try:
            server, (chars_per_token, _), runs = trio.run(run_arrival, config, arrival,
                                                          on_phase)
        except BenchError as exc:
            console.print(f"[red]serve-bench: {exc}[/red]")
            return 2
    reports = [arrival_report(r.sessions, r.long, r.marks, arrival.tokens, chars_per_token)
               for r in runs.values()]
    print_arrival(reports, Console())
    if args.json:
        write_json(args.json, reports, sys.argv, server)
    return 0


def run_interleave_command(args: argparse.Namespace, config: BenchConfig) -> int:
    console = Console(stderr=True)
    if min(args.interleave, args.turns, args.history_tokens) < 1 or args.side_requests < 0:
        console.print("[red]serve-bench: --interleave, --turns and --history-tokens must be "
                      "positive, --side-requests at least 0[/red]")
        return 2
    interleave = InterleaveConfig(conversations=args.interleave,
                                  side_requests=args.side_requests,
                                  history_tokens=args.history_tokens, turns=args.turns,
                                  tool_rounds=args.tool_rounds)
    total = args.interleave * args.turns * (1 + args.side_requests)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("interleave", total=total)

        def on_request(timeline: Timeline) -> None:
            progress.update(task, advance=1, description=f"{timeline.marker} #{timeline.turn}")

        try:
            server, timelines = trio.run(run_interleave, config, interleave, on_request)
        except BenchError as exc:
            console.print(f"[red]serve-bench: {exc}[/red]")
            return 2
    report = interleave_report(args.interleave, args.side_requests, timelines,
                               enable_thinking=args.enable_thinking,
                               tool_rounds=args.tool_rounds)
    print_interleave(report, Console())
    if args.json:
        write_json(args.json, [report], sys.argv, server)
    return 0
