"""serve-bench output: a rich table, a JSON file, an optional plot."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
from rich.console import Console
from rich.table import Table

from butter.bench.metrics import ArrivalReport, InterleaveReport, LevelReport, ReplayReport


def _seconds(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def table(reports: Sequence[LevelReport]) -> Table:
    mixed = any(r.long_ttft_p95 is not None for r in reports)
    out = Table(title="butter serve-bench")
    columns = [
        "c", "req", "prompt", "cached", "uncached", "completion", "tok/s", "uncached tok/s",
        "post-TTFT tok/s", "TTFT p50", "TTFT p95", "req p95", "leaks", "empty", "bad UTF-8",
        "HTTP err",
    ]
    if mixed:
        columns += ["long TTFT p95", "std TTFT p95"]
    for column in columns:
        out.add_column(column, justify="right")
    for r in reports:
        row = [
            str(r.concurrency), str(r.requests), str(r.prompt_tokens), str(r.cached_tokens),
            str(r.uncached_tokens), str(r.completion_tokens), f"{r.completion_tok_s:.1f}",
            f"{r.uncached_prompt_tok_s:.1f}", f"{r.post_ttft_tok_s:.1f}",
            _seconds(r.ttft_p50), _seconds(r.ttft_p95), _seconds(r.latency_p95),
            str(r.marker_leaks), str(r.empty_responses), str(r.invalid_utf8),
            str(r.http_errors),
        ]
        if mixed:
            row += [_seconds(r.long_ttft_p95), _seconds(r.standard_ttft_p95)]
        out.add_row(*row)
    return out


def print_table(reports: Sequence[LevelReport], console: Console) -> None:
    console.print(table(reports))
    missing = sum(r.usage_missing for r in reports)
    if missing:
        console.print(f"{missing} response(s) carried no usage: their completion tokens are "
                      "counted content deltas (one per token on most servers).")
    _print_retried(sum(r.retried for r in reports), console)


def _print_retried(retried: int, console: Console) -> None:
    if retried:
        console.print(f"{retried} request(s) were sent twice: the server closed a kept-alive "
                      "connection without answering as it was reused.")


def _share(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def _rate(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def replay_table(reports: Sequence[ReplayReport], name: str) -> Table:
    out = Table(title=f"butter serve-bench --replay {name}")
    columns = ["c", "conv", "req", "err", "completion", "tok/s", "req/s", "TTFT p50",
               "TTFT p95", "req p95", "prompt/req", "cached share"]
    for column in columns:
        out.add_column(column, justify="right")
    for r in reports:
        out.add_row(
            str(r.concurrency), str(r.conversations), str(r.requests), str(r.http_errors),
            str(r.completion_tokens), f"{r.completion_tok_s:.1f}", f"{r.requests_per_s:.2f}",
            _seconds(r.ttft_p50), _seconds(r.ttft_p95), _seconds(r.latency_p95),
            _rate(r.prompt_tokens_per_request), _share(r.cached_share),
        )
    return out


def turns_table(report: ReplayReport) -> Table:
    out = Table(title=f"c={report.concurrency}: by turn (k-th request of each conversation)")
    for column in ("turn", "prompt tokens", "cached share", "TTFT p50"):
        out.add_column(column, justify="right")
    rows = zip(report.turn_prompt_tokens, report.turn_cached_share, report.turn_ttft_p50,
               strict=True)
    for turn, (prompt, share, ttft) in enumerate(rows):
        out.add_row(str(turn), _rate(prompt), _share(share), _seconds(ttft))
    return out


def print_replay(reports: Sequence[ReplayReport], name: str, console: Console) -> None:
    console.print(replay_table(reports, name))
    for report in reports:
        console.print(turns_table(report))
    sources = sorted({r.cached_source for r in reports})
    console.print(f"cached prompt tokens read from: {', '.join(sources)}")
    _print_retried(sum(r.retried for r in reports), console)
    _print_errors([e for r in reports for e in r.errors], console)


def arrival_table(reports: Sequence[ArrivalReport]) -> Table:
    out = Table(title="butter serve-bench --long-arrival: sessions' decode around one long "
                      "prefill")
    columns = ["c", "long prompt", "long TTFT", "tok/s before", "tok/s during prefill",
               "tok/s after", "prefill s", "starved", "longest stall", "session err"]
    for column in columns:
        out.add_column(column, justify="right")
    for r in reports:
        out.add_row(
            str(r.concurrency), str(r.long_prompt_tokens), _seconds(r.long_ttft),
            _rate(r.before_tok_s), _rate(r.during_tok_s), _rate(r.after_tok_s),
            f"{r.during_seconds:.2f}", f"{r.starved_sessions}/{r.concurrency}",
            _seconds(r.longest_stall_s), str(r.session_errors),
        )
    return out


def print_arrival(reports: Sequence[ArrivalReport], console: Console) -> None:
    console.print(arrival_table(reports))
    for r in reports:
        if r.long_error:
            console.print(f"[red]c={r.concurrency}: the long request failed: "
                          f"{r.long_error}[/red]")
        console.print(f"c={r.concurrency}: long prompt {r.long_prompt_tokens} tokens "
                      f"({r.long_cached_tokens} cached, from {r.cached_source}), target "
                      f"{r.target_prompt_tokens} at {r.chars_per_token:.2f} chars/token")
    _print_retried(sum(r.retried for r in reports), console)
    _print_errors([e for r in reports for e in r.errors], console)


def _print_errors(errors: Sequence[str], console: Console) -> None:
    for error in dict.fromkeys(errors):
        console.print(f"[yellow]error: {error}[/yellow]")


def interleave_table(r: InterleaveReport) -> Table:
    variant = "".join([
        "" if r.enable_thinking is None else
        f", thinking {'on' if r.enable_thinking else 'off'}",
        ", tool rounds" if r.tool_rounds else ""])
    out = Table(title=f"butter serve-bench --interleave: {r.conversations} conversations, "
                      f"{r.side_requests} side requests per answer, {r.turns} turns{variant}")
    columns = ["requests", "errors", "returning prompt tok", "cached share",
               "returning TTFT p50", "p95", "first-turn TTFT p50", "side TTFT p50"]
    for column in columns:
        out.add_column(column, justify="right")
    share = "-" if r.returning_cached_share is None else f"{r.returning_cached_share:.1%}"
    out.add_row(str(r.requests), str(r.http_errors), str(r.returning_prompt_tokens), share,
                _seconds(r.returning_ttft_p50), _seconds(r.returning_ttft_p95),
                _seconds(r.first_turn_ttft_p50), _seconds(r.side_ttft_p50))
    return out


def print_interleave(report: InterleaveReport, console: Console) -> None:
    console.print(interleave_table(report))
    console.print(f"cached prompt tokens read from: {report.cached_source}")
    _print_errors(report.errors, console)


Report = LevelReport | ReplayReport | ArrivalReport | InterleaveReport


def write_json(path: Path, reports: Sequence[Report],
               command: Sequence[str], server: dict[str, Any]) -> None:
    """One record per level: the report's fields, `workload` (waves, replay, arrival),
    the command line and the server's /v1/models."""
    records = [{"workload": workload_name(r), **attrs.asdict(r), "command": list(command),
                "server": server} for r in reports]
    path.write_text(json.dumps(records, indent=2))


def workload_name(report: Report) -> str:
    if isinstance(report, ReplayReport):
        return "replay"
    if isinstance(report, InterleaveReport):
        return "interleave"
    return "arrival" if isinstance(report, ArrivalReport) else "waves"


def write_plot(path: Path, reports: Sequence[LevelReport]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'butter-serve[plot]'") from None
    levels = [r.concurrency for r in reports]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(levels, [r.completion_tok_s for r in reports], marker="o")
    left.set(xlabel="concurrency", ylabel="completion tok/s", title="Throughput")
    right.plot(levels, [r.ttft_p50 or 0 for r in reports], marker="o", label="p50")
    right.plot(levels, [r.ttft_p95 or 0 for r in reports], marker="o", label="p95")
    right.set(xlabel="concurrency", ylabel="seconds", title="Time to first token")
    right.legend()
    figure.tight_layout()
    figure.savefig(path)
