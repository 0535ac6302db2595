#!/usr/bin/env python3
"""What butter's decode attention costs a decode step, against llama.cpp's own.

From 512 KV cells on, llama.cpp splits a one-row step's flash attention over the cells among
its threads, and computes each row of a bigger step over its cells on one thread; butter
computes every decode row over the cells it sees in fixed chunks of them
(butter/native/decode_attention.h), the same bits whatever the step holds, which keeps
speculative decoding and batching exact at any context length (docs/design/numerics.md,
"Numerics and determinism").

This loads each model on the real llama.cpp backend as `butter serve` does (repacking on,
butter's kernels), prefills ``--streams`` sequences with a long prompt (``--files`` of
benchmarks/speculation.py's source files), then decodes greedily, one row per stream per
step, switching between butter's attention and llama.cpp's every ``--block`` steps (this VM's
speed drifts; alternating blocks sees both under the same drift). Prints the CPU class and,
per model, the median and 10th-percentile step time of each::

    python benchmarks/decode_attention.py MODEL.gguf [MODEL.gguf ...] --files 8 --streams 1

``--others N`` first prefills another sequence (a cached conversation: the prefix cache keeps
them) with N files, so the streams' cells lie after its cells and the step's attention view
spans more cells than any stream sees.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root, not benchmarks/, on sys.path
    import _repo_root  # noqa: F401

from benchmarks.speculation import source_file
from butter.backends.base import SeqWork, SetSampler
from butter.backends.llama_cpp import LlamaCppBackend, layer_matmul
from butter.cpu import this_cpu
from butter.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def prefill(backend: LlamaCppBackend, seq: int, prompt: list[int]) -> int:
    """Prefill `prompt` into sequence `seq` in chunks of 512; the token it samples next."""
    token = -1
    backend.step([SetSampler(seq, GREEDY)], [])
    for start in range(0, len(prompt), 512):
        chunk = tuple(prompt[start:start + 512])
        done = start + len(chunk) == len(prompt)
        for sampled in backend.step([], [SeqWork(seq, chunk, start, sample=done, prompt=True)]):
            token = sampled.token
    return token


def measure(path: Path, files: int, streams: int, steps: int, block: int,
            threads: int, others: int) -> None:
    text = "\n\n".join(source_file(i) for i in range(files))
    other_text = "\n\n".join(source_file(files + i) for i in range(others))
    # (more than a token per 2 characters)
    cells = streams * (len(text) // 2 + steps + 256) + len(other_text) // 2 + 256
    backend = LlamaCppBackend(path, n_cells=cells, n_seq=streams + 1, n_batch=512,
                              threads=threads, repack=True)
    try:
        kernels = layer_matmul.registered()
        prompt = backend.tokenize(text, add_bos=True)
        other = backend.tokenize(other_text, add_bos=True) if others else []
        if other:
            prefill(backend, streams, other)  # (first: its cells come before the streams')
        last = {seq: prefill(backend, seq, prompt) for seq in range(streams)}
        position = len(prompt)
        times: dict[bool, list[float]] = {True: [], False: []}
        for step in range(steps):
            butter = step // block % 2 == 0
            kernels.decode_attention(butter)
            work = [SeqWork(seq, (last[seq],), position, sample=True) for seq in range(streams)]
            began = time.perf_counter()
            for sampled in backend.step([], work):
                last[sampled.seq] = sampled.token
            times[butter].append(time.perf_counter() - began)
            position += 1
        kernels.decode_attention(backend.butter_attention)

        def summary(values: list[float]) -> str:
            values = sorted(values)[block:]  # (each setting's first block warms it up)
            return (f"median {statistics.median(values) * 1e3:.2f} ms, "
                    f"p10 {values[len(values) // 10] * 1e3:.2f} ms")

        ours, theirs = (statistics.median(times[flag]) for flag in (True, False))
        print(f"{path.name}: {backend.model.query_heads} query heads, {threads} threads, "
              f"{streams} stream(s) at {len(prompt)}-{position} cells after {len(other)} "
              f"others: butter's attention "
              f"{summary(times[True])}; llama.cpp's {summary(times[False])} "
              f"(butter's / llama.cpp's median: {ours / theirs:.3f})", flush=True)
    finally:
        backend.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("--files", type=int, default=8, help="source files in the prompt")
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--others", type=int, default=0,
                        help="source files in another sequence prefilled first")
    args = parser.parse_args()
    print(f"CPU class: {this_cpu().as_dict()}", flush=True)
    for path in args.models:
        measure(path, args.files, args.streams, args.steps, args.block, args.threads,
                args.others)


if __name__ == "__main__":
    main()
