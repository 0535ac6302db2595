"""Images on models whose RoPE has sections (M-RoPE: Qwen2-VL to Qwen3-VL, Qwen3.5; #55).

Such a model gives an image's embeddings a grid of positions (time, height, width): its
cells share one time position, and the text after it goes on from fewer positions than the
image has cells. What is pinned: the positions a sequence's cells map to, kept through
cuts, copies and the host tier (positions.py); that the engine cuts a cache only at an
image's edge (prefix_cache.image_edge); and, on real parts (llama.cpp on the tiny
Qwen3-VL and the tiny hybrid Qwen3.5, libmtmd on the tiny projectors), the same tokens and
logits, bit for bit, as libmtmd's own mtmd_helper_eval_chunks, in any cut of the prompt,
after a cut of the cache at the image, a copy into another sequence, and a round trip
through the host tier."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from butter.backends.base import (
    BackendError,
    CopyPrefix,
    ImageGrid,
    KvOp,
    PromptImage,
    RemoveTokens,
    Restored,
    RestoreSequence,
    Sampled,
    Saved,
    SaveSequence,
    SeqWork,
    SetSampler,
)
from butter.backends.llama_cpp import LlamaCppBackend
from butter.backends.llama_cpp.positions import PlacedImage, SequencePositions
from butter.chat.images import DecodedImage
from butter.engine.prefix_cache import image_edge
from butter.sampling import SamplingParams
from butter.testing.tiny_mmproj import qwen_vl_grid
from tests.test_vision_backend import (
    GREEDY_STEPS,
    N_BATCH,
    Reference,
    _generate,
    _image,
    _prompt,
    _same,
)

# --- positions (pure) ----------------------------------------------------------------------


def _two_images() -> SequencePositions:
    """Text 0..3, an image of 6 cells taking 3 positions at 4..9, text 10..11, an image of
    4 cells taking 4 at 12..15, text from 16."""
    positions = SequencePositions()
    positions.place(0, PlacedImage(4, 6, 3))
    positions.place(0, PlacedImage(12, 4, 4))
    return positions


def test_cells_map_to_the_positions_their_images_take() -> None:
    positions = _two_images()
    assert [positions.position(0, i) for i in range(18)] == [
        0, 1, 2, 3, 4, 4, 4, 4, 4, 4, 7, 8, 9, 9, 9, 9, 13, 14]
    assert positions.shift(0, 10) == 3 and positions.shift(0, 4) == 0
    assert [positions.position(1, i) for i in range(3)] == [0, 1, 2]  # (no images: indices)


def test_the_same_image_placed_again_changes_nothing_and_another_may_not_overlap() -> None:
    positions = _two_images()
    positions.place(0, PlacedImage(4, 6, 3))  # (a prompt chunk that holds its rest)
    assert len(positions.images(0)) == 2
    with pytest.raises(BackendError, match="overlaps"):
        positions.place(0, PlacedImage(8, 4, 2))


def test_a_cut_or_copy_inside_an_image_is_refused_and_at_its_edge_forgets_what_follows(
) -> None:
    positions = _two_images()
    for inside in (5, 9, 13):
        with pytest.raises(BackendError, match="inside an image"):
            positions.cut(0, inside)
        with pytest.raises(BackendError, match="inside an image"):
            positions.copy(0, 1, inside)
    assert positions.copy(0, 1, 12) == 9
    assert positions.images(1) == (PlacedImage(4, 6, 3),)
    assert positions.cut(0, 4) == 4 and positions.images(0) == ()
    positions.cut(1, -1)  # (the whole sequence)
    assert positions.images(1) == ()


def test_a_saved_sequence_carries_its_images_positions() -> None:
    positions = _two_images()
    state = b"llama.cpp's bytes"
    saved = positions.saved_with(0, state)
    positions.forget(0)
    assert positions.restored_from(3, saved) == state
    assert positions.images(3) == (PlacedImage(4, 6, 3), PlacedImage(12, 4, 4))
    with pytest.raises(BackendError):
        positions.restored_from(3, state)


def test_an_image_grid_gives_each_section_from_the_first_position() -> None:
    grid = ImageGrid(((0, 0, 0, 0), (0, 0, 1, 1), (0, 1, 0, 1), (0, 0, 0, 0)),
                     (True, True, True, False), n_pos=2)
    assert grid.sections(10, 1, 3) == [[10, 10, 10], [10, 11, 11], [11, 10, 11], [0, 0, 0]]


def test_the_engine_cuts_a_prompt_only_at_an_images_edge() -> None:
    prompt = [5, 6, -1, -2, -3, 7, -9, -8, 8]
    assert [image_edge(prompt, k) for k in range(len(prompt))] == [0, 1, 2, 2, 2, 5, 6, 6, 8]


# --- on llama.cpp and libmtmd ------------------------------------------------------------


# Two projectors: LLaVA's (16 embeddings in one row: 16 positions, all sharing the time
# one) and Qwen3-VL's (a 64x48 picture: 4 columns x 3 rows, 12 embeddings at 4 positions)
PROJECTORS = ("llava", "qwen-vl")
WIDTH, HEIGHT = 64, 48


@pytest.fixture(scope="module", params=PROJECTORS)
def projector(request: pytest.FixtureRequest, tiny_mmproj_gguf: Path,
              tiny_qwen_vl_mmproj_gguf: Path) -> tuple[str, Path]:
    kind = str(request.param)
    return kind, tiny_mmproj_gguf if kind == "llava" else tiny_qwen_vl_mmproj_gguf


@pytest.fixture(scope="module")
def backend(tiny_qwen3vl_gguf: Path, projector: tuple[str, Path]
            ) -> Iterator[LlamaCppBackend]:
    loaded = LlamaCppBackend(tiny_qwen3vl_gguf, n_cells=256, n_seq=3, n_batch=N_BATCH,
                             threads=2, fast_lm_head=False, mmproj=projector[1])
    yield loaded
    loaded.close()


@pytest.fixture(scope="module")
def reference(tiny_qwen3vl_gguf: Path, projector: tuple[str, Path]) -> Iterator[Reference]:
    ref = Reference(tiny_qwen3vl_gguf, projector[1])
    yield ref
    ref.close()


def picture(seed: int) -> DecodedImage:
    return _image(seed, WIDTH, HEIGHT)


def test_an_image_takes_libmtmds_grid_of_positions(backend: LlamaCppBackend,
                                                  projector: tuple[str, Path]) -> None:
    """The time section stays at the image's first position; height and width move along
    its rows and columns."""
    _, images = _prompt(backend, picture(1))
    image, grid = images[0], images[0].grid
    assert grid is not None
    columns, rows = (16, 1) if projector[0] == "llava" else qwen_vl_grid(WIDTH, HEIGHT)
    assert (image.n_tokens, grid.n_pos) == (columns * rows, max(columns, rows))
    p0 = image.start
    assert grid.sections(p0, 0, image.n_tokens) == [
        [p0] * image.n_tokens,
        [p0 + i // columns for i in range(image.n_tokens)],
        [p0 + i % columns for i in range(image.n_tokens)],
        [0] * image.n_tokens]


def test_an_image_with_m_rope_positions_evaluates_as_libmtmds_helper_does(
        backend: LlamaCppBackend, reference: Reference) -> None:
    image = picture(6)
    ids, images = _prompt(backend, image)
    tokens, logits = _generate(backend, ids, images)
    expected_tokens, expected_logits = reference.generate(image)
    assert tokens == expected_tokens
    assert _same(logits, expected_logits)


def test_the_model_reads_the_grid_not_positions_as_text_takes_them(
        backend: LlamaCppBackend, reference: Reference) -> None:
    """The same embeddings at one position each (as text takes them) give other logits:
    the positions above are what the model sees."""
    image = picture(6)
    ids, images = _prompt(backend, image)
    n = images[0].n_tokens
    flat = ImageGrid(tuple(tuple(range(n)) for _ in range(4)), (True,) * 4, n_pos=n)
    as_text = [PromptImage(images[0].start, n, image, flat)]
    _, logits = _generate(backend, ids, as_text)
    _, expected = reference.generate(image)
    assert np.abs(logits[0] - expected[0]).max() > 1e-3


@pytest.mark.parametrize("cuts", [(12,), (7,), (23,), (3, 10, 20), (20, 26)])
def test_any_cut_of_the_prompt_gives_the_same_bits(backend: LlamaCppBackend,
                                                   cuts: tuple[int, ...]) -> None:
    """Prompt chunks may end inside the image: its cells are written in two runs."""
    ids, images = _prompt(backend, picture(8))
    whole = _generate(backend, ids, images)
    cut = _generate(backend, ids, images, cuts)
    assert cut[0] == whole[0] and _same(cut[1], whole[1])


def _continue(backend: LlamaCppBackend, seq: int, ids: list[int], images: list[PromptImage],
              kept: int, ops: list[KvOp]) -> list[int]:
    """Greedy tokens of `seq` after `ops` (a restore among them must work), its first
    `kept` prompt cells cached."""
    ops = [*ops, SetSampler(seq, SamplingParams(temperature=0))]
    results = backend.step(ops, [SeqWork(seq, tuple(ids[kept:]), kept, sample=True,
                                         prompt=True, images=tuple(images))])
    assert all(r.ok for r in results if isinstance(r, Restored))
    tokens = [r.token for r in results if isinstance(r, Sampled)]
    for step in range(GREEDY_STEPS):
        sampled = backend.step([], [SeqWork(seq, (tokens[-1],), len(ids) + step, sample=True)])
        tokens.append(sampled[0].token)
    return tokens


def test_a_cache_cut_at_the_image_copied_or_restored_continues_as_the_whole_prompt(
        backend: LlamaCppBackend) -> None:
    ids, images = _prompt(backend, picture(9))
    image = images[0]
    expected, _ = _generate(backend, ids, images)  # (seq 0 holds the prompt and 5 tokens)
    with pytest.raises(BackendError, match="inside an image"):
        backend.step([RemoveTokens(0, image.start + 3)], [])
    # Seq 1 gets seq 0's first cells up to past the image; seq 2 the host tier's copy.
    after = image.end + 2
    saved = backend.step([SaveSequence(0)], [])[0]
    assert isinstance(saved, Saved) and saved.data is not None
    assert _continue(backend, 1, ids, images, after,
                     [RemoveTokens(1, -1), CopyPrefix(0, 1, after)]) == expected
    assert _continue(backend, 2, ids, images, after,
                     [RemoveTokens(2, -1), RestoreSequence(2, saved.data, after)]) == expected
    # Seq 0 cut back to the image's start evaluates it again.
    assert _continue(backend, 0, ids, images, image.start,
                     [RemoveTokens(0, image.start)]) == expected
