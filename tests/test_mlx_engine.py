"""What only the MLX backend does: decodes batched through mlx-lm's batched caches, and
affine-quantized KV caches (tiny MLX model)."""

from __future__ import annotations

from pathlib import Path

import trio

from butter.backends.mlx import MlxBackend
from butter.model import Model
from butter.sampling import SamplingParams
from butter.settings import ServeSettings

PROMPTS = ["The quick brown fox", "Once upon a time", "Numbers: 1, 2, 3", "Boats and the sea"]


async def _load(path: Path, **settings: object) -> tuple[Model, MlxBackend]:
    model = await Model.from_settings(ServeSettings(model=str(path), parallel=4,
                                                    max_context=1024, **settings))
    backend = model.resident.backend
    assert isinstance(backend, MlxBackend)
    return model, backend


async def _greedy(model: Model, text: str, max_tokens: int) -> tuple[bytes, int]:
    tokens = model.resident.backend.tokenize(text, add_bos=False)
    engine = model.resident.engine
    async with engine.generate(tokens, SamplingParams(temperature=0), max_tokens) as gen:
        pieces = [p async for batch in gen.pieces() for p in batch]
    return b"".join(pieces), gen.cached_tokens


async def test_concurrent_decodes_share_one_forward_pass(tiny_mlx: Path) -> None:
    model, backend = await _load(tiny_mlx)
    widest: list[int] = []
    try:
        engine = model.resident.engine

        async def lane(i: int) -> None:
            tokens = backend.tokenize(PROMPTS[i], add_bos=False)
            async with engine.generate(tokens, SamplingParams(seed=i), 24) as gen:
                async for _ in gen.pieces():
                    widest.append(len(backend.decode_batch))

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(lane, i)
        assert max(widest) == 4  # all four decoded in one pass at some step
        assert all(backend.cached_bytes(seq) > 0 for seq in range(4))  # caches kept for reuse
    finally:
        await model.aclose()


async def test_affine_kv_caches_quantize_and_still_reuse_prefixes(tiny_mlx: Path) -> None:
    prompt = "A shared beginning about foxes and dogs, then apples"
    stored: dict[str, int] = {}
    for kv_cache in ("raw", "affine8", "affine4"):
        model, backend = await _load(tiny_mlx, kv_cache=kv_cache)
        try:
            cold, _ = await _greedy(model, prompt, 12)
            stored[kv_cache] = max(backend.cached_bytes(seq) for seq in range(4))
            model.resident.engine.drop_idle_caches()
            await _greedy(model, prompt + " and pears", 4)  # the prompt again, then more
            warm, cached = await _greedy(model, prompt, 12)
            assert cached > 0 and warm == cold  # trimmed, not rebuilt; same greedy tokens
            if kv_cache != "raw":
                assert backend.kv_type.name == f"mlx affine {kv_cache[-1]}-bit / 32"
        finally:
            await model.aclose()
    assert stored["raw"] > stored["affine8"] > stored["affine4"] > 0
