#!/usr/bin/env python3
"""What a speculative step costs: one sequence's decode step verifying k drafted tokens.

Loads the model as `butter serve` does (weight repacking on), prefills the copy workload's
prompt (benchmarks/speculation.py: the demo base model shown a file, asked for it again),
decodes its greedy continuation, then times steps of 1 + k rows whose drafts are that
continuation (every draft kept: the step a perfect copy takes), the cache rewound after
each. Row counts take turns round by round (order reversed every other round), so a slow
minute of a shared machine falls on all of them. Prints the median and fastest step and
the median per token: speculation can pay at most (one-row step) / (per token) on a copy.

Usage (from the repository root, in the project's venv)::

    python benchmarks/draft_step.py                      # the demo GGUF
    python benchmarks/draft_step.py --model smollm2-135m --drafts 0,7,15,31
    python benchmarks/draft_step.py --model x.gguf --drafts 0,3,7,15 --rounds 12
    BUTTER_KERNEL_ISA=avx2 python benchmarks/draft_step.py   # butter's AVX2 kernels
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

if not __package__:  # run as a file: the repository root, not benchmarks/, on sys.path
    import _repo_root  # noqa: F401

from rich.console import Console
from rich.table import Table

from benchmarks.speculation import WORKLOADS
from butter.backends.base import RemoveTokens, SeqWork, SetSampler
from butter.backends.llama_cpp import LlamaCppBackend
from butter.models import resolve_model
from butter.sampling import SamplingParams


def continuation(backend: LlamaCppBackend, prompt: list[int], tokens: int) -> list[int]:
    """The greedy continuation of the prompt (prefilled into sequence 0), one step a token."""
    backend.step([RemoveTokens(0, -1, -1), SetSampler(0, SamplingParams(temperature=0))], [])
    sampled = backend.step([], [SeqWork(0, tuple(prompt), 0, sample=True, prompt=True)])
    text = [sampled[0].token]
    while len(text) < tokens:
        start = len(prompt) + len(text) - 1
        sampled = backend.step([], [SeqWork(0, (text[-1],), start, sample=True)])
        text.append(sampled[0].token)
    return text


def time_steps(backend: LlamaCppBackend, prompt: list[int], text: list[int],
               drafts: Sequence[int], rounds: int) -> dict[int, list[float]]:
    """Seconds of each step verifying k drafts (all kept), for each k, round by round."""
    times: dict[int, list[float]] = {k: [] for k in drafts}
    for round_ in range(rounds + 1):  # round 0 warms up
        for k in drafts if round_ % 2 == 0 else reversed(drafts):
            backend.step([RemoveTokens(0, len(prompt))], [])
            started = time.perf_counter()
            sampled = backend.step([], [SeqWork(0, tuple(text[: k + 1]), len(prompt),
                                                 sample=True, drafted=k)])
            elapsed = time.perf_counter() - started
            if len(sampled) != k + 1:
                raise SystemExit(f"a step of {k} drafts kept {len(sampled) - 1}: not a copy")
            if round_:
                times[k].append(elapsed)
    return times


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=WORKLOADS["copy"].model,
                        help="a GGUF or a bundled model's id (default: the demo model)")
    parser.add_argument("--drafts", default="0,1,3,7,11,15")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    drafts = [int(k) for k in args.drafts.split(",")]
    path = resolve_model(args.model)
    backend = LlamaCppBackend(path, n_cells=2048, n_seq=1, n_batch=512 + 1,
                              threads=args.threads, repack=True)
    try:
        prompt = backend.tokenize(WORKLOADS["copy"].body(0)["prompt"], add_bos=True)
        text = continuation(backend, prompt, max(drafts) + 1)
        times = time_steps(backend, prompt, text, drafts, args.rounds)
    finally:
        backend.close()
    table = Table(title=f"{path.name}: a step verifying k drafts (ms)")
    for column in ("rows", "median", "fastest", "per token", "most a copy can gain"):
        table.add_column(column, justify="right")
    one_row = statistics.median(times[drafts[0]]) if drafts[0] == 0 else None
    for k in drafts:
        median = statistics.median(times[k])
        per_token = median / (k + 1)
        gain = f"×{one_row / per_token:.2f}" if one_row is not None else ""
        table.add_row(str(k + 1), f"{median * 1e3:.2f}", f"{min(times[k]) * 1e3:.2f}",
                      f"{per_token * 1e3:.2f}", gain)
    Console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
