"""A vision projector (an "mmproj" GGUF) beside the text model, through llama.cpp's libmtmd
(tools/mtmd, shipped in llama-cpp-python's wheel with its bindings, llama_cpp.mtmd_cpp).

A prompt's images take positions of their own: libmtmd says how many (tokenize), and its
encoder turns an image into that many rows of embeddings that the text model reads at those
positions instead of token embeddings (embeddings; the step decodes them, batch.py). The
research behind it, and llama-server's way, are in docs/design/images-plan.md.

Loaded after the text model, on the backend's thread (its encoder runs llama.cpp's CPU
threads there, as the steps do), and freed before it (libmtmd keeps the text model's
pointer). Images take one position per embedding, or M-RoPE's four (Qwen-VL and Qwen3.5
text models: the image's grid of positions, ImageGrid; positions.py maps cells to them).
They are decoded with the causal mask, as text is, or, for projectors such as Gemma 3's,
with a mask that lets an image's embeddings see each other whole (PromptImage.causal): such
an image is evaluated in one llama_decode. Audio-only projectors are refused at load
(Projector.refusal).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import llama_cpp as ll
import llama_cpp.mtmd_cpp as mtmd
import numpy as np

from butter.backends.base import BackendError, ImageGrid, PromptImage, image_token_ids
from butter.backends.gguf_tensors import GgufFormatError, read_header
from butter.chat.images import DecodedImage
from butter.errors import InvalidRequest, ModelLoadError

# The embeddings of the last few images encoded, by key: a work may hold only part of an
# image (a prompt chunk ends inside it, or a cached prefix does), and the next work its rest.
EMBEDDING_CACHE_IMAGES = 4
# Images tokenized for a prompt (libmtmd resized and normalized them then), kept by key
# until the step that encodes them: at most this many, the oldest pictures' dropped (they
# are then tokenized again, on the backend's thread), but never the newest picture's pieces
# (a picture a projector slices may hold more).
PENDING_IMAGES = 16
# What libmtmd made of the last pictures tokenized (their ids and pieces), by key: a
# conversation sends its pictures again with every turn, and libmtmd resizes and normalizes
# a picture each time it tokenizes it.
LAYOUT_CACHE_PICTURES = 256
# mtmd_tokenize's status when its tokenizer threw (a picture its preprocessing refuses).
_TOKENIZE_REFUSED = 2
# ggml's log levels (ggml.h): an error, and the continuation of the line before.
_LOG_ERROR, _LOG_CONT = 4, 5
# The GGUF keys that name a projector's type (a file with vision and audio names each).
_TYPE_KEYS = ("clip.vision.projector_type", "clip.projector_type")
_ARCHITECTURE = "general.architecture"  # "clip" for every projector llama.cpp writes
M_ROPE_SECTIONS = 4  # positions an M-RoPE model's embedding takes (GGML_MROPE_SECTIONS)


class _Log:
    """libmtmd's log: silent, but for what it says while a load listens (the reason it
    refuses a file). Installed before every load (a test may have installed its own since);
    the callback lives as long as the process, as libmtmd keeps its pointer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # one listener at a time
        self._heard: list[tuple[int, str]] | None = None
        self._callback = ll.llama_log_callback(self._record)

    def _record(self, level: int, text: bytes | None, user_data: Any) -> None:
        heard = self._heard
        if heard is not None:
            heard.append((level, (text or b"").decode("utf-8", errors="replace")))

    @contextlib.contextmanager
    def listening(self) -> Iterator[list[tuple[int, str]]]:
        with self._lock:
            mtmd.mtmd_helper_log_set(self._callback, None)
            heard: list[tuple[int, str]] = []
            self._heard = heard
            try:
                yield heard
            finally:
                self._heard = None


_LOG = _Log()


def _reason(heard: list[tuple[int, str]]) -> str:
    """libmtmd's error lines, as one sentence (else its last words)."""
    errors: list[str] = []
    for level, text in heard:
        if level == _LOG_ERROR or (level == _LOG_CONT and errors):
            errors.append(text)
    lines = [line.strip() for line in "".join(errors).splitlines() if line.strip()]
    if not lines:
        lines = [text.strip() for _, text in heard[-3:] if text.strip()]
    # "clip_init: failed to load model '...': load_hparams: unknown projector type: xyz"
    return "; ".join(dict.fromkeys(lines)) or "libmtmd gave no reason"


def projector_type(path: Path) -> str | None:
    """The projector's type as its file names it (clip.projector_type: "mlp", "gemma3",
    "qwen3vl_merger", ...), None where the file does not say."""
    header = _header(path)
    for key in _TYPE_KEYS:
        value = header.get(key)
        if isinstance(value, str):
            return value
    return None


def _header(path: Path) -> dict[str, object]:
    try:
        return read_header(path, keys=(*_TYPE_KEYS, _ARCHITECTURE)).metadata
    except (OSError, GgufFormatError, ValueError, struct.error):  # (libmtmd says why)
        return {}


def _not_a_projector(path: Path) -> str:
    """A word on a file libmtmd refused, where its header says it is no projector."""
    architecture = _header(path).get(_ARCHITECTURE)
    if isinstance(architecture, str) and architecture != "clip":
        return f" (it is a {architecture} model, not a projector)"
    return ""


class Projector:
    """libmtmd's context for one projector file and one loaded text model, the embedding
    batch its images are decoded in, and the images on their way to the encoder."""

    def __init__(self, path: Path, model: Any, *, n_batch: int, threads: int) -> None:
        """`model`: the text model (llama_model *); `n_batch`: the rows of a step's batch;
        `threads`: the encoder's (the step team's size at load)."""
        self.path = path
        if not path.is_file():
            raise ModelLoadError(f"projector file not found: {path}")
        self.type = projector_type(path)
        self.ctx: Any = None
        self.batch: Any = None
        # a piece's key: its picture's key and its chunk
        self._pending: collections.OrderedDict[str, tuple[str, Any]] = collections.OrderedDict()
        self._pending_lock = threading.Lock()
        self._embeddings: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
        self._layouts: collections.OrderedDict[str, _Layout] = collections.OrderedDict()
        self._layouts_lock = threading.Lock()
        self.splices = False  # (until the load's check says a picture's layout may be reused)
        self.vocab = ll.llama_model_get_vocab(model)
        self.encoded_images = 0
        self.encode_seconds = 0.0
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = False  # (the wheel is CPU-only; a GPU build's projector: unmeasured)
        params.n_threads = threads
        params.print_timings = False
        params.warmup = True  # its graph allocated now, not in a request's first step
        with _LOG.listening() as heard:
            ctx = mtmd.mtmd_init_from_file(str(path).encode(), model, params)
        if not ctx:
            raise ModelLoadError(f"the projector {path} cannot serve this model: "
                                 f"{_reason(heard)}{_not_a_projector(path)}")
        self.ctx = ctx
        try:
            refusal = self.refusal()
            if refusal is not None:
                kind = f" ({self.type})" if self.type else ""
                raise ModelLoadError(f"the projector {path}{kind} is not supported yet: {refusal}")
            self.n_embd = int(ll.llama_model_n_embd_inp(model))
            # An M-RoPE model's embedding rows take 4 positions each (section-major in the
            # batch's positions, as llama_decode reads an embedding batch of such a model)
            self.m_rope = bool(mtmd.mtmd_decode_use_mrope(ctx))
            rows = n_batch * M_ROPE_SECTIONS if self.m_rope else n_batch
            self.batch = ll.llama_batch_init(rows, self.n_embd, 1)
            self.n_batch = n_batch
            # Images whose embeddings see each other (Gemma 3's) go in one batch each: one
            # that cannot is refused now rather than with a request
            self.non_causal = bool(mtmd.mtmd_decode_use_non_causal(ctx, None))
            if self.non_causal:
                self._fits_one_batch()
            self.splices = self._splicing_agrees()
        except BaseException:
            self.free()
            raise

    def refusal(self) -> str | None:
        """Why butter cannot evaluate this projector's images yet; None: it can."""
        ctx = self.ctx
        if not mtmd.mtmd_support_vision(ctx):
            return "it has no vision encoder (an audio projector), and butter takes images only"
        return None

    def _fits_one_batch(self) -> None:
        """Tokenize a small picture: a non-causal projector whose images (of a fixed size,
        as Gemma 3's are) take more rows than a step's batch cannot serve."""
        try:
            self._probe(lambda: self._whole(["", ""], [_probe_picture(128)], add_bos=False))
        except (BackendError, InvalidRequest) as exc:
            raise ModelLoadError(f"the projector {self.path}: {exc}") from None

    def _splicing_agrees(self) -> bool:
        """Whether a prompt spliced from its texts and its pictures' own layouts is the one
        libmtmd makes of it whole, on two pictures, one of them twice (a projector whose
        layout depends on a picture's place in the prompt is never spliced)."""
        texts = ["look: ", " and ", "", " now"]
        pictures = [_probe_picture(60), _probe_picture(200), _probe_picture(60)]
        try:
            whole = self._probe(lambda: self._whole(texts, pictures, add_bos=True))
            spliced = self._probe(lambda: self._spliced(texts, pictures, add_bos=True))
        except (BackendError, InvalidRequest):
            return False
        finally:
            with self._layouts_lock:
                self._layouts.clear()
        return _placements(whole) == _placements(spliced)

    def _probe(self, tokenize: Callable[[], tuple[list[int], list[PromptImage]]]
               ) -> tuple[list[int], list[PromptImage]]:
        """A load's probe tokenized, its images never to be encoded."""
        ids, placed = tokenize()
        with self._pending_lock:
            probes = [self._pending.pop(image.key, None) for image in placed]
        for probe in probes:
            if probe is not None:
                mtmd.mtmd_input_chunk_free(probe[1])
        return ids, placed

    # ------------------------------------------------------------------ prompts

    def tokenize(self, texts: Sequence[str], images: Sequence[DecodedImage], *,
                 add_bos: bool) -> tuple[list[int], list[PromptImage]]:
        """A prompt's ids: each text piece tokenized on its own (special tokens parsed, as
        butter tokenizes), the begin/end-of-image text the projector asks for, and
        image_token_ids at each image's positions; BOS first where `add_bos` and the
        vocabulary has one. libmtmd's mtmd_tokenize_from_parts, so no marker exists that
        a user's text could imitate. Thread-safe (libmtmd's tokenizer is)."""
        if len(texts) != len(images) + 1:
            raise BackendError(f"{len(texts)} text pieces for {len(images)} images: there "
                               "must be one more")
        if self.splices:
            return self._spliced(texts, images, add_bos=add_bos)
        return self._whole(texts, images, add_bos=add_bos)

    def _spliced(self, texts: Sequence[str], images: Sequence[DecodedImage], *,
                 add_bos: bool) -> tuple[list[int], list[PromptImage]]:
        """tokenize's result put together as libmtmd's tokenizer does (each text piece
        tokenized alone, special tokens parsed; each picture's own layout; BOS first and EOS
        last where `add_bos` and the vocabulary asks), a picture tokenized only the first
        time it is seen (LAYOUT_CACHE_PICTURES)."""
        layouts = [self._layout(image) for image in images]
        ids: list[int] = []
        if add_bos and ll.llama_vocab_get_add_bos(self.vocab):
            ids.append(int(ll.llama_vocab_bos(self.vocab)))
        placed: list[PromptImage] = []
        for index, text in enumerate(texts):
            ids += self._text_ids(text)
            if index < len(layouts):
                offset = len(ids)
                placed += [attrs.evolve(piece, start=offset + piece.start, image=images[index])
                           for piece in layouts[index].pieces]
                ids += layouts[index].ids
        if add_bos and ll.llama_vocab_get_add_eos(self.vocab):
            ids.append(int(ll.llama_vocab_eos(self.vocab)))
        return ids, placed

    def _layout(self, image: DecodedImage) -> _Layout:
        """What libmtmd makes of the picture alone: from the cache, else tokenized now (its
        chunks kept for their encode)."""
        with self._layouts_lock:
            known = self._layouts.get(image.key)
            if known is not None:
                self._layouts.move_to_end(image.key)
                return known
        ids, pieces = self._whole([], [image], add_bos=False)
        layout = _Layout(tuple(ids), tuple(pieces))
        with self._layouts_lock:
            self._layouts[image.key] = layout
            while len(self._layouts) > LAYOUT_CACHE_PICTURES:
                self._layouts.popitem(last=False)
        return layout

    def _text_ids(self, text: str) -> list[int]:
        """A text piece's tokens as libmtmd's tokenizer makes them (llama_tokenize, special
        tokens parsed, nothing added)."""
        data = text.encode("utf-8")
        if not data:
            return []
        room = len(data) + 2
        tokens = (ll.llama_token * room)()
        count = ll.llama_tokenize(self.vocab, data, len(data), tokens, room, False, True)
        if count < 0:
            raise BackendError(f"llama.cpp could not tokenize a text piece ({count})")
        return list(tokens[:count])

    def _whole(self, texts: Sequence[str], images: Sequence[DecodedImage], *,
               add_bos: bool) -> tuple[list[int], list[PromptImage]]:
        """tokenize's result from libmtmd's mtmd_tokenize_from_parts over the whole prompt;
        with no `texts`, one picture alone (its layout)."""
        alone = not texts
        encoded = [text.encode("utf-8") for text in texts]
        inputs = [mtmd.mtmd_input_text(data, len(data), False, True) for data in encoded]
        # Each bitmap's id is its place in the prompt, so that every chunk libmtmd makes of
        # it (a slicing projector makes several) says which picture it is, even when one
        # picture is sent twice.
        bitmaps = [_bitmap(image, str(index)) for index, image in enumerate(images)]
        if alone:
            parts = [mtmd.mtmd_input_part(None, bitmaps[0])]
        else:
            parts = [mtmd.mtmd_input_part(ctypes.pointer(inputs[0]), None)]
            for bitmap, text in zip(bitmaps, inputs[1:], strict=True):
                parts.append(mtmd.mtmd_input_part(None, bitmap))
                parts.append(mtmd.mtmd_input_part(ctypes.pointer(text), None))
        array = (ctypes.POINTER(mtmd.mtmd_input_part) * len(parts))(
            *(ctypes.pointer(part) for part in parts))
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            status = mtmd.mtmd_tokenize_from_parts(self.ctx, chunks, array, len(parts), add_bos)
            if status == _TOKENIZE_REFUSED:  # (the image itself: a client's request)
                raise InvalidRequest(
                    f"the model's projector ({self.type or 'unknown type'}) cannot take "
                    f"{'this image' if alone else 'an image of the request'} (libmtmd refused "
                    "it, e.g. for an aspect ratio its resizing cannot follow)")
            if status != 0:
                raise BackendError(f"libmtmd could not tokenize the prompt's images (status "
                                   f"{status})")
            return self._read_chunks(chunks, images)
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            for bitmap in bitmaps:
                mtmd.mtmd_bitmap_free(bitmap)

    def _read_chunks(self, chunks: Any, images: Sequence[DecodedImage]
                     ) -> tuple[list[int], list[PromptImage]]:
        ids: list[int] = []
        placed: list[PromptImage] = []
        kept: list[tuple[str, str, Any]] = []
        pictures = 0  # of `images`, those met so far (a sliced one: several chunks)
        try:
            for index in range(mtmd.mtmd_input_chunks_size(chunks)):
                chunk = mtmd.mtmd_input_chunks_get(chunks, index)
                kind = mtmd.mtmd_input_chunk_get_type(chunk)
                if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    count = ctypes.c_size_t(0)
                    tokens = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(count))
                    ids += tokens[:count.value]
                    continue
                if kind != mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                    raise BackendError("libmtmd made a chunk of another kind than an image")
                of = mtmd.mtmd_input_chunk_get_id(chunk)
                if of == str(pictures).encode() and pictures < len(images):
                    image, piece = images[pictures], 0  # (a picture's first chunk)
                    pictures += 1
                elif placed and of == str(pictures - 1).encode():
                    image, piece = images[pictures - 1], placed[-1].piece + 1  # (a slice)
                else:
                    raise BackendError("libmtmd placed an image chunk out of its pictures' order")
                n_tokens = int(mtmd.mtmd_input_chunk_get_n_tokens(chunk))
                n_pos = int(mtmd.mtmd_input_chunk_get_n_pos(chunk))
                grid = _grid(chunk, n_tokens, n_pos) if self.m_rope else None
                if grid is None and n_pos != n_tokens:
                    raise BackendError(f"an image of {n_tokens} embeddings takes {n_pos} "
                                       "positions, and the model has no M-RoPE")
                causal = not mtmd.mtmd_decode_use_non_causal(self.ctx, chunk)
                if not causal and n_tokens > self.n_batch:
                    raise BackendError(
                        f"an image of {n_tokens} embeddings is decoded in one batch, and "
                        f"a batch holds {self.n_batch} rows: raise --prefill-chunk")
                placed.append(PromptImage(len(ids), n_tokens, image, grid, causal, piece))
                ids += image_token_ids(placed[-1].key, n_tokens)
                kept.append((placed[-1].key, image.key, mtmd.mtmd_input_chunk_copy(chunk)))
            if pictures != len(images):
                raise BackendError(f"libmtmd placed {pictures} of {len(images)} images")
        except BaseException:
            for _, _, chunk in kept:
                mtmd.mtmd_input_chunk_free(chunk)
            raise
        self._keep(kept)
        return ids, placed

    def _keep(self, chunks: list[tuple[str, str, Any]]) -> None:
        """Keep tokenized images (piece key, picture key, chunk) for their encode: at most
        PENDING_IMAGES, the oldest pictures' pieces dropped first, never the newest's."""
        dropped = []
        with self._pending_lock:
            for key, picture, chunk in chunks:
                if key in self._pending:
                    dropped.append(chunk)
                    self._pending.move_to_end(key)
                else:
                    self._pending[key] = (picture, chunk)
            newest = next(reversed(self._pending.values()))[0] if self._pending else None
            while len(self._pending) > PENDING_IMAGES:
                key, (picture, chunk) = next(iter(self._pending.items()))
                if picture == newest:
                    break
                del self._pending[key]
                dropped.append(chunk)
        for chunk in dropped:
            mtmd.mtmd_input_chunk_free(chunk)

    # ------------------------------------------------------------------ embeddings

    def embeddings(self, image: PromptImage) -> np.ndarray:
        """The image's embeddings, one row (n_embd floats) per position: from the cache of
        the last few, else encoded now (on the backend's thread: the encoder's output is one
        buffer of libmtmd's context)."""
        cached = self._embeddings.get(image.key)
        if cached is not None:
            self._embeddings.move_to_end(image.key)
            return cached
        with self._pending_lock:
            kept = self._pending.pop(image.key, None)
        chunk = kept[1] if kept is not None else None
        if chunk is None:  # (dropped, or never tokenized here: a restored prompt)
            chunk = self._image_chunk(image)
        try:
            started = time.perf_counter()
            status = mtmd.mtmd_encode_chunk(self.ctx, chunk)
            if status != 0:
                raise BackendError(f"libmtmd could not encode an image (status {status})")
            n_tokens = int(mtmd.mtmd_input_chunk_get_n_tokens(chunk))
            output = mtmd.mtmd_get_output_embd(self.ctx)
            rows = np.ctypeslib.as_array(output, shape=(n_tokens * self.n_embd,))
            embd = rows.reshape(n_tokens, self.n_embd).copy()  # (the next encode overwrites it)
            self.encode_seconds += time.perf_counter() - started
            self.encoded_images += 1
        finally:
            mtmd.mtmd_input_chunk_free(chunk)
        self._embeddings[image.key] = embd
        while len(self._embeddings) > EMBEDDING_CACHE_IMAGES:
            self._embeddings.popitem(last=False)
        return embd

    def _image_chunk(self, image: PromptImage) -> Any:
        """The picture alone, tokenized again: a copy of the image chunk that is `image`'s
        piece (the caller frees it). The picture's other pieces are kept for their encodes
        (a sliced picture's come one after another)."""
        bitmap = _bitmap(image.image)
        part = mtmd.mtmd_input_part(None, bitmap)
        array = (ctypes.POINTER(mtmd.mtmd_input_part) * 1)(ctypes.pointer(part))
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            status = mtmd.mtmd_tokenize_from_parts(self.ctx, chunks, array, 1, False)
            if status != 0:
                raise BackendError(f"libmtmd could not tokenize an image (status {status})")
            every = [mtmd.mtmd_input_chunks_get(chunks, index)
                     for index in range(mtmd.mtmd_input_chunks_size(chunks))]
            pieces = [chunk for chunk in every
                      if mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE]
            if image.piece >= len(pieces):
                raise BackendError(f"libmtmd made {len(pieces)} image chunks of a picture, "
                                   f"not {image.piece + 1}")
            self._keep([(attrs.evolve(image, piece=index).key, image.image.key,
                         mtmd.mtmd_input_chunk_copy(chunk))
                        for index, chunk in enumerate(pieces) if index > image.piece])
            return mtmd.mtmd_input_chunk_copy(pieces[image.piece])
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            mtmd.mtmd_bitmap_free(bitmap)

    def describe(self) -> dict[str, Any]:
        """What /v1/server shows of the projector."""
        return {"path": str(self.path), "type": self.type,
                "encoded_images": self.encoded_images,
                "encode_seconds": round(self.encode_seconds, 3)}

    # ------------------------------------------------------------------ teardown

    def free(self) -> None:
        """Free libmtmd's context, the batch and the images kept (before the text model)."""
        with self._pending_lock:
            pending, self._pending = list(self._pending.values()), collections.OrderedDict()
        for _, chunk in pending:
            mtmd.mtmd_input_chunk_free(chunk)
        self._embeddings.clear()
        if self.batch is not None:
            ll.llama_batch_free(self.batch)
            self.batch = None
        if self.ctx is not None:
            mtmd.mtmd_free(self.ctx)
            self.ctx = None


@attrs.frozen
class _Layout:
    """What libmtmd makes of one picture: its ids (the text the projector puts around and
    between its pieces, and each piece's image ids) and its pieces, placed from 0."""

    ids: tuple[int, ...]
    pieces: tuple[PromptImage, ...]


def _placements(prompt: tuple[list[int], list[PromptImage]]) -> tuple[object, ...]:
    """A tokenized prompt as values (PromptImage compares by identity)."""
    ids, placed = prompt
    return (tuple(ids), *((image.start, image.n_tokens, image.image.key, image.grid,
                           image.causal, image.piece) for image in placed))


def _probe_picture(shade: int) -> DecodedImage:
    """A small flat picture for a load's probes (its key only names it)."""
    return DecodedImage(f"{shade:064x}", 64, 64, bytes([shade]) * (64 * 64 * 3))


def _grid(chunk: Any, n_tokens: int, n_pos: int) -> ImageGrid:
    """An image chunk's M-RoPE positions, from libmtmd's own (each section either moves
    with the image's first position or not: asked at two first positions)."""
    tokens = mtmd.mtmd_input_chunk_get_tokens_image(chunk)
    if not tokens:
        raise BackendError("libmtmd gave an image chunk without its image tokens")
    at_0 = [mtmd.mtmd_image_tokens_get_decoder_pos(tokens, 0, i) for i in range(n_tokens)]
    at_1 = [mtmd.mtmd_image_tokens_get_decoder_pos(tokens, 1, i) for i in range(n_tokens)]
    offsets, moves = [], []
    # (the batch's sections: time, height, width, unused; mtmd-helper's set_position_mrope_2d)
    for field in ("t", "y", "x", "z"):
        zero = tuple(int(getattr(p, field)) for p in at_0)
        one = tuple(int(getattr(p, field)) for p in at_1)
        shifted = [b - a for a, b in zip(zero, one, strict=True)]
        if set(shifted) - {0, 1} or len(set(shifted)) > 1:
            raise BackendError(f"libmtmd's M-RoPE {field} positions do not move with the "
                               "image's first position")
        offsets.append(zero)
        moves.append(shifted[0] == 1)
    return ImageGrid(tuple(offsets), tuple(moves), n_pos)


def _bitmap(image: DecodedImage, name: str = "") -> Any:
    """A libmtmd bitmap of the image's RGB pixels (libmtmd copies them), its id `name` (the
    id of every chunk made of it, which tokenize reads)."""
    size = image.width * image.height * 3
    if image.width <= 0 or image.height <= 0 or len(image.rgb) != size:
        raise BackendError(f"an image of {image.width}x{image.height} pixels needs {size} RGB "
                           f"bytes, not {len(image.rgb)}")
    pixels = ctypes.cast(ctypes.c_char_p(image.rgb), ctypes.POINTER(ctypes.c_uint8))
    bitmap = mtmd.mtmd_bitmap_init(image.width, image.height, pixels)
    if not bitmap:
        raise BackendError("libmtmd could not take the image's pixels")
    mtmd.mtmd_bitmap_set_id(bitmap, name.encode())
    return bitmap
