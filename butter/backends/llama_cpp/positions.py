"""Where a sequence's cells sit in llama.cpp's positions when its images take M-RoPE
positions (Qwen2-VL to Qwen3-VL, Qwen3.5: text models whose RoPE has sections).

Such a model gives each image embedding four positions (time, height, width and an unused
one; libmtmd says which, mtmd_image_tokens_get_decoder_pos): every cell of an image has the
time position p0, the first one after what came before it, and the text after the image
goes on from p0 + n_pos, where n_pos (the longer side of the image's grid of merged
patches) is fewer than its cells. llama.cpp's cache keeps a cell's time position (and its
height and width, for the causal order within an image) and removes and copies cells by
position.

butter's engine counts cells: its positions are indices into a sequence's tokens. This
keeps, per sequence, the images placed in it, to give each index llama.cpp's position. As
an image's cells share one position, a sequence can be cut or copied in part only at an
image's edge; the engine cuts only there (prefix_cache.image_edge), and a cut elsewhere is
refused here rather than made wrong. A model whose images take one position per cell never
places any: its positions are its indices.
"""

from __future__ import annotations

import bisect
import struct

import attrs

from butter.backends.base import BackendError

# The bytes after llama.cpp's state in a saved sequence (SaveSequence): its images, then
# their count and this tag, so a restore puts the positions back with the cells.
_SAVED_TAG = b"BTRMROPE"
_IMAGE = struct.Struct("<qqq")
_TRAILER = struct.Struct("<q8s")


@attrs.frozen
class PlacedImage:
    """An image's cells in a sequence: `n_tokens` from index `start`, taking `n_pos`
    positions."""

    start: int
    n_tokens: int
    n_pos: int

    @property
    def end(self) -> int:
        return self.start + self.n_tokens

    @property
    def saved(self) -> int:
        """Positions the image takes fewer than it has cells."""
        return self.n_tokens - self.n_pos


class SequencePositions:
    """Each sequence's images (by start index) and the positions its indices map to."""

    def __init__(self) -> None:
        self._images: dict[int, list[PlacedImage]] = {}

    def images(self, seq: int) -> tuple[PlacedImage, ...]:
        return tuple(self._images.get(seq, ()))

    def shift(self, seq: int, index: int) -> int:
        """How far llama.cpp's position is behind `index` for a cell at `index` outside
        any image: the positions the images before it saved."""
        return sum(image.saved for image in self._images.get(seq, ()) if image.end <= index)

    def position(self, seq: int, index: int) -> int:
        """llama.cpp's (time) position of the cell at `index`: an image's cells all have its
        first one."""
        shift = 0
        for image in self._images.get(seq, ()):
            if image.end <= index:
                shift += image.saved
            elif image.start <= index:
                return image.start - shift
            else:
                break
        return index - shift

    def place(self, seq: int, image: PlacedImage) -> None:
        """`image`'s cells are (being) written into `seq`: later indices shift by the
        positions it saves. Placing the same image again changes nothing."""
        placed = self._images.setdefault(seq, [])
        at = bisect.bisect_left([p.start for p in placed], image.start)
        if at < len(placed) and placed[at] == image:
            return
        before, after = placed[at - 1] if at else None, placed[at] if at < len(placed) else None
        if (before is not None and before.end > image.start) or (
                after is not None and after.start < image.end):
            raise BackendError(f"an image at cells {image.start}..{image.end} of seq {seq} "
                               "overlaps one already there")
        placed.insert(at, image)

    def _edge(self, seq: int, index: int, what: str) -> int:
        """llama.cpp's position of index `index`, which must be no image's inside."""
        for image in self._images.get(seq, ()):
            if image.start < index < image.end:
                raise BackendError(
                    f"seq {seq} cannot be {what} at cell {index}, inside an image (cells "
                    f"{image.start}..{image.end}, which share one M-RoPE position)")
        return self.position(seq, index)

    def cut(self, seq: int, keep: int) -> int:
        """`seq` keeps its first `keep` cells: the position llama.cpp removes from. Images
        from `keep` on are forgotten."""
        if keep < 0:
            self._images.pop(seq, None)
            return -1
        position = self._edge(seq, keep, "cut")
        placed = self._images.get(seq)
        if placed:
            placed[:] = [image for image in placed if image.end <= keep]
        return position

    def copy(self, src: int, dst: int, length: int) -> int:
        """`dst` (emptied) gets `src`'s first `length` cells: the position llama.cpp copies
        up to."""
        position = self._edge(src, length, "copied")
        self._images[dst] = [image for image in self._images.get(src, ()) if image.end <= length]
        return position

    def forget(self, seq: int) -> None:
        self._images.pop(seq, None)

    # ------------------------------------------------------------------ saving

    def saved_with(self, seq: int, state: bytes) -> bytes:
        """llama.cpp's saved state of `seq` with its images after it."""
        placed = self._images.get(seq, ())
        images = b"".join(_IMAGE.pack(i.start, i.n_tokens, i.n_pos) for i in placed)
        return state + images + _TRAILER.pack(len(placed), _SAVED_TAG)

    def restored_from(self, seq: int, data: bytes) -> bytes:
        """`data` (saved_with's) without its images, which `seq` now has."""
        if len(data) < _TRAILER.size:
            raise BackendError("a saved sequence is too short to hold its images' positions")
        count, tag = _TRAILER.unpack_from(data, len(data) - _TRAILER.size)
        start = len(data) - _TRAILER.size - count * _IMAGE.size
        if tag != _SAVED_TAG or count < 0 or start < 0:
            raise BackendError("a saved sequence does not say where its images are")
        self._images[seq] = [PlacedImage(*_IMAGE.unpack_from(data, start + i * _IMAGE.size))
                             for i in range(count)]
        return data[:start]

