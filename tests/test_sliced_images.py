"""Pictures a projector slices (SmolVLM's and Idefics3's `idefics3`; #55): libmtmd cuts a
picture into tiles plus an overview, each an image chunk of its own with marker text
between them, every chunk carrying the picture's id.

On real parts (llama.cpp on the tiny Qwen3 whose vocabulary has Idefics3's markers, libmtmd
on the tiny random-weight Idefics3 tower of tiny_mmproj.py: 32-pixel tiles of 4 embeddings):
each piece is an image of its own, told apart from the others and from other pictures; the
same tokens and logits, bit for bit, as libmtmd's own mtmd_helper_eval_chunks, in any cut;
the same when the pieces must be tokenized again (a restored prompt); and end to end, a
sliced picture is counted, cached on the returning turn and told apart from another."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from butter.backends.base import image_token_ids
from butter.backends.llama_cpp import LlamaCppBackend
from butter.backends.llama_cpp import vision as vision_module
from butter.backends.llama_cpp.vision import PENDING_IMAGES, Projector
from butter.errors import InvalidRequest
from butter.testing.tiny_mmproj import (
    idefics3_grid,
    idefics3_image_tokens,
    write_tiny_idefics3_mmproj_gguf,
)
from tests.conftest import ServerProcess
from tests.test_e2e_images import openai_turn, png, with_image
from tests.test_vision_backend import N_BATCH, Reference, _generate, _image, _prompt, _same

WIDE = (64, 32)  # two tiles and the overview


@pytest.fixture(scope="module")
def backend(tiny_idefics3_gguf: Path,
            tiny_idefics3_mmproj_gguf: Path) -> Iterator[LlamaCppBackend]:
    loaded = LlamaCppBackend(tiny_idefics3_gguf, n_cells=256, n_seq=2, n_batch=N_BATCH,
                             threads=2, fast_lm_head=False, mmproj=tiny_idefics3_mmproj_gguf)
    yield loaded
    loaded.close()


@pytest.fixture(scope="module")
def reference(tiny_idefics3_gguf: Path, tiny_idefics3_mmproj_gguf: Path) -> Iterator[Reference]:
    ref = Reference(tiny_idefics3_gguf, tiny_idefics3_mmproj_gguf)
    yield ref
    ref.close()


def test_a_picture_becomes_its_tiles_and_an_overview_each_told_apart(
        backend: LlamaCppBackend) -> None:
    picture = _image(1, *WIDE)
    ids, images = _prompt(backend, picture)
    columns, rows = idefics3_grid(*WIDE)
    assert len(images) == columns * rows + 1 == 3
    assert [image.piece for image in images] == [0, 1, 2]
    assert all(image.image is picture and image.n_tokens == idefics3_image_tokens()
               for image in images)
    assert images[0].key == picture.key and len({image.key for image in images}) == 3
    for image in images:  # each piece's ids are its own, with marker text between them
        assert ids[image.start:image.end] == list(image_token_ids(image.key, image.n_tokens))
    assert images[1].start > images[0].end and images[2].start > images[1].end
    # Another picture of the same size: the same layout, other keys everywhere.
    other_ids, others = _prompt(backend, _image(2, *WIDE))
    assert [image.start for image in others] == [image.start for image in images]
    assert not {image.key for image in images} & {image.key for image in others}
    assert other_ids != ids


def test_the_same_picture_twice_in_a_prompt_is_sliced_twice_alike(
        backend: LlamaCppBackend) -> None:
    picture = _image(3, *WIDE)
    ids, images = backend.tokenize_media(["look ", " and again ", " now"], [picture, picture],
                                         add_bos=True)
    assert [image.piece for image in images] == [0, 1, 2, 0, 1, 2]
    first, second = images[:3], images[3:]
    assert [image.key for image in first] == [image.key for image in second]
    assert ids[first[0].start:first[-1].end] == ids[second[0].start:second[-1].end]


def test_a_sliced_picture_evaluates_as_libmtmds_helper_does_in_any_cut(
        backend: LlamaCppBackend, reference: Reference) -> None:
    picture = _image(6, *WIDE)
    ids, images = _prompt(backend, picture)
    tokens, logits = _generate(backend, ids, images)
    expected_tokens, expected_logits = reference.generate(picture)
    assert tokens == expected_tokens and _same(logits, expected_logits)
    for cuts in [(images[1].start,), (images[0].start + 1, images[2].end),
                 (images[0].end, images[2].start + 3)]:
        cut = _generate(backend, ids, images, cuts)
        assert cut[0] == tokens and _same(cut[1], logits)


def test_pieces_tokenized_again_give_the_same_bits(backend: LlamaCppBackend,
                                                   reference: Reference) -> None:
    """A picture whose tokenized pieces were dropped (other prompts since, or a prompt
    restored from the host tier) is tokenized again, piece by piece: the same pixels."""
    picture = _image(7, 96, 64)  # three tiles by two and the overview
    ids, images = _prompt(backend, picture)
    assert len(images) == 7
    for seed in range(PENDING_IMAGES + 1):  # (other prompts push its pieces out)
        _prompt(backend, _image(100 + seed, 33, 33))
    tokens, logits = _generate(backend, ids, images)
    expected_tokens, expected_logits = reference.generate(picture)
    assert tokens == expected_tokens and _same(logits, expected_logits)


def test_pictures_of_more_pieces_than_pending_holds_are_tokenized_again_at_most_once(
        tiny_idefics3_gguf: Path, tiny_idefics3_mmproj_gguf: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A picture of more pieces than PENDING_IMAGES keeps them all until its encode; of two
    such pictures, the older one's are dropped and each is tokenized again once, with the
    same bits as when nothing is dropped."""
    retokenized: list[int] = []
    real = Projector._image_chunk

    def counted(self: Projector, image: Any) -> Any:
        retokenized.append(image.piece)
        return real(self, image)

    def backend() -> LlamaCppBackend:
        return LlamaCppBackend(tiny_idefics3_gguf, n_cells=1024, n_seq=1, n_batch=N_BATCH,
                               threads=2, fast_lm_head=False, mmproj=tiny_idefics3_mmproj_gguf)

    monkeypatch.setattr(Projector, "_image_chunk", counted)
    first, second = _image(20, 160, 128), _image(21, 160, 128)  # 5 x 4 tiles each
    texts = ["look ", " and ", ""]
    monkeypatch.setattr(vision_module, "PENDING_IMAGES", 64)  # (nothing dropped)
    roomy = backend()
    try:
        expected = _generate(roomy, *roomy.tokenize_media(texts, [first, second], add_bos=True))
    finally:
        roomy.close()
    assert retokenized == []
    monkeypatch.setattr(vision_module, "PENDING_IMAGES", PENDING_IMAGES)
    big = backend()
    try:
        ids, images = big.tokenize_media(["look ", ""], [first], add_bos=True)
        assert len(images) == 21 > PENDING_IMAGES
        _generate(big, ids, images)
        assert retokenized == []  # (all 21 pieces kept until their encode)
        both = _generate(big, *big.tokenize_media(texts, [first, second], add_bos=True))
        assert retokenized == [0, 0]  # (each picture's first piece, once)
        assert both[0] == expected[0] and _same(both[1], expected[1])
    finally:
        big.close()


def test_a_picture_the_projector_refuses_is_the_clients_error(
        tiny_idefics3_gguf: Path, tmp_path: Path) -> None:
    projector = write_tiny_idefics3_mmproj_gguf(tmp_path / "smolvlm.gguf", longest_edge=64)
    backend = LlamaCppBackend(tiny_idefics3_gguf, n_cells=256, n_seq=1, n_batch=N_BATCH,
                              threads=1, mmproj=projector)
    try:
        with pytest.raises(ValueError):  # (libmtmd resizes a 200 x 1 picture to 64 x 0)
            idefics3_grid(200, 1, longest_edge=64)
        with pytest.raises(InvalidRequest, match="cannot take this image"):
            backend.tokenize_media(["look ", ""], [_image(22, 200, 1)], add_bos=True)
        _, images = backend.tokenize_media(["look ", ""], [_image(23, 64, 32)],
                                           add_bos=True)  # (the projector still serves)
        assert len(images) == 3
    finally:
        backend.close()


def test_a_sliced_picture_is_counted_cached_and_told_apart_end_to_end(
        tiny_idefics3_gguf: Path, tiny_idefics3_mmproj_gguf: Path) -> None:
    process = ServerProcess(["--model", str(tiny_idefics3_gguf),
                             "--mmproj", str(tiny_idefics3_mmproj_gguf), "--alias", "tiny-vision",
                             "--parallel", "1", "--max-context", "1024", "--prefill-chunk", "8"])
    try:
        client = openai.OpenAI(base_url=process.api, api_key="unused")
        question = "What colour is this picture? Look closely."
        _, text_prompt, _ = openai_turn(client, [{"role": "user", "content": question}])
        first = [with_image(question, png((200, 20, 20), WIDE))]
        answer, prompt, _ = openai_turn(client, first)
        # (three pieces' embeddings and the markers around them)
        assert prompt > text_prompt + 3 * idefics3_image_tokens()
        returning = [*first, {"role": "assistant", "content": answer},
                     {"role": "user", "content": "And its shape?"}]
        _, _, cached = openai_turn(client, returning)
        assert cached >= prompt - 1
        _, blue_prompt, blue_cached = openai_turn(
            client, [with_image(question, png((20, 20, 200), WIDE))])
        assert blue_prompt == prompt
        assert blue_cached < prompt - 3 * idefics3_image_tokens()  # (stops at the first tile)
    finally:
        process.stop()
