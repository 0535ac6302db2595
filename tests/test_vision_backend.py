"""The llama.cpp backend's vision projector (#55) on real parts: llama.cpp on the tiny Qwen3
of tiny_gguf.py and libmtmd on the tiny random-weight projector of tiny_mmproj.py (LLaVA's
`mlp`: 16 embeddings an image, decoded causally, one position each).

What is pinned: loading (`--mmproj`, refusals with libmtmd's reason, the projector found
beside a model in the HuggingFace cache), tokenize_media's ids and positions, and a step
that evaluates a prompt with an image: the same greedy tokens and logits, bit for bit, as
libmtmd's own mtmd_helper_eval_chunks, in any cut of the prompt into works."""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import llama_cpp as ll
import llama_cpp.mtmd_cpp as mtmd
import numpy as np
import pytest

from butter.backends.base import (
    BackendError,
    PromptImage,
    RemoveTokens,
    SeqWork,
    SetSampler,
    image_token_ids,
)
from butter.backends.llama_cpp import LlamaCppBackend
from butter.backends.llama_cpp.batch import image_runs
from butter.chat.images import DecodedImage, content_key
from butter.errors import ModelLoadError
from butter.models import ModelCatalog, projector_beside, resolve_model
from butter.pipeline.resident import ResidentModel, _load_backend, projector_for
from butter.sampling import SamplingParams
from butter.settings import ServeSettings
from butter.testing.tiny_mmproj import image_tokens, write_tiny_mmproj_gguf
from tests.conftest import ServerProcess

IMAGE_TOKENS = image_tokens()  # 16
N_BATCH = 64
GREEDY_STEPS = 4
BEFORE, AFTER = "describe ", " please"


def _image(seed: int, width: int = 32, height: int = 32) -> DecodedImage:
    rgb = np.random.default_rng(seed).integers(0, 256, (height, width, 3),
                                               dtype=np.uint8).tobytes()
    return DecodedImage(content_key(width, height, rgb), width, height, rgb)


@pytest.fixture(scope="module")
def backend(tiny_gguf: Path, tiny_mmproj_gguf: Path) -> Iterator[LlamaCppBackend]:
    """llama.cpp's logits throughout (butter's own projection rounds otherwise), so that
    they compare bit for bit with libmtmd's helper."""
    loaded = LlamaCppBackend(tiny_gguf, n_cells=256, n_seq=2, n_batch=N_BATCH, threads=2,
                             fast_lm_head=False, mmproj=tiny_mmproj_gguf)
    yield loaded
    loaded.close()


# --- what a step gives ------------------------------------------------------------------

def _prompt(backend: LlamaCppBackend, image: DecodedImage, after: str = AFTER
            ) -> tuple[list[int], list[PromptImage]]:
    return backend.tokenize_media([BEFORE, after], [image], add_bos=True)


def _generate(backend: LlamaCppBackend, ids: list[int], images: list[PromptImage],
              cuts: tuple[int, ...] = ()) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens after the prompt evaluated cold in works cut at `cuts`, and the logits
    each was taken from."""
    ops = [RemoveTokens(0, -1, -1), SetSampler(0, SamplingParams(temperature=0))]
    bounds = [0, *cuts, len(ids)]
    for start, end in itertools.pairwise(bounds):
        last = end == len(ids)
        sampled = backend.step(ops, [SeqWork(0, tuple(ids[start:end]), start, sample=last,
                                             prompt=True, images=tuple(images))])
        ops = []
    # The last decode of the prompt was its last run's: tokens after the last image, or the
    # image's own rows.
    after = len(ids) - max([image.end for image in images] + [bounds[-2]])
    last_row = (after if after > 0 else min(IMAGE_TOKENS, len(ids) - bounds[-2])) - 1
    logits = [np.asarray(backend.step_logits(last_row)).copy()]
    tokens = [sampled[0].token]
    for step in range(GREEDY_STEPS):
        sampled = backend.step([], [SeqWork(0, (tokens[-1],), len(ids) + step, sample=True)])
        tokens.append(sampled[0].token)
        logits.append(np.asarray(backend.step_logits(0)).copy())
    assert tokens[0] == int(np.argmax(logits[0]))
    return tokens, logits


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(np.array_equal(x.view(np.uint32), y.view(np.uint32))
               for x, y in zip(a, b, strict=True))


# --- libmtmd's own evaluation, in a context of its own -----------------------------------

class Reference:
    """The tiny model and projector loaded again, raw: the prompt evaluated by libmtmd's
    mtmd_helper_eval_chunks (or, ending on an image, encoded and decoded by hand)."""

    def __init__(self, model_path: Path, projector: Path) -> None:
        self.model = ll.llama_model_load_from_file(str(model_path).encode(),
                                                   ll.llama_model_default_params())
        params = ll.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = 256, N_BATCH + 8, N_BATCH + 8
        params.n_threads = params.n_threads_batch = 2
        self.ctx = ll.llama_init_from_model(self.model, params)
        mparams = mtmd.mtmd_context_params_default()
        mparams.use_gpu, mparams.n_threads, mparams.print_timings = False, 2, False
        self.mctx = mtmd.mtmd_init_from_file(str(projector).encode(), self.model, mparams)
        assert self.model and self.ctx and self.mctx
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        self.n_embd = ll.llama_model_n_embd_inp(self.model)

    def close(self) -> None:
        mtmd.mtmd_free(self.mctx)
        ll.llama_free(self.ctx)
        ll.llama_model_free(self.model)

    def generate(self, image: DecodedImage, after: str = AFTER) -> tuple[list[int],
                                                                        list[np.ndarray]]:
        ll.llama_memory_clear(ll.llama_get_memory(self.ctx), True)
        prompt = (BEFORE + mtmd.mtmd_default_marker().decode() + after).encode()
        text = mtmd.mtmd_input_text(prompt, len(prompt), True, True)
        bitmap = mtmd.mtmd_bitmap_init(image.width, image.height,
                                       (ctypes.c_uint8 * len(image.rgb)).from_buffer_copy(
                                           image.rgb))
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            assert mtmd.mtmd_tokenize(self.mctx, chunks, ctypes.byref(text),
                                      (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) == 0
            if after:
                n_past = ll.llama_pos(0)
                assert mtmd.mtmd_helper_eval_chunks(self.mctx, self.ctx, chunks, 0, 0,
                                                    N_BATCH + 8, True,
                                                    ctypes.byref(n_past)) == 0
                position = int(n_past.value)
            else:
                position = self._by_hand(chunks)
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            mtmd.mtmd_bitmap_free(bitmap)
        logits = [self._logits()]
        tokens: list[int] = []
        for step in range(GREEDY_STEPS + 1):
            tokens.append(int(np.argmax(logits[-1])))
            if step < GREEDY_STEPS:
                self._decode(tokens[-1], position=position + step)
                logits.append(self._logits())
        return tokens, logits

    def _by_hand(self, chunks: Any) -> int:
        """Text chunks as tokens, the image encoded and decoded as embedding rows, logits
        on the last row (the helper's embedding batches ask for none)."""
        position = 0
        for index in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, index)
            if mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                count = ctypes.c_size_t(0)
                tokens = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(count))
                self._decode(*tokens[:count.value], position=position, logits=False)
                position += count.value
                continue
            assert mtmd.mtmd_encode_chunk(self.mctx, chunk) == 0
            n_tokens = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
            embd = mtmd.mtmd_get_output_embd(self.mctx)
            batch = ll.llama_batch_init(n_tokens, self.n_embd, 1)
            ctypes.memmove(batch.embd, embd, n_tokens * self.n_embd * 4)
            batch.n_tokens = n_tokens
            for row in range(n_tokens):
                batch.pos[row], batch.n_seq_id[row], batch.seq_id[row][0] = position + row, 1, 0
                batch.logits[row] = row == n_tokens - 1
            assert ll.llama_decode(self.ctx, batch) == 0
            ll.llama_batch_free(batch)
            position += n_tokens
        return position

    def _decode(self, *tokens: int, position: int, logits: bool = True) -> None:
        """One batch of tokens from `position`, logits on the last where asked."""
        batch = ll.llama_batch_init(len(tokens), 0, 1)
        batch.n_tokens = len(tokens)
        for row, token in enumerate(tokens):
            batch.token[row], batch.pos[row] = token, position + row
            batch.n_seq_id[row], batch.seq_id[row][0] = 1, 0
            batch.logits[row] = logits and row == len(tokens) - 1
        assert ll.llama_decode(self.ctx, batch) == 0
        ll.llama_batch_free(batch)

    def _logits(self) -> np.ndarray:
        return np.ctypeslib.as_array(ll.llama_get_logits_ith(self.ctx, -1),
                                     shape=(self.n_vocab,)).copy()


@pytest.fixture(scope="module")
def reference(tiny_gguf: Path, tiny_mmproj_gguf: Path) -> Iterator[Reference]:
    ref = Reference(tiny_gguf, tiny_mmproj_gguf)
    yield ref
    ref.close()


# --- loading ----------------------------------------------------------------------------

def test_a_backend_with_the_projector_sees_images(backend: LlamaCppBackend,
                                                  tiny_mmproj_gguf: Path) -> None:
    assert backend.vision
    projector = backend.diagnostics()["projector"]
    assert projector["path"] == str(tiny_mmproj_gguf)
    assert projector["type"] == "mlp"


def test_without_a_projector_there_is_no_image_path(tiny_gguf: Path) -> None:
    plain = LlamaCppBackend(tiny_gguf, n_cells=128, n_seq=1, n_batch=N_BATCH, threads=1)
    try:
        assert not plain.vision
        assert plain.diagnostics()["projector"] is None
        with pytest.raises(BackendError, match="no projector"):
            plain.tokenize_media(["a", "b"], [_image(0)], add_bos=True)
    finally:
        plain.close()


def test_a_projector_of_another_width_is_refused_with_libmtmds_reason(
        tiny_gguf: Path, tmp_path: Path) -> None:
    narrow = write_tiny_mmproj_gguf(tmp_path / "narrow-mmproj.gguf", n_embd_text=32)
    with pytest.raises(ModelLoadError) as refused:
        LlamaCppBackend(tiny_gguf, n_cells=128, n_seq=1, n_batch=N_BATCH, threads=1,
                        mmproj=narrow)
    assert "mismatch between text model (n_embd = 64) and mmproj (n_embd = 32)" in str(
        refused.value)
    assert str(narrow) in str(refused.value)


def test_a_missing_or_foreign_file_is_refused(tiny_gguf: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="projector file not found"):
        LlamaCppBackend(tiny_gguf, n_cells=128, n_seq=1, n_batch=N_BATCH, threads=1,
                        mmproj=tmp_path / "missing.gguf")
    # The text model is a GGUF, but no projector.
    with pytest.raises(ModelLoadError, match="it is a qwen3 model, not a projector"):
        LlamaCppBackend(tiny_gguf, n_cells=128, n_seq=1, n_batch=N_BATCH, threads=1,
                        mmproj=tiny_gguf)


# --- tokenizing -------------------------------------------------------------------------

def test_tokenize_media_puts_the_images_ids_between_the_texts_tokens(
        backend: LlamaCppBackend) -> None:
    first, second = _image(1, 50, 20), _image(2, 7, 90)
    texts = ["describe ", " and ", " please"]
    ids, images = backend.tokenize_media(texts, [first, second], add_bos=True)
    pieces = [backend.tokenize(texts[0], add_bos=True),
              backend.tokenize(texts[1], add_bos=False),
              backend.tokenize(texts[2], add_bos=False)]
    expected = [*pieces[0], *image_token_ids(first.key, IMAGE_TOKENS), *pieces[1],
                *image_token_ids(second.key, IMAGE_TOKENS), *pieces[2]]
    assert ids == expected
    assert [(image.start, image.n_tokens, image.image) for image in images] == [
        (len(pieces[0]), IMAGE_TOKENS, first),
        (len(pieces[0]) + IMAGE_TOKENS + len(pieces[1]), IMAGE_TOKENS, second)]
    # Without images it is the text's tokenization; a marker a user writes is only text.
    marker = mtmd.mtmd_default_marker().decode()
    text = f"look: {marker} <|im_start|>"
    assert backend.tokenize_media([text], [], add_bos=True) == (
        backend.tokenize(text, add_bos=True), [])


def test_tokenize_media_refuses_pieces_that_do_not_pair_up(backend: LlamaCppBackend) -> None:
    with pytest.raises(BackendError, match="one more"):
        backend.tokenize_media(["a", "b"], [], add_bos=True)
    broken = DecodedImage("ab" * 32, 4, 4, b"\0" * 5)
    with pytest.raises(BackendError, match="RGB bytes"):
        backend.tokenize_media(["a", "b"], [broken], add_bos=True)


def test_a_works_rows_are_cut_into_text_and_image_runs() -> None:
    image = PromptImage(4, IMAGE_TOKENS, _image(3))
    ids = tuple(range(4)) + image_token_ids(image.image.key, IMAGE_TOKENS) + (7, 8)
    whole = SeqWork(0, ids, 0, sample=True, prompt=True, images=(image,))
    assert image_runs(whole) == [(0, 4, None), (4, 20, image), (20, 22, None)]
    inside = SeqWork(0, ids[10:], 10, sample=True, prompt=True, images=(image,))
    assert image_runs(inside) == [(0, 10, image), (10, 12, None)]
    text_only = SeqWork(0, ids[20:], 20, sample=True, prompt=True, images=(image,))
    assert image_runs(text_only) == [(0, 2, None)]


# --- evaluating -------------------------------------------------------------------------

def test_a_prompt_with_an_image_evaluates_as_libmtmds_helper_does(
        backend: LlamaCppBackend, reference: Reference) -> None:
    image = _image(6)
    ids, images = _prompt(backend, image)
    tokens, logits = _generate(backend, ids, images)
    expected_tokens, expected_logits = reference.generate(image)
    assert tokens == expected_tokens
    assert _same(logits, expected_logits)


def test_a_prompt_that_ends_on_an_image_samples_its_last_embedding(
        backend: LlamaCppBackend, reference: Reference) -> None:
    image = _image(7)
    ids, images = _prompt(backend, image, after="")
    assert images[0].end == len(ids)
    tokens, logits = _generate(backend, ids, images)
    expected_tokens, expected_logits = reference.generate(image, after="")
    assert tokens == expected_tokens
    assert _same(logits, expected_logits)


@pytest.mark.parametrize("cuts", [(12,), (7,), (23,), (3, 10, 20), (8, 9), (22,)])
def test_the_same_image_in_any_cut_of_the_prompt_gives_the_same_bits(
        backend: LlamaCppBackend, cuts: tuple[int, ...]) -> None:
    """A prompt chunk (or a cached prefix) may end inside the image: the rest is evaluated
    from the same embeddings (kept, not encoded again), each run padded as a prompt chunk."""
    ids, images = _prompt(backend, _image(8))
    assert images[0].start == 7 and len(ids) == 28
    whole = _generate(backend, ids, images)
    encoded = backend.projector.encoded_images if backend.projector else 0
    cut = _generate(backend, ids, images, cuts)
    assert cut[0] == whole[0]
    assert _same(cut[1], whole[1])
    assert backend.projector is not None and backend.projector.encoded_images == encoded


def test_another_image_of_the_same_size_gives_other_logits(backend: LlamaCppBackend) -> None:
    ids, images = _prompt(backend, _image(9))
    tokens, logits = _generate(backend, ids, images)
    again = _generate(backend, *_prompt(backend, _image(9)))
    assert again[0] == tokens and _same(again[1], logits)
    other_ids, other_images = _prompt(backend, _image(10))
    assert other_ids[:7] == ids[:7] and other_ids[7:23] != ids[7:23]
    _, other_logits = _generate(backend, other_ids, other_images)
    assert np.abs(other_logits[0] - logits[0]).max() > 1e-2


def test_a_step_evaluates_other_works_beside_an_image_and_default_kernels_agree(
        tiny_gguf: Path, tiny_mmproj_gguf: Path, backend: LlamaCppBackend) -> None:
    """With butter's own output projection (the default), a second sequence decoding in
    the same step, and the image's tokens the same: the same greedy tokens."""
    image = _image(11)
    ids, images = _prompt(backend, image)
    expected, _ = _generate(backend, ids, images)
    fast = LlamaCppBackend(tiny_gguf, n_cells=256, n_seq=2, n_batch=N_BATCH, threads=2,
                           mmproj=tiny_mmproj_gguf)
    try:
        text = fast.tokenize("a plain prompt", add_bos=True)
        ops = [RemoveTokens(seq, -1, -1) for seq in (0, 1)]
        ops += [SetSampler(seq, SamplingParams(temperature=0)) for seq in (0, 1)]
        sampled = fast.step(ops, [SeqWork(1, tuple(text), 0, sample=True, prompt=True),
                                  SeqWork(0, tuple(ids), 0, sample=True, prompt=True,
                                          images=tuple(images))])
        assert sorted(s.seq for s in sampled) == [0, 1]
        out = {s.seq: [s.token] for s in sampled}
        for step in range(GREEDY_STEPS):
            works = [SeqWork(0, (out[0][-1],), len(ids) + step, sample=True),
                     SeqWork(1, (out[1][-1],), len(text) + step, sample=True)]
            for s in fast.step([], works):
                out[s.seq].append(s.token)
        assert out[0] == expected
        assert fast.diagnostics()["projector"]["encoded_images"] == 1
    finally:
        fast.close()


def test_a_hybrid_model_reads_the_image_the_same_in_any_cut(
        tiny_lfm2_gguf: Path, tiny_mmproj_gguf: Path) -> None:
    """LFM2 (short convolutions and one attention layer): its recurrent state takes the
    image's rows as it takes tokens, bit for bit in any cut where its text is (butter's
    attention: llama.cpp's splits a hybrid's padded step into micro-batches whose float
    matmuls round by their width, so a text prompt's cuts differ there too)."""
    hybrid = LlamaCppBackend(tiny_lfm2_gguf, n_cells=256, n_seq=2, n_batch=N_BATCH,
                             threads=2, mmproj=tiny_mmproj_gguf)
    try:
        ids, images = _prompt(hybrid, _image(14))
        whole = _generate(hybrid, ids, images)
        for cuts in [(12,), (3, 10, 20)]:
            cut = _generate(hybrid, ids, images, cuts)
            assert cut[0][0] == whole[0][0]
            if hybrid.butter_attention:
                assert cut[0] == whole[0] and _same(cut[1], whole[1])
    finally:
        hybrid.close()


def test_ids_that_are_not_the_images_are_refused(backend: LlamaCppBackend) -> None:
    ids, images = _prompt(backend, _image(12))
    wrong = PromptImage(images[0].start, IMAGE_TOKENS, _image(13))  # another picture
    with pytest.raises(BackendError, match="not its image's"):
        backend.step([RemoveTokens(0, -1, -1)], [SeqWork(0, tuple(ids), 0, sample=False,
                                                         prompt=True, images=(wrong,))])
    late = PromptImage(images[0].start + 2, IMAGE_TOKENS, images[0].image)  # misplaced
    with pytest.raises(BackendError, match="outside its images"):
        backend.step([RemoveTokens(0, -1, -1)], [SeqWork(0, tuple(ids), 0, sample=False,
                                                         prompt=True, images=(late,))])


# --- the server -------------------------------------------------------------------------

def _settings(model: Path, **overrides: Any) -> ServeSettings:
    return ServeSettings(model=str(model), parallel=1, max_context=256, threads=1,
                         **overrides)


def test_mmproj_is_the_boot_models_and_a_swapped_in_model_finds_its_own(
        tiny_gguf: Path, tiny_mmproj_gguf: Path, tmp_path: Path) -> None:
    settings = _settings(tiny_gguf, mmproj=str(tiny_mmproj_gguf))
    assert projector_for(tiny_gguf, settings, is_boot_model=True) == tiny_mmproj_gguf
    assert projector_for(tiny_gguf, settings, is_boot_model=False) is None
    resident = ResidentModel.load_sync(settings)
    try:
        assert resident.backend.vision and resident.metadata()["vision"]
    finally:
        resident.close()
    other = ResidentModel.load_sync(settings, model_id="another", path=tiny_gguf)
    try:
        assert not other.backend.vision and not other.metadata()["vision"]
    finally:
        other.close()
    # MLX has no image path: refused at load, before any MLX import.
    checkpoint = tmp_path / "mlx-model"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="no image path on MLX"):
        _load_backend(checkpoint, _settings(checkpoint, mmproj=str(tiny_mmproj_gguf)),
                      lambda n: 256)


def test_a_model_in_the_huggingface_cache_finds_its_snapshots_projector(
        tiny_gguf: Path, tiny_mmproj_gguf: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """llama-server's -hf: the snapshot's mmproj file nearest the model's quantization; a
    model named by its path (-m) gets none; a projector file is never a model."""
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    snapshot = cache / "models--org--vlm-GGUF" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    model = snapshot / "vlm-Q4_K_M.gguf"
    model.write_bytes(tiny_gguf.read_bytes())
    for name in ("mmproj-F16.gguf", "mmproj-Q8_0.gguf", "aaa-mmproj-F32.gguf"):
        (snapshot / name).write_bytes(tiny_mmproj_gguf.read_bytes())
    (snapshot / "deeper").mkdir()
    (snapshot / "deeper" / "mmproj-Q4_0.gguf").write_bytes(b"GGUF")  # not beside the model
    assert resolve_model("org/vlm-GGUF") == model
    assert projector_beside(model) == snapshot / "mmproj-Q8_0.gguf"
    assert projector_beside(tiny_gguf) is None
    settings = _settings(tiny_gguf)
    assert projector_for(model, settings, is_boot_model=False) == snapshot / "mmproj-Q8_0.gguf"
    assert projector_for(model, _settings(tiny_gguf, mmproj_auto=False),
                         is_boot_model=True) is None
    resident = ResidentModel.load_sync(settings, model_id="org/vlm-GGUF", path=model)
    try:
        assert resident.backend.vision
    finally:
        resident.close()
    # Neither the catalog nor resolution takes a projector for a model.
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "tiny.gguf").write_bytes(tiny_gguf.read_bytes())
    (folder / "mmproj-tiny.gguf").write_bytes(tiny_mmproj_gguf.read_bytes())
    ids = [entry.id for entry in ModelCatalog("tiny", folder / "tiny.gguf").entries()]
    assert "tiny" in ids and "mmproj-tiny" not in ids


def test_a_server_with_mmproj_says_vision(tiny_gguf: Path, tiny_mmproj_gguf: Path) -> None:
    server = ServerProcess(["--model", str(tiny_gguf), "--alias", "tiny-vision",
                            "--mmproj", str(tiny_mmproj_gguf), "--max-context", "256",
                            "--parallel", "1"])
    try:
        card = httpx.get(f"{server.api}/models", timeout=10).json()["data"][0]
        assert card["id"] == "tiny-vision"
        assert card["capabilities"] == ["completion", "vision"]
        assert card["architecture"]["input_modalities"] == ["text", "image"]
        meta = httpx.get(f"{server.api}/server", timeout=10).json()["model"]["meta"]
        assert meta["vision"] is True
        assert meta["projector"]["path"] == str(tiny_mmproj_gguf)
        assert meta["projector"]["type"] == "mlp"
        shown = httpx.post(f"{server.base_url}/api/show", json={"model": "tiny-vision"},
                           timeout=10).json()
        assert "vision" in shown["capabilities"]
    finally:
        server.stop()


def test_a_server_whose_projector_does_not_fit_does_not_start(
        tiny_gguf: Path, tmp_path: Path) -> None:
    narrow = write_tiny_mmproj_gguf(tmp_path / "narrow-mmproj.gguf", n_embd_text=32)
    with pytest.raises(RuntimeError) as failed:
        ServerProcess(["--model", str(tiny_gguf), "--mmproj", str(narrow),
                       "--max-context", "256", "--parallel", "1"])
    assert "mismatch between text model (n_embd = 64) and mmproj (n_embd = 32)" in str(
        failed.value)
