"""`butter serve-bench ...`: parse, run the waves with a progress bar, report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import trio
from rich.console import Console
from rich.progress import Progress

from butter.bench.client import BenchConfig, BenchError, run_levels
from butter.bench.metrics import LevelReport, Timeline, level_report
from butter.bench.report import print_table, write_json, write_plot


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
    bench.add_argument("--json", type=Path, help="write one record per level here")
    bench.add_argument("--plot", type=Path, help="write a PNG plot here (extra [plot])")


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
    )


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
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
