"""A prompt's pictures tokenized once (#55): libmtmd resizes and normalizes a picture each
time it tokenizes it, and a conversation sends its pictures again with every turn. The
projector keeps what libmtmd made of each picture alone (its layout: marker text, pieces,
image ids) and splices prompts from their texts and those layouts.

On real parts (llama.cpp's tiny Qwen3 or Qwen3-VL, libmtmd on each tiny projector kind:
LLaVA's, Qwen3-VL's M-RoPE, Gemma 3's non-causal, Idefics3's slicing): a spliced prompt
is, value for value, the one libmtmd makes of the whole prompt, whatever the texts around
its pictures; a picture seen before is not tokenized by libmtmd again; and a projector
whose splice disagrees with libmtmd at load is never spliced."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp.mtmd_cpp as mtmd
import numpy as np
import pytest

from butter.backends.llama_cpp import LlamaCppBackend
from butter.backends.llama_cpp import vision as vision_module
from butter.backends.llama_cpp.vision import Projector, _placements
from butter.chat.images import DecodedImage, content_key

KINDS = ["qwen3-llava", "qwen3vl-qwen-vl", "qwen3-gemma3", "qwen3-idefics3"]


def _picture(seed: int, width: int, height: int) -> DecodedImage:
    rgb = np.random.default_rng(seed).integers(0, 256, (height, width, 3),
                                               dtype=np.uint8).tobytes()
    return DecodedImage(content_key(width, height, rgb), width, height, rgb)


def _projector(backend: LlamaCppBackend) -> Projector:
    found = [value for value in vars(backend).values() if isinstance(value, Projector)]
    assert len(found) == 1
    return found[0]


@pytest.fixture(scope="module", params=KINDS)
def backend(request: pytest.FixtureRequest, tiny_gguf: Path, tiny_mmproj_gguf: Path,
            tiny_qwen3vl_gguf: Path, tiny_qwen_vl_mmproj_gguf: Path,
            tiny_gemma3_mmproj_gguf: Path, tiny_idefics3_gguf: Path,
            tiny_idefics3_mmproj_gguf: Path) -> Iterator[LlamaCppBackend]:
    model, projector = {
        "qwen3-llava": (tiny_gguf, tiny_mmproj_gguf),
        "qwen3vl-qwen-vl": (tiny_qwen3vl_gguf, tiny_qwen_vl_mmproj_gguf),
        "qwen3-gemma3": (tiny_gguf, tiny_gemma3_mmproj_gguf),
        "qwen3-idefics3": (tiny_idefics3_gguf, tiny_idefics3_mmproj_gguf)}[str(request.param)]
    loaded = LlamaCppBackend(model, n_cells=512, n_seq=2, n_batch=64, threads=2,
                             mmproj=projector)
    yield loaded
    loaded.close()


PROMPTS: list[tuple[list[str], list[tuple[int, int, int]]]] = [
    (["describe ", " please"], [(1, 32, 32)]),
    (["", " what is it?"], [(2, 64, 32)]),  # (a picture first)
    (["a ", "", " and <|im_start|> b"], [(3, 40, 30), (4, 32, 64)]),  # (adjacent pictures)
    (["same ", " twice ", ""], [(5, 48, 48), (5, 48, 48)]),  # (one picture twice, last)
]


@pytest.mark.parametrize("add_bos", [True, False])
def test_a_spliced_prompt_is_libmtmds_whole_prompt(backend: LlamaCppBackend,
                                                   add_bos: bool) -> None:
    projector = _projector(backend)
    assert projector.splices
    for texts, shapes in PROMPTS:
        pictures = [_picture(*shape) for shape in shapes]
        whole = projector._whole(texts, pictures, add_bos=add_bos)
        first = backend.tokenize_media(texts, pictures, add_bos=add_bos)
        again = backend.tokenize_media(texts, pictures, add_bos=add_bos)  # (layouts known)
        assert _placements(first) == _placements(whole)
        assert _placements(again) == _placements(whole)
        # Each piece carries this request's own picture (piece 0 starts the next one).
        starts = [index for index, image in enumerate(again[1]) if image.piece == 0]
        assert len(starts) == len(pictures)
        for picture, start, end in zip(pictures, starts, [*starts[1:], len(again[1])],
                                       strict=True):
            assert all(image.image is picture for image in again[1][start:end])


def test_a_picture_seen_before_is_not_tokenized_by_libmtmd_again(
        backend: LlamaCppBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = mtmd.mtmd_tokenize_from_parts

    def counted(*args: Any) -> Any:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(vision_module.mtmd, "mtmd_tokenize_from_parts", counted)
    old, new = _picture(10, 32, 32), _picture(11, 32, 32)
    backend.tokenize_media(["look ", " now"], [old], add_bos=True)
    assert len(calls) == 1
    # The next turn: the same picture with more text around it, and a new one.
    backend.tokenize_media(["look ", " now, and answer, then ", " too"], [old, new],
                           add_bos=True)
    assert len(calls) == 2  # (the new picture alone)
    backend.tokenize_media(["again: ", " and ", ""], [new, old], add_bos=True)
    assert len(calls) == 2


def test_a_projector_whose_splice_disagrees_at_load_is_never_spliced(
        tiny_gguf: Path, tiny_mmproj_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = Projector._text_ids

    def one_short(self: Projector, text: str) -> list[int]:  # (a splice that is off)
        return real(self, text)[:-1]

    monkeypatch.setattr(Projector, "_text_ids", one_short)
    backend = LlamaCppBackend(tiny_gguf, n_cells=256, n_seq=1, n_batch=64, threads=1,
                              mmproj=tiny_mmproj_gguf)
    try:
        projector = _projector(backend)
        assert not projector.splices
        picture = _picture(12, 32, 32)
        texts = ["describe ", " please"]
        assert _placements(backend.tokenize_media(texts, [picture], add_bos=True)) == (
            _placements(projector._whole(texts, [picture], add_bos=True)))
    finally:
        backend.close()
