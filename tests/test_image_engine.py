"""Images in the engine (#55): a prompt with an image prefilled over several steps, and a
request cancelled while its image is evaluated, on the real engine with the tiny Qwen3
and the tiny projector, and with the tiny Qwen3-VL, whose images take M-RoPE positions."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trio

from butter.backends.base import KvOp, PromptImage, SeqWork
from butter.chat.images import DecodedImage, content_key
from butter.engine.engine import Engine
from butter.engine.generation import Generation
from butter.pipeline.resident import ResidentModel
from butter.sampling import SamplingParams
from butter.settings import ServeSettings
from tests.backend_steps import forget_everything

CHUNK = 8  # (an image of 16 positions spans three prompt chunks; of 9, two)


@pytest.fixture(scope="module", params=["qwen3-llava", "qwen3vl-qwen-vl", "qwen3-gemma3",
                                               "qwen3-idefics3"])
def resident(request: pytest.FixtureRequest, tiny_gguf: Path, tiny_mmproj_gguf: Path,
             tiny_qwen3vl_gguf: Path, tiny_qwen_vl_mmproj_gguf: Path,
             tiny_gemma3_mmproj_gguf: Path, tiny_idefics3_gguf: Path,
             tiny_idefics3_mmproj_gguf: Path) -> Iterator[ResidentModel]:
    """The tiny Qwen3 with LLaVA's projector (16 positions an image), the tiny Qwen3-VL
    with Qwen3-VL's (a 32x32 picture: 9 embeddings at 3 M-RoPE positions), or the tiny
    Qwen3 with Gemma 3's (16 embeddings that see each other: evaluated whole, in a chunk
    of its own past the chunk size), or the tiny Qwen3 with Idefics3's (a picture sliced:
    a 32 pixel tile and the overview, 4 embeddings each, marker text between them)."""
    model_path, projector = {
        "qwen3-llava": (tiny_gguf, tiny_mmproj_gguf),
        "qwen3vl-qwen-vl": (tiny_qwen3vl_gguf, tiny_qwen_vl_mmproj_gguf),
        "qwen3-gemma3": (tiny_gguf, tiny_gemma3_mmproj_gguf),
        "qwen3-idefics3": (tiny_idefics3_gguf, tiny_idefics3_mmproj_gguf)}[str(request.param)]
    model = ResidentModel.load_sync(ServeSettings(
        model=str(model_path), mmproj=str(projector), parallel=2, max_context=512,
        prefill_chunk=CHUNK, threads=2))
    yield model
    model.close()


@pytest.fixture
async def engine(resident: ResidentModel) -> AsyncIterator[Engine]:
    forget_everything(resident.backend)
    fresh = Engine(resident.backend, parallel=2, max_context=512, prefill_chunk=CHUNK,
                   max_queue=8)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fresh.step_loop)
        yield fresh
        nursery.cancel_scope.cancel()
    forget_everything(resident.backend)


def picture(shade: int) -> DecodedImage:
    rgb = bytes([shade, 255 - shade, shade // 2]) * (32 * 32)
    return DecodedImage(key=content_key(32, 32, rgb), width=32, height=32, rgb=rgb)


def prompt_with(resident: ResidentModel, image: DecodedImage
                ) -> tuple[list[int], list[PromptImage]]:
    return resident.tokenize_media(["Look at this: ", " and say what it shows."], [image])


async def greedy(engine: Engine, prompt: tuple[list[int], list[PromptImage]],
                 max_tokens: int = 6) -> tuple[bytes, Generation]:
    ids, images = prompt
    async with engine.generate_choices(ids, [SamplingParams(temperature=0.0, seed=1)],
                                       max_tokens, images=images) as (generation,):
        pieces = [b"".join(batch) async for batch in generation.pieces()]
    return b"".join(pieces), generation


async def test_an_image_prefilled_over_several_chunks_is_cached_whole(
    resident: ResidentModel, engine: Engine
) -> None:
    prompt = prompt_with(resident, picture(40))
    cold, first = await greedy(engine, prompt)
    assert first.cached_tokens == 0 and len(prompt[0]) > 3 * CHUNK
    again, second = await greedy(engine, prompt)
    assert second.cached_tokens == len(prompt[0]) - 1 and again == cold
    other, third = await greedy(engine, prompt_with(resident, picture(200)))
    assert third.cached_tokens == prompt[1][0].start  # (the text before the image alone)
    assert other != cold


async def test_a_request_cancelled_while_its_image_is_evaluated_releases_everything(
    resident: ResidentModel, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = prompt_with(resident, picture(90))
    backend = resident.backend
    submit = backend.submit_step
    seen: list[SeqWork] = []

    with trio.CancelScope() as scope:
        def cancel_at_the_image(ops: list[KvOp], works: list[SeqWork]):  # type: ignore[no-untyped-def]
            if any(work.images for work in works):
                seen.extend(work for work in works if work.images)
                scope.cancel()  # (the client leaves while its image is evaluated)
            return submit(ops, works)

        monkeypatch.setattr(backend, "submit_step", cancel_at_the_image)
        await greedy(engine, prompt, max_tokens=50)
    monkeypatch.setattr(backend, "submit_step", submit)
    assert seen, "a step evaluated the image"
    text, after = await greedy(engine, prompt)  # the next request runs as a cold one would
    stats = engine.stats()
    assert stats.active == 0 and stats.reserved_cells == 0
    engine.drop_idle_caches()
    cold, _ = await greedy(engine, prompt)
    assert text == cold and after.completion_tokens == 6
