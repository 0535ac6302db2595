"""Images in chat messages, decoded (pure): the client's bytes become RGB pixels with a key
that names their content, within limits checked before and while decoding.

The pipeline decodes on its worker thread (prepare.py); the backend's projector turns the
pixels into the positions the model sees (Backend.tokenize_media).

Every bad image is an InvalidRequest (a 400 in the API's own shape) naming where it was in
the request: base64 that does not decode, more bytes than `max_bytes` (checked on the
base64's length, before decoding), a format other than PNG, JPEG, WebP, GIF and BMP (SVG
included), more pixels than `max_pixels` (checked on the header's size, before a pixel is
allocated: a decompression bomb never is), and a file that does not decode (truncated).
"""

from __future__ import annotations

import base64
import binascii
import collections
import hashlib
import io
import threading
from typing import TYPE_CHECKING

import attrs

from butter.chat.request import ImageInput
from butter.errors import InvalidRequest

if TYPE_CHECKING:
    from PIL import Image

# Per image: OpenAI's limit on an image file (20 MB); the request body's own limit
# (--max-body-bytes) holds the base64 first.
DEFAULT_MAX_IMAGE_BYTES = 20 * 2**20
# Per image: a 48-megapixel phone photo (8000 x 6000) fits; below Pillow's own bomb warning
# (89 MP). Decoded, an image takes 3 bytes a pixel (150 MB at the limit).
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000
# Per request, counted in every message (a conversation's earlier images too).
DEFAULT_MAX_IMAGES = 16
# The pixels RecentImages keeps decoded: ten 1920 x 1080 screenshots.
RECENT_IMAGE_BYTES = 64 * 2**20

# Pillow's names of the formats taken (GIF, animated WebP and APNG: their first frame).
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
FORMAT_NAMES = "PNG, JPEG, WebP, GIF or BMP"
_WHITESPACE = str.maketrans("", "", " \t\r\n")


@attrs.frozen
class ImageLimits:
    """What one request's images may be (butter serve --max-image-bytes,
    --max-image-pixels, --max-images)."""

    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # an image file's bytes (decoded base64)
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # width x height of one image
    max_images: int = DEFAULT_MAX_IMAGES  # images in one request, all messages


@attrs.frozen
class DecodedImage:
    """An image's pixels, RGB, row by row; `key` names the picture (the same pixels from
    any file, the same key; any other picture, another key)."""

    key: str
    width: int
    height: int
    rgb: bytes = attrs.field(repr=False)


def content_key(width: int, height: int, rgb: bytes) -> str:
    """SHA-256 of the size and the pixels (not of the file: a PNG and a JPEG of the same
    pixels are the same picture to the model)."""
    digest = hashlib.sha256(f"{width}x{height}:".encode())
    digest.update(rgb)
    return digest.hexdigest()


def check_image_count(count: int, limits: ImageLimits, param: str = "messages") -> None:
    """A request holds at most `limits.max_images` images."""
    if count > limits.max_images:
        raise InvalidRequest(
            f"the request holds {count} images, more than the limit of {limits.max_images} "
            "(butter serve --max-images)", param=param)


def decode_image(image: ImageInput, limits: ImageLimits) -> DecodedImage:
    """The image's pixels as RGB, EXIF orientation applied; refused (InvalidRequest, with
    the image's `param`) where it breaks a limit or does not decode. Blocking (CPU).

    Alpha is dropped, not composited: the pixels are those llama.cpp's own loader
    (stb_image, asked for 3 channels) gives for the same file, as llama-server serves it."""
    raw = _file_bytes(image, limits.max_bytes)
    picture = _open(raw, image.param)
    width, height = picture.size
    if width * height > limits.max_pixels:
        raise InvalidRequest(
            f"the image is {width} x {height} = {width * height:,} pixels, more than the limit "
            f"of {limits.max_pixels:,} (butter serve --max-image-pixels)", param=image.param)
    try:
        picture.load()  # (the pixels are allocated and decoded here, not before)
        upright = _rgb(_upright(picture))
    except MemoryError:
        raise
    except Exception as exc:  # (a malformed file: each decoder has its own errors)
        raise InvalidRequest(f"the image could not be decoded ({picture.format}): "
                             f"{_reason(exc)}", param=image.param) from None
    rgb = upright.tobytes()
    return DecodedImage(key=content_key(upright.width, upright.height, rgb),
                        width=upright.width, height=upright.height, rgb=rgb)


class RecentImages:
    """The images decoded lately, by a hash of the file as the client sent it and the limits
    it was decoded under: a conversation sends its images again with every turn, and
    decoding a screenshot again costs more than the returning turn's prefill. Holds at most
    `max_bytes` of pixels (least recently used out first); refusals are not kept.
    Thread-safe: requests are prepared on worker threads."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._images: collections.OrderedDict[str, DecodedImage] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def decode(self, image: ImageInput, limits: ImageLimits) -> DecodedImage:
        """decode_image's result: from memory when this file was decoded lately."""
        digest = hashlib.sha256(repr(limits).encode())
        digest.update(image.data.encode())
        name = digest.hexdigest()
        with self._lock:
            kept = self._images.get(name)
            if kept is not None:
                self._images.move_to_end(name)
                return kept
        decoded = decode_image(image, limits)  # (outside the lock: it takes a while)
        if len(decoded.rgb) <= self.max_bytes:
            with self._lock:
                if name not in self._images:
                    self._images[name] = decoded
                    self._bytes += len(decoded.rgb)
                while self._bytes > self.max_bytes:
                    self._bytes -= len(self._images.popitem(last=False)[1].rgb)
        return decoded

    def clear(self) -> None:
        """Forget every image."""
        with self._lock:
            self._images.clear()
            self._bytes = 0

    @property
    def held_bytes(self) -> int:
        """The pixels held, in bytes."""
        return self._bytes


def _file_bytes(image: ImageInput, max_bytes: int) -> bytes:
    """The file's bytes from strict base64 (line breaks allowed, as MIME writes them);
    too long a string is refused before it is decoded."""
    data = image.data.translate(_WHITESPACE)
    padding = len(data) - len(data.rstrip("="))
    size = len(data) // 4 * 3 - min(padding, 2)
    if size > max_bytes:
        raise InvalidRequest(
            f"the image is {size:,} bytes, more than the limit of {max_bytes:,} "
            "(butter serve --max-image-bytes)", param=image.param)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequest(f"the image is not valid base64: {exc}",
                             param=image.param) from None
    if not raw:
        raise InvalidRequest("the image is empty", param=image.param)
    return raw


def _open(raw: bytes, param: str) -> Image.Image:
    """The file opened lazily (its header read, no pixels), in a format taken."""
    from PIL import Image, UnidentifiedImageError

    if raw.lstrip()[:1] == b"<":  # XML: SVG (or HTML)
        raise InvalidRequest(f"SVG images are not supported: send a {FORMAT_NAMES} image",
                             param=param)
    try:
        return Image.open(io.BytesIO(raw), formats=FORMATS)
    except UnidentifiedImageError:
        raise InvalidRequest(f"the image is not a {FORMAT_NAMES} file", param=param) from None
    except Image.DecompressionBombError as exc:  # (Pillow's own bound, far above ours)
        raise InvalidRequest(f"the image has too many pixels: {exc}", param=param) from None
    except Exception as exc:  # (a header that does not parse)
        raise InvalidRequest(f"the image could not be read: {_reason(exc)}",
                             param=param) from None


def _upright(picture: Image.Image) -> Image.Image:
    """The picture turned as its EXIF orientation says (phone photos); as it is where the
    EXIF data is unreadable (the pixels are still the picture)."""
    from PIL import ImageOps

    try:
        turned = ImageOps.exif_transpose(picture)
    except Exception:  # (malformed EXIF)
        return picture
    return picture if turned is None else turned


def _rgb(picture: Image.Image) -> Image.Image:
    """8-bit RGB. 16-bit grayscale keeps its high byte (as stb_image); palette and alpha
    images lose their alpha."""
    if picture.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        picture = picture.point(lambda value: value / 256, "L") if picture.mode == "I" else (
            picture.convert("I").point(lambda value: value / 256, "L"))
    elif picture.mode in ("P", "PA"):
        picture = picture.convert("RGBA")  # (the palette's colours; no transparency warning)
    return picture if picture.mode == "RGB" else picture.convert("RGB")


def _reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
