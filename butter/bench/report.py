"""serve-bench output: a rich table, a JSON file, an optional plot."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
from rich.console import Console
from rich.table import Table

from butter.bench.metrics import LevelReport


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


def write_json(path: Path, reports: Sequence[LevelReport], command: Sequence[str],
               server: dict[str, Any]) -> None:
    records = [{**attrs.asdict(r), "command": list(command), "server": server}
               for r in reports]
    path.write_text(json.dumps(records, indent=2))


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
