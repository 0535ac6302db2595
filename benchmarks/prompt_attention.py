#!/usr/bin/env python3
"""What butter's prompt attention costs a long prompt's prefill, against llama.cpp's own.

Steps of 64 query rows or more (a prompt's chunks, several prompts arriving together) are
computed by butter in tiles of rows that share each key's load, every row bit for bit what
its decode attention gives it alone (butter/native/prompt_attention.h); llama.cpp's tiled
path sums a tile's cells in blocks of the places they lie in, so a prompt's last bits depend
on what was prefilled beside it and where its cells went (docs/design/numerics.md, "Numerics
and determinism").

This loads each model on the real llama.cpp backend as `butter serve` does, then prefills
one long prompt (``--files`` of benchmarks/speculation.py's source files) in chunks of
``--chunk`` tokens, ``--rounds`` times with butter's prompt attention and llama.cpp's in
turns (this VM's speed drifts; alternating rounds sees both under the same drift), emptying
the cache between prefills. Prints the CPU class and, per model, the median prefill time of
each and of its last chunk (the longest context)::

    python benchmarks/prompt_attention.py smollm2-135m gemma-3-270m --files 8 --rounds 6
"""

from __future__ import annotations

import argparse
import statistics
import time

if not __package__:  # run as a file: the repository root, not benchmarks/, on sys.path
    import _repo_root  # noqa: F401

from benchmarks.harness import llama_cpp_built_for
from benchmarks.speculation import source_file
from butter.backends.base import RemoveTokens, SeqWork, SetSampler
from butter.backends.llama_cpp import LlamaCppBackend, layer_matmul
from butter.cpu import this_cpu
from butter.models import resolve_model
from butter.sampling import SamplingParams


def prefill(backend: LlamaCppBackend, prompt: list[int], chunk: int) -> tuple[float, float, int]:
    """Seconds for the whole prompt and for its last chunk; the token it samples next."""
    backend.step([RemoveTokens(0, -1, -1), SetSampler(0, SamplingParams(temperature=0))], [])
    began = time.perf_counter()
    last_chunk, token = 0.0, -1
    for start in range(0, len(prompt), chunk):
        tokens = tuple(prompt[start:start + chunk])
        done = start + len(tokens) == len(prompt)
        chunk_began = time.perf_counter()
        for sampled in backend.step([], [SeqWork(0, tokens, start, sample=done, prompt=True)]):
            token = sampled.token
        last_chunk = time.perf_counter() - chunk_began
    return time.perf_counter() - began, last_chunk, token


def measure(model: str, files: int, chunk: int, rounds: int, threads: int) -> None:
    text = "\n\n".join(source_file(i) for i in range(files))
    backend = LlamaCppBackend(resolve_model(model), n_cells=len(text) // 2 + 256, n_seq=1,
                              n_batch=chunk, threads=threads, repack=True)
    try:
        kernels = layer_matmul.registered()
        prompt = backend.tokenize(text, add_bos=True)
        times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        tokens: dict[bool, set[int]] = {True: set(), False: set()}
        for turn in range(2 * rounds + 2):  # (the first of each warms it up)
            butter = turn % 2 == 0
            kernels.prompt_attention(butter)
            whole, last, token = prefill(backend, prompt, chunk)
            tokens[butter].add(token)
            if turn >= 2:
                times[butter].append((whole, last))
        kernels.prompt_attention(backend.butter_attention)

        def median(butter: bool, which: int) -> float:
            return statistics.median(t[which] for t in times[butter])

        print(f"{model}: {len(prompt)} tokens (butter's kernels: {kernels.isa.value}; "
              f"llama.cpp built for: {llama_cpp_built_for()}) in chunks of {chunk}, "
              f"{threads} threads, "
              f"{rounds} rounds: butter's prompt attention {median(True, 0):.3f} s "
              f"(last chunk {median(True, 1):.3f} s), llama.cpp's {median(False, 0):.3f} s "
              f"({median(False, 1):.3f} s); butter's / llama.cpp's: "
              f"{median(True, 0) / median(False, 0):.3f} ({median(True, 1) / median(False, 1):.3f}"
              f" last chunk); next tokens {sorted(tokens[True])} / {sorted(tokens[False])}",
              flush=True)
    finally:
        backend.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="model ids or GGUF paths")
    parser.add_argument("--files", type=int, default=8, help="source files in the prompt")
    parser.add_argument("--chunk", type=int, default=512, help="tokens a prefill step")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(f"CPU class: {this_cpu().as_dict()}", flush=True)
    for model in args.models:
        measure(model, args.files, args.chunk, args.rounds, args.threads)


if __name__ == "__main__":
    main()
