"""libmtmd (llama.cpp's multimodal library) end to end on the tiny projector of
butter/testing/tiny_mmproj.py and the tiny Qwen3, through llama-cpp-python's mtmd bindings
alone (no butter code yet): the groundwork of #55, images in. What these tests pin is
written up in docs/design/images-plan.md ("Verified")."""

from __future__ import annotations

import ctypes
import hashlib
import io
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp as ll
import llama_cpp.mtmd_cpp as mtmd
import numpy as np
import pytest
from PIL import Image

from butter.testing.tiny_gguf import N_EMBD
from butter.testing.tiny_mmproj import IMAGE_SIZE, PATCH_SIZE, image_tokens, write_tiny_mmproj_gguf

MARKER = b"<__media__>"  # libmtmd's default media marker (mtmd_default_marker)
PROMPT = b"describe " + MARKER + b" please"
# (IMAGE_SIZE // PATCH_SIZE)^2 = (32 // 8)^2: one embedding per 8x8 patch of the 32x32 image
# libmtmd resizes every picture to.
IMAGE_TOKENS = 16
N_BATCH = 64
GREEDY_STEPS = 4


# --- libmtmd's log --------------------------------------------------------------------

@dataclass
class _Log:
    lines: list[str] = field(default_factory=list)


_LOG = _Log()


def _record(level: int, text: bytes | None, user_data: Any) -> None:
    _LOG.lines.append((text or b"").decode(errors="replace"))


# Kept for the life of the process: libmtmd holds the pointer (a freed one would crash it).
_LOG_CALLBACK = ll.llama_log_callback(_record)


# --- the loaded pair ------------------------------------------------------------------

@dataclass
class Loaded:
    model: Any  # llama_model *
    ctx: Any  # llama_context *
    mctx: Any  # mtmd_context *
    n_vocab: int

    @property
    def memory(self) -> Any:
        return ll.llama_get_memory(self.ctx)


def _mtmd_params() -> Any:
    params = mtmd.mtmd_context_params_default()
    params.use_gpu, params.n_threads, params.print_timings = False, 2, False
    return params


def _load_text_model(path: Path) -> tuple[Any, Any]:
    model = ll.llama_model_load_from_file(str(path).encode(), ll.llama_model_default_params())
    assert model, f"llama.cpp could not load {path}"
    params = ll.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = 256, N_BATCH, N_BATCH
    params.n_threads, params.n_threads_batch = 2, 2
    ctx = ll.llama_init_from_model(model, params)
    assert ctx
    return model, ctx


@pytest.fixture(scope="module")
def loaded(tiny_gguf: Path, tiny_mmproj_gguf: Path) -> Iterator[Loaded]:
    mtmd.mtmd_helper_log_set(_LOG_CALLBACK, None)  # libmtmd's and its helpers' log
    model, ctx = _load_text_model(tiny_gguf)
    mctx = mtmd.mtmd_init_from_file(str(tiny_mmproj_gguf).encode(), model, _mtmd_params())
    assert mctx, "libmtmd refused the tiny projector:\n" + "".join(_LOG.lines)
    n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    try:
        yield Loaded(model, ctx, mctx, n_vocab)
    finally:
        mtmd.mtmd_free(mctx)
        ll.llama_free(ctx)
        ll.llama_model_free(model)


# --- images ---------------------------------------------------------------------------

def _noise(seed: int, width: int = IMAGE_SIZE, height: int = IMAGE_SIZE) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _png(pixels: np.ndarray, *, compress_level: int = 6) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="PNG", compress_level=compress_level)
    return out.getvalue()


def _bitmap_from_file(lc: Loaded, data: bytes, *, placeholder: bool = False) -> Any:
    """libmtmd's helper decodes the file (stb_image) and ids the bitmap with the file's
    SHA-256 (not with a placeholder's)."""
    buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
    bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(lc.mctx, buf, len(data), placeholder)
    assert bitmap
    return bitmap


def _bitmap_from_pixels(pixels: np.ndarray) -> Any:
    """Decoded RGB bytes in (what butter would pass after decoding with Pillow): no id."""
    height, width, _ = pixels.shape
    raw = np.ascontiguousarray(pixels).tobytes()
    bitmap = mtmd.mtmd_bitmap_init(width, height, (ctypes.c_uint8 * len(raw)).from_buffer_copy(raw))
    assert bitmap
    return bitmap


class Chunks:
    """mtmd_tokenize's output for a prompt and its bitmaps (freed with the bitmaps)."""

    def __init__(self, lc: Loaded, prompt: bytes, bitmaps: list[Any]) -> None:
        self.handle = mtmd.mtmd_input_chunks_init()
        self._prompt = prompt  # the text struct points into it
        text = mtmd.mtmd_input_text(prompt, len(prompt), True, True)  # add_special, parse_special
        array = (mtmd.mtmd_bitmap_p_ctypes * len(bitmaps))(*bitmaps)
        self.status = mtmd.mtmd_tokenize(lc.mctx, self.handle, ctypes.byref(text), array,
                                         len(bitmaps))
        for bitmap in bitmaps:  # the chunks hold their own copies of the pixels
            mtmd.mtmd_bitmap_free(bitmap)

    def __enter__(self) -> Chunks:
        return self

    def __exit__(self, *exc: object) -> None:
        mtmd.mtmd_input_chunks_free(self.handle)

    def __len__(self) -> int:
        return int(mtmd.mtmd_input_chunks_size(self.handle))

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < len(self):
            raise IndexError(index)
        return mtmd.mtmd_input_chunks_get(self.handle, index)

    def __iter__(self) -> Iterator[Any]:
        return (self[i] for i in range(len(self)))


def _tokenized(lc: Loaded, prompt: bytes, bitmaps: list[Any]) -> Chunks:
    chunks = Chunks(lc, prompt, bitmaps)
    assert chunks.status == 0
    return chunks


def _text_tokens(chunk: Any) -> list[int]:
    count = ctypes.c_size_t(0)
    tokens = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(count))
    return [tokens[i] for i in range(count.value)]


def _llama_tokens(lc: Loaded, text: bytes) -> list[int]:
    out = (ll.llama_token * 64)()
    n = ll.llama_tokenize(ll.llama_model_get_vocab(lc.model), text, len(text), out, 64, True,
                          True)
    assert n >= 0
    return list(out[:n])


# --- evaluation -----------------------------------------------------------------------

def _last_logits(lc: Loaded) -> np.ndarray:
    logits = ll.llama_get_logits_ith(lc.ctx, -1)
    return np.ctypeslib.as_array(logits, shape=(lc.n_vocab,)).copy()


def _decode_tokens(lc: Loaded, tokens: list[int], start: int, *, logits_last: bool) -> None:
    batch = ll.llama_batch_init(len(tokens), 0, 1)
    try:
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, start + i, 1
            batch.seq_id[i][0], batch.logits[i] = 0, logits_last and i == len(tokens) - 1
        assert ll.llama_decode(lc.ctx, batch) == 0
    finally:
        ll.llama_batch_free(batch)


def _decode_embeddings(lc: Loaded, embd: np.ndarray, start: int) -> None:
    """Rows of embeddings (n_tokens x n_embd) into sequence 0 from position `start`, one
    position each: what mtmd_helper_decode_image_chunk does for a model without M-RoPE
    (and with a causal mask: mtmd_decode_use_non_causal is false for this projector)."""
    n_tokens, n_embd = embd.shape
    batch = ll.llama_batch_init(n_tokens, n_embd, 1)
    try:
        batch.n_tokens = n_tokens
        ctypes.memmove(batch.embd, embd.ctypes.data, embd.nbytes)
        for i in range(n_tokens):
            batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0], batch.logits[i] = (
                start + i, 1, 0, False)
        assert ll.llama_decode(lc.ctx, batch) == 0
    finally:
        ll.llama_batch_free(batch)


def _encode(lc: Loaded, chunk: Any) -> np.ndarray:
    """The chunk's embeddings: mtmd_encode_chunk, then mtmd_get_output_embd (a buffer of
    the mtmd context's, overwritten by the next encode: copied out)."""
    assert mtmd.mtmd_encode_chunk(lc.mctx, chunk) == 0
    n_tokens = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
    out = mtmd.mtmd_get_output_embd(lc.mctx)
    return np.ctypeslib.as_array(out, shape=(n_tokens, N_EMBD)).copy()


def _eval_with_helper(lc: Loaded, chunks: Chunks) -> int:
    """Sequence 0 emptied, then every chunk evaluated by mtmd_helper_eval_chunks: the
    position after the prompt."""
    ll.llama_memory_clear(lc.memory, True)
    n_past = ll.llama_pos(0)
    assert mtmd.mtmd_helper_eval_chunks(lc.mctx, lc.ctx, chunks.handle, 0, 0, N_BATCH, True,
                                        ctypes.byref(n_past)) == 0
    return int(n_past.value)


def _eval_by_hand(lc: Loaded, chunks: Chunks) -> int:
    """The same by the calls butter's backend would make itself: text chunks as token rows,
    an image chunk encoded, then decoded as embedding rows."""
    ll.llama_memory_clear(lc.memory, True)
    pos = 0
    for index, chunk in enumerate(chunks):
        if mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
            _decode_tokens(lc, _text_tokens(chunk), pos, logits_last=index == len(chunks) - 1)
        else:
            _decode_embeddings(lc, _encode(lc, chunk), pos)
        pos += mtmd.mtmd_input_chunk_get_n_pos(chunk)
    return pos


def _greedy(lc: Loaded, n_past: int) -> tuple[list[int], list[np.ndarray]]:
    """GREEDY_STEPS greedy tokens after an evaluated prompt, and the logits before each."""
    logits = [_last_logits(lc)]
    tokens: list[int] = []
    for step in range(GREEDY_STEPS):
        tokens.append(int(np.argmax(logits[-1])))
        _decode_tokens(lc, tokens[-1:], n_past + step, logits_last=True)
        logits.append(_last_logits(lc))
    return tokens, logits


def _answer(lc: Loaded, bitmap: Any) -> tuple[list[int], list[np.ndarray]]:
    with _tokenized(lc, PROMPT, [bitmap]) as chunks:
        return _greedy(lc, _eval_with_helper(lc, chunks))


# --- the file -------------------------------------------------------------------------

def test_the_projector_file_is_small_and_the_same_for_the_same_seed(tmp_path: Path) -> None:
    first = write_tiny_mmproj_gguf(tmp_path / "a.gguf").read_bytes()
    again = write_tiny_mmproj_gguf(tmp_path / "b.gguf").read_bytes()
    other = write_tiny_mmproj_gguf(tmp_path / "c.gguf", seed=1).read_bytes()
    assert first == again != other
    assert len(first) < 256 * 1024
    assert image_tokens() == IMAGE_TOKENS == (IMAGE_SIZE // PATCH_SIZE) ** 2
    with pytest.raises(ValueError, match="multiple"):
        write_tiny_mmproj_gguf(tmp_path / "d.gguf", image_size=30)


# --- loading --------------------------------------------------------------------------

def test_libmtmd_loads_it_as_a_vision_projector_for_the_tiny_model(
        loaded: Loaded, tiny_mmproj_gguf: Path) -> None:
    assert mtmd.mtmd_support_vision(loaded.mctx)
    assert not mtmd.mtmd_support_audio(loaded.mctx)
    # Decoded causally, one position per embedding: no special attention or positions.
    assert not mtmd.mtmd_decode_use_non_causal(loaded.mctx, None)
    assert not mtmd.mtmd_decode_use_mrope(loaded.mctx)
    assert mtmd.mtmd_get_marker(loaded.mctx) == mtmd.mtmd_default_marker() == MARKER
    caps = mtmd.mtmd_get_cap_from_file(str(tiny_mmproj_gguf).encode())
    assert (caps.inp_vision, caps.inp_audio) == (True, False)
    assert ll.llama_model_n_embd_inp(loaded.model) == N_EMBD


def test_a_projector_for_another_width_or_no_projector_is_refused(
        loaded: Loaded, tmp_path: Path) -> None:
    narrow = write_tiny_mmproj_gguf(tmp_path / "narrow.gguf", n_embd_text=32)
    _LOG.lines.clear()
    assert not mtmd.mtmd_init_from_file(str(narrow).encode(), loaded.model, _mtmd_params())
    assert "mismatch between text model (n_embd = 64) and mmproj (n_embd = 32)" in "".join(
        _LOG.lines)
    # The text model itself is a GGUF, but no projector: refused, not a crash.
    not_mmproj = tmp_path / "text.gguf"
    not_mmproj.write_bytes(b"GGUF is not what this file holds")
    assert not mtmd.mtmd_init_from_file(str(not_mmproj).encode(), loaded.model, _mtmd_params())
    assert not mtmd.mtmd_init_from_file(str(tmp_path / "missing.gguf").encode(), loaded.model,
                                        _mtmd_params())


# --- tokenizing -----------------------------------------------------------------------

def test_the_prompt_becomes_text_image_text_chunks(loaded: Loaded) -> None:
    with _tokenized(loaded, PROMPT, [_bitmap_from_file(loaded, _png(_noise(1)))]) as chunks:
        kinds = [mtmd.mtmd_input_chunk_get_type(chunk) for chunk in chunks]
        assert kinds == [mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT, mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE,
                         mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT]
        before, image, after = chunks
        # The text on either side of the marker is tokenized on its own (no BPE merge
        # across an image), with no begin/end-of-image text added for this projector.
        assert _text_tokens(before) == _llama_tokens(loaded, b"describe ")
        assert _text_tokens(after) == _llama_tokens(loaded, b" please")
        assert mtmd.mtmd_input_chunk_get_n_tokens(image) == IMAGE_TOKENS
        assert mtmd.mtmd_input_chunk_get_n_pos(image) == IMAGE_TOKENS  # no M-RoPE
        n_text = len(_text_tokens(before)) + len(_text_tokens(after))
        assert mtmd.mtmd_helper_get_n_tokens(chunks.handle) == n_text + IMAGE_TOKENS
        assert mtmd.mtmd_helper_get_n_pos(chunks.handle) == n_text + IMAGE_TOKENS


@pytest.mark.parametrize(("width", "height"), [(32, 32), (50, 20), (7, 90), (640, 480)])
def test_every_image_size_gives_the_same_token_count(loaded: Loaded, width: int,
                                                     height: int) -> None:
    bitmap = _bitmap_from_pixels(_noise(2, width, height))
    assert (mtmd.mtmd_bitmap_get_nx(bitmap), mtmd.mtmd_bitmap_get_ny(bitmap)) == (width, height)
    assert mtmd.mtmd_bitmap_get_n_bytes(bitmap) == width * height * 3
    with _tokenized(loaded, PROMPT, [bitmap]) as chunks:
        assert mtmd.mtmd_input_chunk_get_n_tokens(chunks[1]) == IMAGE_TOKENS


def test_markers_and_bitmaps_must_pair_up(loaded: Loaded) -> None:
    """mtmd_tokenize refuses markers and bitmaps that differ in number: it returns 2 (mtmd.h
    says 1; at this commit the check throws, and any exception returns 2). A marker's text
    in a prompt is a marker, whoever wrote it: llama-server makes its marker random."""
    _LOG.lines.clear()
    with Chunks(loaded, PROMPT + b" and " + MARKER, [_bitmap_from_pixels(_noise(3))]) as chunks:
        assert chunks.status == 2
    assert "exceeds number of bitmaps" in "".join(_LOG.lines)
    _LOG.lines.clear()
    with Chunks(loaded, b"no image here", [_bitmap_from_pixels(_noise(3))]) as chunks:
        assert chunks.status == 2
    assert "does not match number of bitmaps" in "".join(_LOG.lines)


def test_parts_need_no_marker_and_a_markers_text_stays_text(loaded: Loaded) -> None:
    """mtmd_tokenize_from_parts takes text and bitmaps as separate parts: the same chunks as
    the marker, and a marker's text written by a user is only text."""
    pixels = _noise(11)
    with _tokenized(loaded, PROMPT, [_bitmap_from_pixels(pixels)]) as marked:
        expected = [_text_tokens(marked[0]), _text_tokens(marked[2])]
    texts = [b"describe ", b" please " + MARKER]
    inputs = [mtmd.mtmd_input_text(text, len(text), True, True) for text in texts]
    bitmap = _bitmap_from_pixels(pixels)
    parts = [mtmd.mtmd_input_part(ctypes.pointer(inputs[0]), None),
             mtmd.mtmd_input_part(None, bitmap),
             mtmd.mtmd_input_part(ctypes.pointer(inputs[1]), None)]
    array = (ctypes.POINTER(mtmd.mtmd_input_part) * len(parts))(
        *(ctypes.pointer(part) for part in parts))
    handle = mtmd.mtmd_input_chunks_init()
    try:
        assert mtmd.mtmd_tokenize_from_parts(loaded.mctx, handle, array, len(parts), True) == 0
        chunks = [mtmd.mtmd_input_chunks_get(handle, i)
                  for i in range(mtmd.mtmd_input_chunks_size(handle))]
        assert [mtmd.mtmd_input_chunk_get_type(c) for c in chunks] == [
            mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT, mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE,
            mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT]
        assert _text_tokens(chunks[0]) == expected[0]
        assert _text_tokens(chunks[2]) == _llama_tokens(loaded, texts[1])
        assert _text_tokens(chunks[2])[:len(expected[1])] == expected[1]
        assert mtmd.mtmd_input_chunk_get_n_tokens(chunks[1]) == IMAGE_TOKENS
    finally:
        mtmd.mtmd_input_chunks_free(handle)
        mtmd.mtmd_bitmap_free(bitmap)


def test_a_placeholder_bitmap_counts_tokens_without_pixels(loaded: Loaded) -> None:
    """A placeholder (the helper's placeholder=True) is tokenized to the same count, has no
    id, and cannot be encoded: counting an image's tokens needs its size, not its pixels."""
    data = _png(_noise(4, 50, 20))
    with _tokenized(loaded, PROMPT, [_bitmap_from_file(loaded, data, placeholder=True)]) as chunks:
        image = chunks[1]
        assert mtmd.mtmd_input_chunk_get_n_tokens(image) == IMAGE_TOKENS
        assert mtmd.mtmd_input_chunk_get_id(image) == b""
        _LOG.lines.clear()
        assert mtmd.mtmd_encode_chunk(loaded.mctx, image) != 0


# --- chunk ids ------------------------------------------------------------------------

def test_an_image_chunks_id_is_the_bitmaps_id(loaded: Loaded) -> None:
    """No id unless one is set: the helper sets the SHA-256 of the file's bytes (so the
    same pixels in two files get two ids), a bitmap made from pixels has the empty id, and
    mtmd_bitmap_set_id sets any. A text chunk has none (NULL)."""
    pixels = _noise(5)
    small, large = _png(pixels, compress_level=9), _png(pixels, compress_level=0)
    assert small != large
    by_hand = _bitmap_from_pixels(pixels)
    keyed = _bitmap_from_pixels(pixels)
    key = hashlib.sha256(pixels.tobytes()).hexdigest().encode()
    mtmd.mtmd_bitmap_set_id(keyed, key)
    bitmaps = [_bitmap_from_file(loaded, small), _bitmap_from_file(loaded, large), by_hand, keyed]
    prompt = b" ".join([MARKER] * len(bitmaps))
    with _tokenized(loaded, prompt, bitmaps) as chunks:
        images = [c for c in chunks
                  if mtmd.mtmd_input_chunk_get_type(c) == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE]
        texts = [c for c in chunks
                 if mtmd.mtmd_input_chunk_get_type(c) == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT]
        assert [mtmd.mtmd_input_chunk_get_id(c) for c in images] == [
            hashlib.sha256(small).hexdigest().encode(),
            hashlib.sha256(large).hexdigest().encode(), b"", key]
        assert texts and all(mtmd.mtmd_input_chunk_get_id(c) is None for c in texts)
        # A copy, and a placeholder (the chunk's metadata alone, what a prefix cache would
        # keep), carry the id and the counts; the placeholder cannot be encoded.
        copy = mtmd.mtmd_input_chunk_copy(images[3])
        placeholder = mtmd.mtmd_input_chunk_get_placeholder(images[3])
        try:
            for chunk in (copy, placeholder):
                assert mtmd.mtmd_input_chunk_get_id(chunk) == key
                assert mtmd.mtmd_input_chunk_get_n_tokens(chunk) == IMAGE_TOKENS
                assert mtmd.mtmd_input_chunk_get_n_pos(chunk) == IMAGE_TOKENS
            assert mtmd.mtmd_encode_chunk(loaded.mctx, copy) == 0
            assert mtmd.mtmd_encode_chunk(loaded.mctx, placeholder) != 0
        finally:
            mtmd.mtmd_input_chunk_free(copy)
            mtmd.mtmd_input_chunk_free(placeholder)


# --- evaluating -----------------------------------------------------------------------

def test_the_image_is_evaluated_into_the_sequence_one_position_per_embedding(
        loaded: Loaded) -> None:
    with _tokenized(loaded, PROMPT, [_bitmap_from_pixels(_noise(6))]) as chunks:
        n_past = _eval_with_helper(loaded, chunks)
        assert n_past == mtmd.mtmd_helper_get_n_pos(chunks.handle)
        assert ll.llama_memory_seq_pos_min(loaded.memory, 0) == 0
        assert ll.llama_memory_seq_pos_max(loaded.memory, 0) == n_past - 1
        tokens, logits = _greedy(loaded, n_past)
        assert len(tokens) == GREEDY_STEPS and all(0 <= t < loaded.n_vocab for t in tokens)
        assert all(np.isfinite(step).all() for step in logits)


def test_the_same_image_gives_the_same_logits_and_another_image_other_logits(
        loaded: Loaded) -> None:
    pixels = _noise(7)
    tokens, logits = _answer(loaded, _bitmap_from_pixels(pixels))
    again_tokens, again_logits = _answer(loaded, _bitmap_from_pixels(pixels))
    assert tokens == again_tokens
    assert all(np.array_equal(a, b) for a, b in zip(logits, again_logits, strict=True))
    # The same pixels from a PNG file (another id) are the same input.
    file_tokens, file_logits = _answer(loaded, _bitmap_from_file(loaded, _png(pixels)))
    assert file_tokens == tokens and np.array_equal(file_logits[0], logits[0])
    # Another image of the same size reaches the model: the logits move.
    _, other_logits = _answer(loaded, _bitmap_from_pixels(_noise(8)))
    assert np.abs(other_logits[0] - logits[0]).max() > 1e-2


def test_encoding_and_decoding_by_hand_is_what_the_helper_does(loaded: Loaded) -> None:
    with _tokenized(loaded, PROMPT, [_bitmap_from_pixels(_noise(9))]) as chunks:
        image = chunks[1]
        embd = _encode(loaded, image)
        assert embd.shape == (IMAGE_TOKENS, N_EMBD) and np.isfinite(embd).all()
        assert np.array_equal(_encode(loaded, image), embd)  # the encoder is deterministic
        n_helper = _eval_with_helper(loaded, chunks)
        helper_tokens, helper_logits = _greedy(loaded, n_helper)
        n_hand = _eval_by_hand(loaded, chunks)
        hand_tokens, hand_logits = _greedy(loaded, n_hand)
    assert n_hand == n_helper
    assert hand_tokens == helper_tokens
    assert all(np.array_equal(a, b) for a, b in zip(hand_logits, helper_logits, strict=True))


def test_an_eval_callback_can_stop_an_encode_which_then_still_reports_success(
        loaded: Loaded, tiny_mmproj_gguf: Path) -> None:
    """libmtmd's encoder takes no abort callback, but its eval callback (cb_eval) is asked
    about every graph node, and one that answers False stops the graph there. The encode
    still returns 0, with the output half computed: a caller that stops one must drop it."""
    stop = [False]
    evaluated = [0]

    def look(tensor: int, ask: bool, user_data: int) -> bool:
        if ask:
            return True  # every node: a chance to stop after each
        evaluated[0] += 1
        return not stop[0]

    hook = ll.ggml_backend_sched_eval_callback(look)
    params = _mtmd_params()
    params.cb_eval, params.warmup = hook, False
    mctx = mtmd.mtmd_init_from_file(str(tiny_mmproj_gguf).encode(), loaded.model, params)
    assert mctx
    watched = Loaded(loaded.model, loaded.ctx, mctx, loaded.n_vocab)
    try:
        with _tokenized(watched, PROMPT, [_bitmap_from_pixels(_noise(10))]) as chunks:
            whole = _encode(watched, chunks[1])
            nodes = evaluated[0]
            assert nodes > 10
            assert np.array_equal(whole, _encode(loaded, chunks[1]))  # watching changes nothing
            stop[0], evaluated[0] = True, 0
            stopped = _encode(watched, chunks[1])  # asserts that it returned 0
            assert evaluated[0] == 1
            assert not np.array_equal(stopped, whole)
    finally:
        mtmd.mtmd_free(mctx)
