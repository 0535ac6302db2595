"""The engine over the MLX backend (tiny MLX model): batching changes no token."""

from __future__ import annotations

from pathlib import Path

import trio

from butter.model import Model
from butter.sampling import SamplingParams
from butter.settings import ServeSettings

PROMPTS = ["The quick brown fox", "Once upon a time", "Numbers: 1, 2, 3", "Boats and the sea"]


async def _run(model: Model, prompt: list[int], seed: int) -> tuple[bytes, int]:
    engine = model.resident.engine
    async with engine.generate(prompt, SamplingParams(seed=seed, temperature=0.8), 16) as gen:
        pieces = [p async for batch in gen.pieces() for p in batch]
    return b"".join(pieces), gen.completion_tokens


async def test_concurrent_equals_sequential_on_mlx(tiny_mlx: Path) -> None:
    model = await Model.from_settings(ServeSettings(model=str(tiny_mlx), parallel=4,
                                                    max_context=1024))
    try:
        prompts = [model.resident.backend.tokenize(p, add_bos=False) for p in PROMPTS]
        sequential = [await _run(model, p, seed=i) for i, p in enumerate(prompts)]
        model.resident.engine.drop_idle_caches()
        results: dict[int, tuple[bytes, int]] = {}

        async def lane(i: int) -> None:
            results[i] = await _run(model, prompts[i], seed=i)

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(lane, i)
        assert [results[i] for i in range(4)] == sequential
        assert sum(count for _, count in sequential) >= 12  # not a vacuous comparison
    finally:
        await model.aclose()
