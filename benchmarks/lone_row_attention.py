#!/usr/bin/env python3
"""What computing a lone decode row's attention row-wise costs one stream at long contexts.

From 512 KV cells on, llama.cpp splits a one-row step's flash attention over the cells among
its threads; butter can have it computed as each row of a bigger step is, head by head
(docs/architecture.md, "Numerics and determinism"), which keeps speculative decoding exact
at any context length. This loads a model on the real llama.cpp backend as `butter serve`
does (repacking on, butter's kernels), feeds it a long prompt (``--files`` of
benchmarks/speculation.py's source files) and decodes ``--tokens`` greedy tokens alone, with
the row-wise path on and off in turns (``--rounds`` each). A run's decode speed is its tokens
after the first over its time less the time of a run that stops at the first token (the same
prompt, prefilled again), after one run to warm up. Prints the CPU class and one line per model::

    python benchmarks/lone_row_attention.py MODEL.gguf [MODEL.gguf ...] --files 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from speculation import source_file

from butter.backends.base import RemoveTokens
from butter.backends.llama_cpp import LlamaCppBackend, layer_matmul
from butter.cpu import this_cpu
from butter.engine.engine import Engine
from butter.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


async def decode_seconds(backend: LlamaCppBackend, prompt: list[int], tokens: int) -> float:
    """Seconds from admission to the last of `tokens` tokens, over an empty cache."""
    backend.step([RemoveTokens(seq, -1, -1) for seq in range(backend.n_seq
                                                             + backend.n_cache_seqs)], [])
    engine = Engine(backend, parallel=1, max_context=backend.n_cells, prefill_chunk=256,
                    max_queue=1, draft_max=0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.run)
        start = time.perf_counter()
        async with engine.generate_choices(prompt, [GREEDY], tokens) as (generation,):
            async for _ in generation.pieces():
                pass
        seconds = time.perf_counter() - start
        nursery.cancel_scope.cancel()
    return seconds


async def measure(path: Path, files: int, tokens: int, rounds: int, threads: int) -> None:
    backend = LlamaCppBackend(path, n_cells=8192, n_seq=1, n_batch=264, threads=threads,
                              repack=True)
    try:
        kernels = layer_matmul.registered()
        prompt = backend.tokenize("\n\n".join(source_file(i) for i in range(files)),
                                  add_bos=True)
        await decode_seconds(backend, prompt, 2)  # (the first run pays one-time costs)
        speeds: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(rounds):
            for rowwise in (False, True):
                kernels.rowwise_attention(rowwise)
                prefill = await decode_seconds(backend, prompt, 1)
                whole = await decode_seconds(backend, prompt, tokens)
                speeds[rowwise].append((tokens - 1) / (whole - prefill))
        kernels.rowwise_attention(backend.rowwise_attention)
        on, off = (statistics.median(speeds[flag]) for flag in (True, False))
        print(f"{path.name}: {backend.model.query_heads} query heads, {threads} threads, "
              f"prompt {len(prompt)} tokens: row-wise {on:.2f} tok/s, split {off:.2f} "
              f"({on / off - 1:+.1%}); runs {speeds}", flush=True)
    finally:
        backend.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("--files", type=int, default=8, help="source files in the prompt")
    parser.add_argument("--tokens", type=int, default=257)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(f"CPU class: {this_cpu().as_dict()}", flush=True)
    for path in args.models:
        trio.run(measure, path, args.files, args.tokens, args.rounds, args.threads)


if __name__ == "__main__":
    main()
