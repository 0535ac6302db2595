#!/usr/bin/env python3
"""Several long prompts prefilled together, on the real engine: chunks in equal shares of
the step (what the planner gave before) against chunks cut to whole 64-row tiles (what it
gives on llama.cpp's CPU backend now, `butter/engine/step_plan.py` `_whole_tiles`).

llama.cpp's CPU flash attention evaluates prompt rows in tiles of 64 batch rows and skips
a block of the cache only where the whole tile is masked from it, so a tile that holds two
prompts' rows is computed against what either prompt sees. Prints each layout's seconds
for all the prompts, the layouts interleaved over `--rounds`. Random token ids: the cost
is the same as text's.

Usage (from the repository root, in the project's venv)::

    python benchmarks/prompts_together.py                      # the demo GGUF, 3 x 4096
    python benchmarks/prompts_together.py --model x.gguf --prompts 3 --tokens 1024
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root, not benchmarks/, on sys.path
    import _repo_root  # noqa: F401

from rich.console import Console
from rich.table import Table

from benchmarks.prompt_beside_decodes import demo_model, random_tokens
from butter.backends.base import RemoveTokens, SeqWork
from butter.backends.llama_cpp import LlamaCppBackend

TILE = 64


def equal_shares(prompts: int, budget: int) -> list[list[int]]:
    """One step's shares, the same every step: 85, 85, 86 for 3 prompts of 256."""
    return [[budget // prompts + (i >= prompts - budget % prompts) for i in range(prompts)]]


def whole_tiles(prompts: int, budget: int) -> list[list[int]]:
    """Steps of whole tiles, the extra tiles taking turns: 128, 64, 64 then 64, 128, 64..."""
    tiles = budget // TILE
    each, extra = divmod(tiles, prompts)
    return [[(each + ((i - turn) % prompts < extra)) * TILE for i in range(prompts)]
            for turn in range(prompts)]


def prefill(backend: LlamaCppBackend, rng: random.Random, prompts: int, tokens: int,
            steps: list[list[int]]) -> float:
    """Seconds to prefill `prompts` fresh prompts of `tokens` tokens with these shares."""
    backend.step([RemoveTokens(seq, -1, -1) for seq in range(prompts)], [])
    texts = {seq: random_tokens(rng, backend, tokens) for seq in range(prompts)}
    done = dict.fromkeys(texts, 0)
    started = time.perf_counter()
    step = 0
    while any(done[seq] < tokens for seq in texts):
        works = []
        for seq, share in enumerate(steps[step % len(steps)]):
            size = min(share, tokens - done[seq])
            if size > 0:
                works.append(SeqWork(seq, texts[seq][done[seq]:done[seq] + size], done[seq],
                                     sample=False, prompt=True))
                done[seq] += size
        backend.step([], works)
        step += 1
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF (default: the demo)")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=4096, help="each prompt's tokens")
    parser.add_argument("--budget", type=int, default=256, help="prompt tokens per step")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model = args.model or demo_model()
    backend = LlamaCppBackend(model, n_cells=args.prompts * args.tokens + 1024,
                              n_seq=args.prompts, n_batch=args.budget + 8,
                              threads=args.threads, repack=True)
    rng = random.Random(args.seed)
    layouts = {
        "equal shares": equal_shares(args.prompts, args.budget),
        "whole 64-row tiles": whole_tiles(args.prompts, args.budget),
    }
    seconds: dict[str, list[float]] = {name: [] for name in layouts}
    try:
        for _ in range(args.rounds):
            for name, steps in layouts.items():
                seconds[name].append(prefill(backend, rng, args.prompts, args.tokens, steps))
    finally:
        backend.close()
    table = Table(title=f"{model.name}: {args.prompts} prompts of {args.tokens} tokens "
                        f"prefilled together, {args.budget} tokens per step")
    table.add_column("chunks")
    table.add_column("first step's shares")
    table.add_column("seconds per round", justify="right")
    for name, steps in layouts.items():
        table.add_row(name, "/".join(map(str, steps[0])),
                      ", ".join(f"{s:.1f}" for s in seconds[name]))
    Console().print(table)


if __name__ == "__main__":
    main()
