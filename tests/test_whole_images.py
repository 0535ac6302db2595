"""Images whose embeddings see each other (Gemma 3's projector; #55): libmtmd decodes them
with the text model's causal mask off, so an image is evaluated whole, in one llama_decode.

On real parts (llama.cpp on the tiny Qwen3, libmtmd on the tiny random-weight Gemma 3
tower of tiny_mmproj.py: 16 embeddings an image): the same tokens and logits, bit for bit,
as libmtmd's own mtmd_helper_eval_chunks, whole or cut at the image's edges; a cut inside
the image is refused; the same rows under the causal mask give other logits (the mask is
what the model sees); a projector whose images cannot fit one batch is refused at load."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import attrs
import numpy as np
import pytest

from butter.backends.base import BackendError
from butter.backends.llama_cpp import LlamaCppBackend
from butter.errors import ModelLoadError
from butter.testing.tiny_mmproj import gemma3_image_tokens, write_tiny_gemma3_mmproj_gguf
from tests.test_vision_backend import N_BATCH, Reference, _generate, _image, _prompt, _same


@pytest.fixture(scope="module")
def backend(tiny_gguf: Path, tiny_gemma3_mmproj_gguf: Path) -> Iterator[LlamaCppBackend]:
    loaded = LlamaCppBackend(tiny_gguf, n_cells=256, n_seq=2, n_batch=N_BATCH, threads=2,
                             fast_lm_head=False, mmproj=tiny_gemma3_mmproj_gguf)
    yield loaded
    loaded.close()


@pytest.fixture(scope="module")
def reference(tiny_gguf: Path, tiny_gemma3_mmproj_gguf: Path) -> Iterator[Reference]:
    ref = Reference(tiny_gguf, tiny_gemma3_mmproj_gguf)
    yield ref
    ref.close()


def test_an_image_is_marked_to_be_evaluated_whole(backend: LlamaCppBackend) -> None:
    _, images = _prompt(backend, _image(1))
    assert not images[0].causal and images[0].n_tokens == gemma3_image_tokens()


def test_an_image_evaluated_whole_gives_libmtmds_bits(backend: LlamaCppBackend,
                                                     reference: Reference) -> None:
    image = _image(6)
    ids, images = _prompt(backend, image)
    tokens, logits = _generate(backend, ids, images)
    expected_tokens, expected_logits = reference.generate(image)
    assert tokens == expected_tokens
    assert _same(logits, expected_logits)


def test_the_same_rows_under_the_causal_mask_give_other_logits(
        backend: LlamaCppBackend, reference: Reference) -> None:
    image = _image(6)
    ids, images = _prompt(backend, image)
    _, logits = _generate(backend, ids, [attrs.evolve(images[0], causal=True)])
    _, expected = reference.generate(image)
    assert np.abs(logits[0] - expected[0]).max() > 1e-3


def test_cuts_at_the_images_edges_give_the_same_bits_and_inside_it_are_refused(
        backend: LlamaCppBackend) -> None:
    ids, images = _prompt(backend, _image(8))
    start, end = images[0].start, images[0].end
    whole = _generate(backend, ids, images)
    for cuts in [(start,), (end,), (3, start, end + 2)]:
        cut = _generate(backend, ids, images, cuts)
        assert cut[0] == whole[0] and _same(cut[1], whole[1])
    with pytest.raises(BackendError, match="evaluated whole"):
        _generate(backend, ids, images, (start + 3,))


def test_a_projector_whose_images_do_not_fit_a_batch_is_refused_at_load(
        tiny_gguf: Path, tmp_path: Path) -> None:
    big = write_tiny_gemma3_mmproj_gguf(tmp_path / "big.gguf", image_size=128, patch_size=4,
                                        pool=2)  # (256 embeddings an image)
    with pytest.raises(ModelLoadError, match="raise --prefill-chunk"):
        LlamaCppBackend(tiny_gguf, n_cells=512, n_seq=1, n_batch=N_BATCH, threads=1,
                        mmproj=big)
