#!/usr/bin/env python3
"""MLX backend: aggregate decode throughput with and without batched decodes.

Runs the engine in-process on an MLX model (default: the tiny random-weight qwen3 that
the tests build) and sends `--concurrency` generations of `--max-tokens` tokens at once,
first with each session decoding on its own forward pass, then with the decodes batched
through mlx-lm's BatchKVCache (butter's default). Prints completion tok/s for both.

    MLX_DISABLE_COMPILE=1 python benchmarks/mlx_batching.py --concurrency 8
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import trio

from butter.backends.mlx import MlxBackend
from butter.model import Model
from butter.sampling import SamplingParams
from butter.settings import ServeSettings


async def measure(path: Path, concurrency: int, max_tokens: int, batched: bool,
                  kv_cache: str) -> float:
    model = await Model.from_settings(ServeSettings(model=str(path), parallel=concurrency,
                                                    max_context=2048, kv_cache=kv_cache))
    backend = model.resident.backend
    assert isinstance(backend, MlxBackend)
    backend.caches.can_batch = backend.caches.can_batch and batched  # the switch under test
    engine = model.resident.engine
    counts: list[int] = []

    async def lane(i: int) -> None:
        prompt = backend.tokenize(f"Lane {i} writes about boats and the sea", add_bos=False)
        async with engine.generate(prompt, SamplingParams(seed=i, temperature=0.7),
                                   max_tokens) as generation:
            async for _ in generation.pieces():
                pass
        counts.append(generation.completion_tokens)

    try:
        await lane(0)  # warm-up
        counts.clear()
        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(concurrency):
                nursery.start_soon(lane, i)
        return sum(counts) / (time.perf_counter() - started)
    finally:
        await model.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="MLX model directory (default: a tiny random qwen3)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--kv-cache", default="raw", help="raw, affine8 or affine4")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        if args.model:
            path = Path(args.model)
        else:
            from butter.testing.tiny_mlx import write_tiny_qwen3_mlx

            path = write_tiny_qwen3_mlx(Path(scratch) / "tiny")
        for batched in (False, True):
            rate = trio.run(measure, path, args.concurrency, args.max_tokens, batched,
                            args.kv_cache)
            label = "batched decodes" if batched else "one forward pass per session"
            print(f"c={args.concurrency} kv={args.kv_cache} {label}: {rate:.1f} tok/s")


if __name__ == "__main__":
    main()
