"""Images in, end to end (#55): a real `butter serve` on the tiny Qwen3 with the tiny
random-weight projector (`--mmproj`), driven by the official OpenAI and Anthropic SDKs and
Ollama's wire format. The projector's output is noise; token counts, the prefix cache
and the wire shapes are real."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from butter.testing.tiny_mmproj import (
    gemma3_image_tokens,
    qwen_vl_grid,
    write_tiny_gemma3_mmproj_gguf,
)
from tests.conftest import ServerProcess

Image = pytest.importorskip("PIL.Image")

MODEL = "tiny-vision"
IMAGE_TOKENS = 16  # the tiny projector's embeddings per image (butter/testing/tiny_mmproj.py)


@pytest.fixture(scope="module")
def server(tiny_gguf: Path, tiny_mmproj_gguf: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(["--model", str(tiny_gguf), "--mmproj", str(tiny_mmproj_gguf),
                             "--alias", MODEL, "--parallel", "2", "--max-context", "2048"])
    yield process
    process.stop()


def png(colour: tuple[int, int, int], size: tuple[int, int] = (24, 24)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def openai_turn(client: openai.OpenAI, messages: list[dict[str, Any]]
                ) -> tuple[str, int, int]:
    result = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                            max_tokens=4, temperature=0)
    usage = result.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return (result.choices[0].message.content or "", usage.prompt_tokens,
            usage.prompt_tokens_details.cached_tokens or 0)


def with_image(text: str, image: bytes) -> dict[str, Any]:
    return {"role": "user", "content": [
        {"type": "text", "text": text},
        {"type": "image_url", "image_url": {"url": data_url(image)}}]}


def test_openai_images_are_counted_cached_and_told_apart(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.api, api_key="unused")
    _, text_prompt, _ = openai_turn(client, [
        {"role": "user", "content": "What colour is this picture? Look closely."}])
    red = png((200, 20, 20))
    first = [with_image("What colour is this picture? Look closely.", red)]
    answer, prompt, cold = openai_turn(client, first)
    assert cold <= prompt - IMAGE_TOKENS  # (the text before the image, at most)
    assert prompt == text_prompt + IMAGE_TOKENS  # (the image's positions are counted)
    # The next turn sends the same image back: served from the cache, image included.
    returning = [*first, {"role": "assistant", "content": answer},
                 {"role": "user", "content": "And its shape?"}]
    _, returning_prompt, cached = openai_turn(client, returning)
    assert cached >= prompt - 1 and returning_prompt > prompt
    # The same question about another picture of the same size: the cache stops at it.
    blue = [with_image("What colour is this picture? Look closely.", png((20, 20, 200)))]
    _, blue_prompt, blue_cached = openai_turn(client, blue)
    assert blue_prompt == prompt and blue_cached < prompt - IMAGE_TOKENS
    # The same pixels in another file are the same picture to the model.
    out = io.BytesIO()
    Image.new("RGB", (24, 24), (200, 20, 20)).save(out, format="BMP")
    _, _, bmp_cached = openai_turn(client, [
        {"role": "user", "content": [
            {"type": "text", "text": "What colour is this picture? Look closely."},
            {"type": "image_url", "image_url": {
                "url": "data:image/bmp;base64," + base64.b64encode(out.getvalue()).decode()}}]}])
    assert bmp_cached == prompt - 1


def test_streamed_answers_count_the_image(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.api, api_key="unused")
    stream = client.chat.completions.create(
        model=MODEL, messages=[with_image("Describe.", png((10, 200, 10)))],  # type: ignore[list-item]
        max_tokens=3, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens > IMAGE_TOKENS


def prompt_tokens(message: anthropic.types.Message) -> int:
    return message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)


def test_anthropic_image_blocks_and_images_in_tool_results(server: ServerProcess) -> None:
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png((5, 5, 5))).decode()}}
    plain = client.messages.create(model=MODEL, max_tokens=3, messages=[
        {"role": "user", "content": "Describe it."}])
    seen = client.messages.create(model=MODEL, max_tokens=3, messages=[
        {"role": "user", "content": [image, {"type": "text", "text": "Describe it."}]}])
    # (Anthropic's input_tokens leaves out what was read from the cache)
    assert prompt_tokens(seen) == prompt_tokens(plain) + IMAGE_TOKENS
    # Claude Code reads an image file with a tool: the image comes back in the result.
    tools = [{"name": "read_file", "description": "Read a file",
              "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]

    def read(result: Any) -> anthropic.types.Message:
        return client.messages.create(model=MODEL, max_tokens=3, tools=tools, messages=[  # type: ignore[arg-type]
            {"role": "user", "content": "Look at shot.png"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                               "name": "read_file",
                                               "input": {"path": "shot.png"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": result}]}])

    assert prompt_tokens(read([image])) == prompt_tokens(read("")) + IMAGE_TOKENS


def test_ollama_images(server: ServerProcess) -> None:
    encoded = base64.b64encode(png((90, 90, 0))).decode()
    reply = httpx.post(f"{server.base_url}/api/chat", timeout=60, json={
        "model": MODEL, "stream": False, "options": {"num_predict": 3, "temperature": 0},
        "messages": [{"role": "user", "content": "Describe.", "images": [encoded]}]})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["prompt_eval_count"] > IMAGE_TOKENS


def test_the_model_lists_its_vision(server: ServerProcess) -> None:
    shown = httpx.post(f"{server.base_url}/api/show", json={"model": MODEL}, timeout=10).json()
    assert "vision" in shown["capabilities"]


def test_a_hybrid_model_returns_to_an_image_conversation_from_a_checkpoint(
    tiny_lfm2_gguf: Path, tiny_mmproj_gguf: Path
) -> None:
    """LFM2 (short-conv layers beside attention) cannot cut its state back: a returning
    turn after an image is served from a checkpoint taken past the image (llama-server
    takes none after a media chunk, so it prefills the whole conversation again)."""
    process = ServerProcess(["--model", str(tiny_lfm2_gguf), "--mmproj", str(tiny_mmproj_gguf),
                             "--alias", MODEL, "--parallel", "1", "--max-context", "2048",
                             "--cache-ram", "64"])
    try:
        client = openai.OpenAI(base_url=process.api, api_key="unused")
        first = [with_image("What colour is this picture? " + "Look closely. " * 20,
                            png((200, 20, 20)))]
        answer, prompt, _ = openai_turn(client, first)
        returning = [*first, {"role": "assistant", "content": answer},
                     {"role": "user", "content": "And its shape?"}]
        _, _, cached = openai_turn(client, returning)
        assert cached >= prompt - 4  # (the checkpoint 4 tokens before the end, or later)
        info = httpx.get(f"{process.api}/server", timeout=10).json()
        assert info["prefix_cache"]["checkpoints"]["restored"] >= 1
    finally:
        process.stop()


def test_a_qwen35_model_sees_images_at_m_rope_positions_and_returns_from_a_checkpoint(
    tiny_qwen35_gguf: Path, tiny_qwen_vl_mmproj_gguf: Path
) -> None:
    """Qwen3.5's kind: a hybrid whose images take M-RoPE positions (a grid of columns x
    rows embeddings at max(columns, rows) positions), with Qwen3-VL's projector. The image
    is counted; a returning turn is served from a checkpoint past it; another picture of
    the same size stops the cache before it, the same picture in another file does not."""
    process = ServerProcess(["--model", str(tiny_qwen35_gguf),
                             "--mmproj", str(tiny_qwen_vl_mmproj_gguf), "--alias", MODEL,
                             "--parallel", "1", "--max-context", "2048", "--cache-ram", "64"])
    try:
        client = openai.OpenAI(base_url=process.api, api_key="unused")
        question = "What colour is this picture? " + "Look closely. " * 20
        _, text_prompt, _ = openai_turn(client, [{"role": "user", "content": question}])
        columns, rows = qwen_vl_grid(24, 24)
        first = [with_image(question, png((200, 20, 20)))]
        answer, prompt, _ = openai_turn(client, first)
        assert prompt > text_prompt + columns * rows  # (the image, and libmtmd's text around it)
        returning = [*first, {"role": "assistant", "content": answer},
                     {"role": "user", "content": "And its shape?"}]
        _, returning_prompt, cached = openai_turn(client, returning)
        assert returning_prompt > prompt and cached >= prompt - 4
        info = httpx.get(f"{process.api}/server", timeout=10).json()
        assert info["prefix_cache"]["checkpoints"]["restored"] >= 1
        _, blue_prompt, blue_cached = openai_turn(
            client, [with_image(question, png((20, 20, 200)))])
        assert blue_prompt == prompt and blue_cached < prompt - columns * rows
        out = io.BytesIO()
        Image.new("RGB", (24, 24), (200, 20, 20)).save(out, format="BMP")
        bmp = {"role": "user", "content": [
            {"type": "text", "text": question},
            {"type": "image_url", "image_url": {
                "url": "data:image/bmp;base64," + base64.b64encode(out.getvalue()).decode()}}]}
        _, _, bmp_cached = openai_turn(client, [bmp])
        assert bmp_cached >= blue_cached + columns * rows  # (through the red image)
    finally:
        process.stop()


def test_gemma3_sees_images_whole_and_caches_them(demo_gguf: Path, tmp_path: Path) -> None:
    """The demo Gemma 3 with a Gemma 3 vision tower (random weights, 640 wide): its images'
    embeddings see each other, so each is evaluated whole, in a chunk of its own even past
    --prefill-chunk. Counted, served from the cache on the returning turn, told apart."""
    projector = write_tiny_gemma3_mmproj_gguf(tmp_path / "gemma3-mmproj.gguf", n_embd_text=640)
    process = ServerProcess(["--model", str(demo_gguf), "--mmproj", str(projector),
                             "--alias", MODEL, "--parallel", "1", "--max-context", "1024",
                             "--prefill-chunk", "12"])
    try:
        client = openai.OpenAI(base_url=process.api, api_key="unused")
        question = "What colour is this picture? Look closely."
        _, text_prompt, _ = openai_turn(client, [{"role": "user", "content": question}])
        first = [with_image(question, png((200, 20, 20)))]
        answer, prompt, _ = openai_turn(client, first)
        # (the image's embeddings, and libmtmd's <start_of_image> and <end_of_image>)
        assert prompt == text_prompt + gemma3_image_tokens() + 2
        returning = [*first, {"role": "assistant", "content": answer},
                     {"role": "user", "content": "And its shape?"}]
        _, _, cached = openai_turn(client, returning)
        assert cached >= prompt - 1
        _, blue_prompt, blue_cached = openai_turn(
            client, [with_image(question, png((20, 20, 200)))])
        assert blue_prompt == prompt and blue_cached < prompt - gemma3_image_tokens()
    finally:
        process.stop()
