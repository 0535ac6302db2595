"""Images in, on every API (#55): each wire shape becomes ImageInput parts in the chat
prompt's messages (butter/protocol/), images decode within their limits
(butter/chat/images.py), a model without a projector refuses them
(butter/pipeline/prepare.decode_images), and every bad input is a 400 in the API's own
shape through a real server on the tiny model (the official openai, anthropic and ollama
clients)."""

from __future__ import annotations

import base64
import io
import resource
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import anthropic
import httpx
import openai
import pytest
from PIL import Image

from butter.chat.images import (
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_IMAGES,
    ImageLimits,
    RecentImages,
    check_image_count,
    content_key,
    decode_image,
)
from butter.chat.request import IMAGE_PART, ChatPrompt, ImageInput
from butter.errors import InvalidRequest
from butter.pipeline.prepare import decode_images
from butter.pipeline.resident import ResidentModel
from butter.protocol import anthropic as anthropic_wire
from butter.protocol import ollama as ollama_wire
from butter.protocol import openai as openai_wire
from butter.settings import ServeSettings
from tests.conftest import ServerProcess

ollama = pytest.importorskip("ollama")

MAX_IMAGES = 2  # the test server's --max-images


def encoded(picture: Image.Image, fmt: str = "PNG", **options: Any) -> str:
    buffer = io.BytesIO()
    picture.save(buffer, fmt, **options)
    return base64.b64encode(buffer.getvalue()).decode()


def squares(width: int = 6, height: int = 4) -> Image.Image:
    """An RGB picture whose every pixel differs (a turn or a swap shows)."""
    picture = Image.new("RGB", (width, height))
    picture.putdata([(x * 40, y * 60, (x + y) * 10) for y in range(height)
                     for x in range(width)])
    return picture


PNG = encoded(squares())
DATA_URL = f"data:image/png;base64,{PNG}"


def png_header(width: int, height: int) -> bytes:
    """A PNG that claims `width` x `height` RGB pixels and holds two rows: a
    decompression bomb's header (its pixels would be width * height * 3 bytes)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    rows = zlib.compress(b"\x00" * (1 + 3 * min(width, 1000)) * 2)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height,
                                                              8, 2, 0, 0, 0))
            + chunk(b"IDAT", rows) + chunk(b"IEND", b""))


def image_of(data: str | bytes, param: str = "messages[0].content[0]") -> ImageInput:
    text = data if isinstance(data, str) else base64.b64encode(data).decode()
    return ImageInput(data=text, media_type="image/png", param=param)


def pixel(decoded: Any, x: int, y: int) -> tuple[int, int, int]:
    at = (y * decoded.width + x) * 3
    return tuple(decoded.rgb[at:at + 3])


# ---------------------------------------------------------------- wire shapes → parts

def test_openai_image_url_parts_become_image_inputs_between_the_text() -> None:
    request = openai_wire.parse_chat_request({"messages": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [
            {"type": "text", "text": "What is "},
            {"type": "image_url", "image_url": {"url": DATA_URL, "detail": "auto"}},
            {"type": "text", "text": " and "},
            {"type": "image_url", "image_url": "data:image/jpeg;base64,aGk="},  # bare string
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": [
            {"type": "image_url", "image_url": {"url": DATA_URL}}]},
    ]})
    prompt = openai_wire.generation_request(request).prompt
    assert isinstance(prompt, ChatPrompt)
    system, user, tool = prompt.messages
    assert system["content"] == "Be brief."  # (no images: joined text, as before)
    assert [part["type"] for part in user["content"]] == ["text", IMAGE_PART, "text",
                                                          IMAGE_PART]
    assert user["content"][0] == {"type": "text", "text": "What is "}
    first, second, third = prompt.images()
    assert first == ImageInput(data=PNG, media_type="image/png",
                               param="messages[1].content[1].image_url.url")
    assert (second.data, second.media_type) == ("aGk=", "image/jpeg")
    assert second.param == "messages[1].content[3].image_url"
    assert third.param == "messages[2].content[0].image_url.url"
    assert tool["content"][0]["image"] is third


def test_openai_messages_without_images_are_as_before() -> None:
    request = openai_wire.parse_chat_request({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    prompt = openai_wire.generation_request(request).prompt
    assert isinstance(prompt, ChatPrompt)
    assert prompt.messages == [{"role": "user", "content": "ab"}] and prompt.images() == []


@pytest.mark.parametrize(("part", "param", "words"), [
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
     "messages[0].content[0].image_url.url", "remote images are not fetched"),
    ({"type": "image_url", "image_url": {"url": "HTTP://example.com/cat.png"}},
     "messages[0].content[0].image_url.url", "remote images are not fetched"),
    ({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}},
     "messages[0].content[0].image_url.url", "base64 data URL"),
    ({"type": "image_url", "image_url": {"url": "data:image/png,%89PNG"}},
     "messages[0].content[0].image_url.url", "base64 data URL"),
    ({"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGk="}},
     "messages[0].content[0].image_url.url", "not an image"),
    ({"type": "image_url", "image_url": {"detail": "low"}},
     "messages[0].content[0].image_url.url", "url"),
    ({"type": "image_url"}, "messages[0].content[0].image_url", "url"),
    ({"type": "input_audio", "input_audio": {"data": "aGk=", "format": "wav"}},
     "messages[0].content[0]", "only text and image_url parts"),
])
def test_openai_refuses_what_is_not_an_inline_image(part: dict[str, Any], param: str,
                                                    words: str) -> None:
    with pytest.raises(InvalidRequest, match=words) as refused:
        openai_wire.parse_chat_request({"messages": [{"role": "user", "content": [part]}]})
    assert refused.value.param == param


def test_openai_takes_images_in_user_and_tool_messages_only() -> None:
    with pytest.raises(InvalidRequest, match="not in a system message") as refused:
        openai_wire.parse_chat_request({"messages": [{"role": "system", "content": [
            {"type": "image_url", "image_url": {"url": DATA_URL}}]}]})
    assert refused.value.param == "messages[0].content[0]"


def anthropic_prompt(messages: list[dict[str, Any]]) -> ChatPrompt:
    request = anthropic_wire.parse_messages_request({"max_tokens": 8, "messages": messages})
    prompt = anthropic_wire.generation_request(request).prompt
    assert isinstance(prompt, ChatPrompt)
    return prompt


IMAGE_BLOCK = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                           "data": PNG}}


def test_anthropic_image_blocks_in_user_content_and_tool_results() -> None:
    prompt = anthropic_prompt([
        {"role": "user", "content": [{"type": "text", "text": "Look."},
                                     {"type": "text", "text": "Here:"}, IMAGE_BLOCK,
                                     {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read",
                                           "input": {"file_path": "shot.png"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [IMAGE_BLOCK]},
            {"type": "tool_result", "tool_use_id": "t2", "is_error": True, "content": [
                {"type": "text", "text": "partly"}, IMAGE_BLOCK]},
            {"type": "text", "text": "And now?"}]},
    ])
    user, _, read, failed, again = prompt.messages
    # Text blocks joined by a blank line (as without images), the image a part of its own.
    assert user["content"] == [{"type": "text", "text": "Look.\n\nHere:"},
                               {"type": IMAGE_PART, "image": prompt.images()[0]},
                               {"type": "text", "text": "What is it?"}]
    assert read == {"role": "tool", "tool_call_id": "t1", "content": [
        {"type": IMAGE_PART, "image": prompt.images()[1]}]}
    assert failed["content"][0] == {"type": "text", "text": "Error: partly"}
    assert again == {"role": "user", "content": "And now?"}
    assert [image.param for image in prompt.images()] == [
        "messages.0.content.2.source.data", "messages.2.content.0.content.0.source.data",
        "messages.2.content.1.content.1.source.data"]
    assert {image.data for image in prompt.images()} == {PNG}
    assert prompt.images()[0].media_type == "image/png"


def test_anthropic_messages_without_images_are_as_before() -> None:
    prompt = anthropic_prompt([{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "is_error": True,
         "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"type": "tool_result", "tool_use_id": "t2", "content": "plain"},
        {"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}])
    assert prompt.messages == [
        {"role": "tool", "tool_call_id": "t1", "content": "Error: a\n\nb"},
        {"role": "tool", "tool_call_id": "t2", "content": "plain"},
        {"role": "user", "content": "x\n\ny"}]


@pytest.mark.parametrize(("source", "param", "words"), [
    ({"type": "url", "url": "https://example.com/cat.png"}, "messages.0.content.0.source",
     "remote images are not fetched"),
    ({"type": "file", "file_id": "file_1"}, "messages.0.content.0.source.type", "base64"),
    ({"type": "base64", "media_type": "image/png", "data": 5},
     "messages.0.content.0.source.data", "base64 string"),
])
def test_anthropic_refuses_what_is_not_an_inline_image(source: dict[str, Any], param: str,
                                                       words: str) -> None:
    with pytest.raises(InvalidRequest, match=words) as refused:
        anthropic_prompt([{"role": "user", "content": [{"type": "image", "source": source}]}])
    assert refused.value.param == param


def test_ollama_images_come_before_the_message_text() -> None:
    request = ollama_wire.parse_chat_request({"model": "m", "messages": [
        {"role": "user", "content": "What are these?", "images": [PNG, "aGk="]},
        {"role": "assistant", "content": "Two pictures."},
        {"role": "user", "content": "", "images": [PNG]},
        {"role": "user", "content": "Thanks"}]})
    prompt = ollama_wire.chat_generation(request).prompt
    assert isinstance(prompt, ChatPrompt)
    first, second, third = prompt.images()
    assert prompt.messages[0]["content"] == [
        {"type": IMAGE_PART, "image": first}, {"type": IMAGE_PART, "image": second},
        {"type": "text", "text": "What are these?"}]
    assert prompt.messages[2]["content"] == [{"type": IMAGE_PART, "image": third}]
    assert prompt.messages[3]["content"] == "Thanks"
    assert [image.param for image in prompt.images()] == [
        "messages[0].images[0]", "messages[0].images[1]", "messages[2].images[0]"]
    assert first.media_type is None and first.data == PNG


def test_ollama_generate_images_go_through_the_chat_template() -> None:
    request = ollama_wire.parse_generate_request({"model": "m", "prompt": "Describe it.",
                                                  "system": "Be brief.", "images": [PNG]})
    prompt = ollama_wire.generate_generation(request).prompt
    assert isinstance(prompt, ChatPrompt)
    assert prompt.messages[0] == {"role": "system", "content": "Be brief."}
    assert prompt.messages[1]["content"][1] == {"type": "text", "text": "Describe it."}
    assert [image.param for image in prompt.images()] == ["images[0]"]


@pytest.mark.parametrize(("payload", "param", "words"), [
    ({"prompt": "x", "raw": True, "images": [PNG]}, "images", "raw prompt"),
    ({"prompt": "x", "suffix": "y", "images": [PNG]}, "images", "raw prompt"),
    ({"prompt": "x", "images": [5]}, "images[0]", "base64 string"),
])
def test_ollama_generate_refusals(payload: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(InvalidRequest, match=words) as refused:
        ollama_wire.parse_generate_request(payload)
    assert refused.value.param == param


def test_ollama_chat_refusals() -> None:
    with pytest.raises(InvalidRequest, match="not in a assistant message") as refused:
        ollama_wire.parse_chat_request({"messages": [
            {"role": "assistant", "content": "x", "images": [PNG]}]})
    assert refused.value.param == "messages[0].images"
    with pytest.raises(InvalidRequest, match="base64 string") as refused:
        ollama_wire.parse_chat_request({"messages": [
            {"role": "user", "content": "x", "images": [PNG, {"data": PNG}]}]})
    assert refused.value.param == "messages[0].images[1]"


# ---------------------------------------------------------------- decoding

LIMITS = ImageLimits()


def test_the_default_limits() -> None:
    assert (LIMITS.max_bytes, LIMITS.max_pixels, LIMITS.max_images) == (
        DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_IMAGES)
    assert DEFAULT_MAX_IMAGE_BYTES == 20 * 2**20 and DEFAULT_MAX_IMAGE_PIXELS == 50_000_000
    settings = ServeSettings(model="x")
    assert (settings.max_image_bytes, settings.max_image_pixels, settings.max_images) == (
        DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_IMAGES)


def test_a_png_decodes_to_its_pixels_and_a_key_of_them() -> None:
    picture = squares()
    decoded = decode_image(image_of(PNG), LIMITS)
    assert (decoded.width, decoded.height) == (6, 4)
    assert decoded.rgb == picture.tobytes()
    assert decoded.key == content_key(6, 4, picture.tobytes())
    assert "rgb" not in repr(decoded)


def test_the_key_names_the_pixels_not_the_file() -> None:
    picture = squares()
    files = [encoded(picture, "PNG", compress_level=0),
             encoded(picture, "PNG", compress_level=9), encoded(picture, "BMP"),
             encoded(picture, "WEBP", lossless=True), encoded(picture.convert("RGBA"))]
    assert len(set(files)) == len(files)
    keys = {decode_image(image_of(data), LIMITS).key for data in files}
    assert len(keys) == 1
    other = squares()
    other.putpixel((5, 3), (1, 2, 3))
    assert decode_image(image_of(encoded(other)), LIMITS).key not in keys
    # The same pixels in another shape are another picture.
    assert decode_image(image_of(encoded(squares(4, 6))), LIMITS).key not in keys


def test_a_jpeg_is_turned_as_its_exif_orientation_says() -> None:
    picture = Image.new("RGB", (64, 32), (255, 0, 0))
    picture.paste((0, 0, 255), (32, 0, 64, 32))  # left red, right blue
    exif = Image.Exif()
    exif[0x0112] = 6  # stored turned left: shown turned 90 degrees clockwise
    decoded = decode_image(image_of(encoded(picture, "JPEG", quality=95,
                                            exif=exif.tobytes())), LIMITS)
    assert (decoded.width, decoded.height) == (32, 64)
    top, bottom = pixel(decoded, 16, 8), pixel(decoded, 16, 56)
    assert top[0] > 200 and top[2] < 60  # red on top
    assert bottom[2] > 200 and bottom[0] < 60  # blue below
    plain = decode_image(image_of(encoded(picture, "JPEG", quality=95)), LIMITS)
    assert (plain.width, plain.height) == (64, 32)


def test_alpha_is_dropped_as_llama_cpp_drops_it() -> None:
    picture = Image.new("RGBA", (2, 1))
    picture.putdata([(10, 20, 30, 0), (200, 100, 50, 255)])
    decoded = decode_image(image_of(encoded(picture)), LIMITS)
    assert decoded.rgb == bytes([10, 20, 30, 200, 100, 50])


def test_a_palette_image_with_transparency_gives_its_colours() -> None:
    picture = Image.new("P", (2, 1))
    picture.putpalette([255, 0, 0, 0, 255, 0] + [0] * 762)
    picture.putdata([0, 1])
    decoded = decode_image(image_of(encoded(picture, transparency=0)), LIMITS)
    assert decoded.rgb == bytes([255, 0, 0, 0, 255, 0])


def test_grey_and_sixteen_bit_grey() -> None:
    grey = Image.new("L", (2, 1))
    grey.putdata([7, 250])
    assert decode_image(image_of(encoded(grey)), LIMITS).rgb == bytes([7] * 3 + [250] * 3)
    deep = Image.new("I;16", (2, 1))
    deep.putdata([65535, 100 * 256 + 255])
    assert decode_image(image_of(encoded(deep)), LIMITS).rgb == bytes([255] * 3 + [100] * 3)


def test_an_animated_gif_gives_its_first_frame() -> None:
    frames = [Image.new("RGB", (4, 4), colour) for colour in ((255, 0, 0), (0, 0, 255))]
    data = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100)
    decoded = decode_image(image_of(data), LIMITS)
    assert (decoded.width, decoded.height) == (4, 4)
    assert set(decoded.rgb[0::3]) == {255} and set(decoded.rgb[2::3]) == {0}


def test_base64_with_line_breaks_is_read() -> None:
    wrapped = "\n".join(PNG[i:i + 76] for i in range(0, len(PNG), 76)) + "\r\n"
    assert decode_image(image_of(wrapped), LIMITS).rgb == squares().tobytes()


def truncated_png() -> str:
    noise = Image.effect_noise((64, 64), 60).convert("RGB")
    raw = base64.b64decode(encoded(noise))
    return base64.b64encode(raw[:len(raw) // 2]).decode()


SVG = base64.b64encode(b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg" '
                       b'width="10" height="10"/>').decode()
BAD_IMAGES = {
    "bad base64": ("not base64 at all!", LIMITS, "not valid base64"),
    "bad padding": ("aGk", LIMITS, "not valid base64"),
    "url-safe base64": (PNG.replace("+", "-").replace("/", "_") + "-_", LIMITS,
                        "not valid base64"),
    "empty": ("", LIMITS, "empty"),
    "truncated png": (truncated_png(), LIMITS, "could not be decoded"),
    "png header alone": (base64.b64encode(base64.b64decode(PNG)[:20]).decode(), LIMITS,
                         "could not be read"),
    "truncated jpeg": (base64.b64encode(base64.b64decode(encoded(
        Image.effect_noise((64, 64), 60), "JPEG"))[:400]).decode(), LIMITS,
        "could not be decoded"),
    "svg": (SVG, LIMITS, "SVG images are not supported"),
    "pdf": (base64.b64encode(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n").decode(), LIMITS,
            "not a PNG, JPEG, WebP, GIF or BMP file"),
    "tiff": (encoded(squares(), "TIFF"), LIMITS, "not a PNG, JPEG, WebP, GIF or BMP file"),
    "text": (base64.b64encode(b"hello world").decode(), LIMITS, "not a PNG"),
    "too many bytes": (PNG, ImageLimits(max_bytes=40), "more than the limit of 40 "),
    "too many pixels": (PNG, ImageLimits(max_pixels=23), r"6 x 4 = 24 pixels, more than "
                                                        r"the limit of 23 \(butter serve "
                                                        r"--max-image-pixels\)"),
    "a bomb under pillow's bound": (base64.b64encode(png_header(9000, 9000)).decode(),
                                    LIMITS, "81,000,000 pixels, more than the limit"),
    "a bomb over pillow's bound": (base64.b64encode(png_header(100_000, 100_000)).decode(),
                                   LIMITS, "too many pixels"),
}


@pytest.mark.parametrize("case", list(BAD_IMAGES))
def test_each_bad_image_is_refused_naming_where_it_was(case: str) -> None:
    data, limits, words = BAD_IMAGES[case]
    with pytest.raises(InvalidRequest, match=words) as refused:
        decode_image(image_of(data, param="messages[3].content[1].image_url.url"), limits)
    assert refused.value.status == 400
    assert refused.value.param == "messages[3].content[1].image_url.url"


def test_a_decompression_bomb_is_refused_before_its_pixels_exist() -> None:
    """9000 x 9000 RGB would take 243 MB; the header alone is read (fast, no memory)."""
    bomb = image_of(png_header(9000, 9000))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    started = time.monotonic()
    for _ in range(5):
        with pytest.raises(InvalidRequest, match="--max-image-pixels"):
            decode_image(bomb, LIMITS)
    assert time.monotonic() - started < 2
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 * 1024
    # The same kind of file within the limit is decoded (Pillow fills rows a finished
    # compressed stream lacks).
    small = decode_image(image_of(png_header(300, 200)), LIMITS)
    assert (small.width, small.height, len(small.rgb)) == (300, 200, 300 * 200 * 3)


def test_too_many_bytes_are_refused_before_decoding() -> None:
    """The limit is on the file's bytes, read off the base64's length: a string of the
    limit's size decodes, one more base64 group does not (and is never decoded)."""
    raw = base64.b64decode(PNG)
    assert decode_image(image_of(PNG), ImageLimits(max_bytes=len(raw))).width == 6
    with pytest.raises(InvalidRequest, match=f"{len(raw) + 3:,} bytes"):
        decode_image(image_of(raw + b"xyz"), ImageLimits(max_bytes=len(raw)))
    with pytest.raises(InvalidRequest, match="more than the limit"):
        decode_image(image_of("!" * 100), ImageLimits(max_bytes=10))  # (not even base64)


def test_the_image_count() -> None:
    check_image_count(2, ImageLimits(max_images=2))
    with pytest.raises(InvalidRequest, match="3 images, more than the limit of 2") as over:
        check_image_count(3, ImageLimits(max_images=2), "images")
    assert over.value.param == "images"


# ---------------------------------------------------------------- the pipeline's refusal

def prompt_with(*images: ImageInput) -> ChatPrompt:
    return ChatPrompt([{"role": "user", "content": [
        *({"type": IMAGE_PART, "image": image} for image in images),
        {"type": "text", "text": "What is it?"}]}])


@pytest.fixture(scope="module")
def resident(tiny_gguf: Path) -> Iterator[ResidentModel]:
    model = ResidentModel.load_sync(ServeSettings(model=str(tiny_gguf), threads=1,
                                                  max_images=3, max_image_pixels=1000))
    yield model
    model.backend.close()


def test_a_model_without_a_projector_refuses_images(resident: ResidentModel) -> None:
    assert not resident.backend.vision
    assert resident.image_limits == ImageLimits(max_bytes=DEFAULT_MAX_IMAGE_BYTES,
                                                max_pixels=1000, max_images=3)
    assert decode_images(resident, ChatPrompt([{"role": "user", "content": "hi"}])) == []
    with pytest.raises(InvalidRequest, match=r"takes no images: start butter with --mmproj "
                                             r"<projector\.gguf>") as refused:
        decode_images(resident, prompt_with(image_of(PNG, "messages[0].images[0]"),
                                            image_of("junk", "messages[0].images[1]")))
    assert refused.value.param == "messages[0].images[0]"


def test_a_model_with_a_projector_decodes_each_image_within_its_limits() -> None:
    seeing = cast(ResidentModel, SimpleNamespace(
        model_id="tiny", backend=SimpleNamespace(vision=True),
        image_limits=ImageLimits(max_images=2, max_pixels=100),
        recent_images=RecentImages(2**20)))
    other = encoded(Image.new("RGB", (3, 3), (9, 9, 9)))
    decoded = decode_images(seeing, prompt_with(image_of(PNG), image_of(other)))
    assert [(image.width, image.height) for image in decoded] == [(6, 4), (3, 3)]
    # The next turn sends them again: the model's recent images answer, nothing is decoded.
    again = decode_images(seeing, prompt_with(image_of(other), image_of(PNG)))
    assert again[0] is decoded[1] and again[1] is decoded[0]
    with pytest.raises(InvalidRequest, match="more than the limit of 2"):
        decode_images(seeing, prompt_with(*[image_of(PNG)] * 3))
    big = encoded(Image.new("RGB", (11, 10)))
    with pytest.raises(InvalidRequest, match="110 pixels") as refused:
        decode_images(seeing, prompt_with(image_of(PNG), image_of(big, "images[1]")))
    assert refused.value.param == "images[1]"


def test_recent_images_decode_a_file_sent_again_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import butter.chat.images as images_module

    decoded: list[str] = []
    real = images_module.decode_image

    def counted(image: ImageInput, limits: ImageLimits) -> Any:
        decoded.append(image.data)
        return real(image, limits)

    monkeypatch.setattr(images_module, "decode_image", counted)
    recent = RecentImages(2**20)
    first = recent.decode(image_of(PNG), LIMITS)
    assert recent.decode(image_of(PNG, "messages[4].content[1]"), LIMITS) is first
    assert decoded == [PNG]  # (the same file in a later turn: not decoded again)
    other = encoded(squares(5, 4))
    assert recent.decode(image_of(other), LIMITS).key != first.key
    # Under other limits the file is decoded again (and may be refused there).
    with pytest.raises(InvalidRequest, match="more than the limit"):
        recent.decode(image_of(PNG), ImageLimits(max_pixels=10))
    assert decoded == [PNG, other, PNG]
    # A refusal is not kept: the same bad file is refused each time, and decoded each time.
    for _ in range(2):
        with pytest.raises(InvalidRequest, match="not valid base64"):
            recent.decode(image_of("@@@@"), LIMITS)
    assert decoded[-2:] == ["@@@@", "@@@@"]
    recent.clear()  # (a model closed: its images go with it)
    assert recent.held_bytes == 0
    assert recent.decode(image_of(PNG), LIMITS) is not first


def test_recent_images_hold_at_most_their_bytes_newest_kept() -> None:
    files = [encoded(squares(4 + index, 4)) for index in range(6)]
    sizes = [(4 + index) * 4 * 3 for index in range(6)]
    recent = RecentImages(sum(sizes[-3:]))  # room for the last three
    kept = [recent.decode(image_of(data), LIMITS) for data in files]
    assert recent.held_bytes == sum(sizes[-3:])
    assert all(recent.decode(image_of(data), LIMITS) is image
               for data, image in zip(files[-3:], kept[-3:], strict=True))
    assert recent.decode(image_of(files[0]), LIMITS) is not kept[0]  # (pushed out)
    assert recent.held_bytes <= recent.max_bytes
    too_big = RecentImages(10)  # one image is more than it holds: none is kept
    assert too_big.decode(image_of(PNG), LIMITS) is not too_big.decode(image_of(PNG), LIMITS)
    assert too_big.held_bytes == 0


# ---------------------------------------------------------------- through a real server

@pytest.fixture(scope="module")
def server(tiny_gguf: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(["--model", str(tiny_gguf), "--alias", "tiny", "--max-context",
                             "1024", "--max-images", str(MAX_IMAGES), "--threads", "1"])
    yield process
    process.stop()


@pytest.fixture
def openai_client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def anthropic_client(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0,
                               timeout=60)


@pytest.fixture
def ollama_client(server: ServerProcess) -> Any:
    return ollama.Client(host=server.base_url, timeout=60)


def openai_image(url: str = DATA_URL) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def openai_refusal(client: openai.OpenAI, content: list[dict[str, Any]],
                   role: str = "user") -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", max_tokens=2, messages=cast(
            Any, [{"role": role, "content": content}]))
    assert refused.value.status_code == 400
    body = cast(dict[str, Any], refused.value.body)
    assert body["type"] == "invalid_request_error" and body["message"]
    return body


def test_openai_refusals_through_the_server(openai_client: openai.OpenAI) -> None:
    remote = openai_refusal(openai_client, [openai_image("https://example.com/a.png")])
    assert "remote images are not fetched" in remote["message"]
    assert remote["param"] == "messages[0].content[0].image_url.url"
    local = openai_refusal(openai_client, [openai_image("file:///etc/passwd")])
    assert "base64 data URL" in local["message"]
    many = openai_refusal(openai_client, [openai_image()] * (MAX_IMAGES + 1))
    assert "3 images, more than the limit of 2" in many["message"]
    assert many["param"] == "messages"
    shapeless = openai_refusal(openai_client, [{"type": "image_url", "image_url": {}}])
    assert shapeless["param"] == "messages[0].content[0].image_url.url"
    system = openai_refusal(openai_client, [openai_image()], role="system")
    assert "not in a system message" in system["message"]


def test_the_image_count_holds_on_every_route(server: ServerProcess) -> None:
    content = [openai_image()] * (MAX_IMAGES + 1)
    for route in ("/v1/chat/completions/input_tokens", "/tokenize"):
        refused = httpx.post(f"{server.base_url}{route}", timeout=30, json={
            "model": "tiny", "messages": [{"role": "user", "content": content}]})
        assert refused.status_code == 400, route
        assert "more than the limit of 2" in refused.json()["error"]["message"]
    tokenized = httpx.post(f"{server.base_url}/tokenize", timeout=30, json={
        "model": "tiny", "messages": [{"role": "user", "content": [openai_image()]}]})
    assert tokenized.status_code == 400
    assert "/tokenize takes no images" in tokenized.json()["error"]["message"]
    counted = httpx.post(f"{server.base_url}/v1/messages/count_tokens", timeout=30, json={
        "model": "tiny", "messages": [{"role": "user", "content": [IMAGE_BLOCK] * 3}]})
    assert counted.status_code == 400
    assert counted.json()["error"]["type"] == "invalid_request_error"


def anthropic_refusal(client: anthropic.Anthropic, content: list[dict[str, Any]]
                      ) -> dict[str, Any]:
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model="tiny", max_tokens=2, messages=cast(
            Any, [{"role": "user", "content": content}]))
    assert refused.value.status_code == 400
    body = cast(dict[str, Any], refused.value.body)
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    return cast(dict[str, Any], body["error"])


def test_anthropic_refusals_through_the_server(anthropic_client: anthropic.Anthropic
                                               ) -> None:
    remote = anthropic_refusal(anthropic_client, [{"type": "image", "source": {
        "type": "url", "url": "https://example.com/a.png"}}])
    assert "remote images are not fetched" in remote["message"]
    screenshots = [{"type": "tool_result", "tool_use_id": "t1",
                    "content": [IMAGE_BLOCK] * (MAX_IMAGES + 1)}]
    many = anthropic_refusal(anthropic_client, screenshots)
    assert "3 images, more than the limit of 2" in many["message"]
    filed = anthropic_refusal(anthropic_client, [{"type": "image", "source": {
        "type": "file", "file_id": "file_1"}}])
    assert "base64" in filed["message"]


def test_ollama_refusals_through_the_server(ollama_client: Any, server: ServerProcess
                                            ) -> None:
    with pytest.raises(ollama.ResponseError) as raw:
        ollama_client.generate(model="tiny", prompt="x", raw=True, images=[PNG])
    assert raw.value.status_code == 400 and "raw prompt" in raw.value.error
    with pytest.raises(ollama.ResponseError) as many:
        ollama_client.chat(model="tiny", messages=[
            {"role": "user", "content": "x", "images": [PNG] * (MAX_IMAGES + 1)}])
    assert many.value.status_code == 400 and "more than the limit of 2" in many.value.error
    with pytest.raises(ollama.ResponseError) as generated:
        ollama_client.generate(model="tiny", prompt="x", images=[PNG] * (MAX_IMAGES + 1))
    assert generated.value.status_code == 400 and "--max-images" in generated.value.error
    shapeless = httpx.post(f"{server.base_url}/api/chat", timeout=30, json={
        "model": "tiny", "messages": [{"role": "user", "content": "x", "images": [5]}]})
    assert shapeless.status_code == 400 and set(shapeless.json()) == {"error"}
    assert "base64 string" in shapeless.json()["error"]


PROJECTOR = "takes no images: start butter with --mmproj"


def test_each_api_refuses_an_image_for_a_model_without_a_projector(
        server: ServerProcess, openai_client: openai.OpenAI,
        anthropic_client: anthropic.Anthropic, ollama_client: Any) -> None:
    """Good images and bad ones alike: the model sees none, so none is decoded."""
    for url in (DATA_URL, "data:image/png;base64,not-base64",
                f"data:image/svg+xml;base64,{SVG}"):
        body = openai_refusal(openai_client, [{"type": "text", "text": "What is it?"},
                                              openai_image(url)])
        assert PROJECTOR in body["message"]
        assert body["param"] == "messages[0].content[1].image_url.url"
    error = anthropic_refusal(anthropic_client, [
        {"type": "tool_result", "tool_use_id": "t1", "content": [IMAGE_BLOCK]}])
    assert PROJECTOR in error["message"]
    with pytest.raises(ollama.ResponseError) as chat:
        ollama_client.chat(model="tiny", messages=[
            {"role": "user", "content": "What is it?", "images": [PNG]}])
    assert chat.value.status_code == 400 and PROJECTOR in chat.value.error
    for prompt in ("Describe it.", ""):  # (an empty prompt with images is no "load")
        with pytest.raises(ollama.ResponseError) as generated:
            ollama_client.generate(model="tiny", prompt=prompt, images=[PNG])
        assert generated.value.status_code == 400 and PROJECTOR in generated.value.error
    counted = httpx.post(f"{server.base_url}/v1/messages/count_tokens", timeout=30, json={
        "model": "tiny", "messages": [{"role": "user", "content": [IMAGE_BLOCK]}]})
    assert counted.status_code == 400 and PROJECTOR in counted.json()["error"]["message"]


def test_text_still_flows_beside_the_image_paths(openai_client: openai.OpenAI) -> None:
    answer = openai_client.chat.completions.create(model="tiny", max_tokens=2, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Hello"},
                                     {"type": "text", "text": " there"}]}])
    assert answer.choices[0].finish_reason in ("length", "stop")
