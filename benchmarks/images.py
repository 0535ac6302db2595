#!/usr/bin/env python3
"""An image turn and a returning image turn, butter vs llama-server, with the same projector.

No real projector is on PyPI, so both servers load the demo model (Gemma 3 270M) with the
same random-weight projector, written by `butter/testing/tiny_mmproj.py` as wide as the
model (LLaVA-1.5's `mlp`: 16 positions an image). Its output is noise; the work, the
token counts and the caching are real. Per server, one request at a time, greedy:

1. a cold image turn (a question about a picture),
2. the returning turn (the same picture, the answer and a follow-up question),
3. the same question about another picture of the same size (the cache must stop at it).

Reported: each turn's prompt tokens, cached tokens and TTFT (median of `--repeats`
conversations, each with its own pictures). llama-server's cached count is its
`timings.cache_n` (`usage.prompt_tokens_details` where it gives one).

Usage (from the repository root)::

    python -m benchmarks.images --markdown /tmp/images.md --json /tmp/images.json
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: the repository root, not benchmarks/, on sys.path
    import _repo_root  # noqa: F401

import httpx

from benchmarks.harness import (
    DEFAULT_LLAMA_SERVER_BIN,
    ServerSpec,
    free_port,
    llama_server_argv,
    md_table,
    resolve_model,
    run_meta,
    running_server,
    wait_ready,
    write_markdown,
)

HOST = "127.0.0.1"
DEMO_WIDTH = 640  # Gemma 3 270M's n_embd: the projector's output width
QUESTION = "What is in this picture? Describe its colours and shapes. "


def model_width(path: Path) -> int:
    """The model's hidden size (the projector's output width), from its GGUF header."""
    from butter.backends.gguf_tensors import read_header

    architecture = read_header(path, keys=("general.architecture",)).metadata[
        "general.architecture"]
    key = f"{architecture}.embedding_length"
    width = read_header(path, keys=(key,)).metadata.get(key)
    return int(width) if isinstance(width, int) else DEMO_WIDTH


def picture(seed: int, size: tuple[int, int] = (64, 48)) -> str:
    from PIL import Image

    image = Image.new("RGB", size, ((37 * seed) % 256, (91 * seed) % 256, (53 * seed) % 256))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def user(text: str, image: str | None = None) -> dict[str, Any]:
    if image is None:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [{"type": "text", "text": text},
                                        {"type": "image_url", "image_url": {"url": image}}]}


def turn(base_url: str, model: str, messages: list[dict[str, Any]], max_tokens: int
         ) -> dict[str, Any]:
    """One streamed request: its answer, TTFT, prompt and cached tokens."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "timings_per_token": False}
    started = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body,
                      timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                piece = delta.get("content") or delta.get("reasoning_content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    if cached is None:
        cached = timings.get("cache_n")
    return {"answer": "".join(text), "ttft_s": None if first is None else first - started,
            "prompt_tokens": usage.get("prompt_tokens"), "cached_tokens": cached}


def conversation(base_url: str, model: str, seed: int, max_tokens: int, repeats: int
                 ) -> list[dict[str, Any]]:
    image = picture(seed)
    question = QUESTION * repeats
    first_messages = [user(question, image)]
    first = turn(base_url, model, first_messages, max_tokens)
    returning = turn(base_url, model, [
        *first_messages, {"role": "assistant", "content": first["answer"] or "A picture."},
        user("And which colour is strongest?")], max_tokens)
    other = turn(base_url, model, [user(question, picture(seed + 1000))], max_tokens)
    return [first, returning, other]


TURNS = ("image turn (cold)", "returning turn, same image", "another image, same question")


def run_server(name: str, args: argparse.Namespace, projector: Path, log_dir: Path
               ) -> list[list[dict[str, Any]]]:
    port = free_port(HOST)
    base_url = f"http://{HOST}:{port}"
    if name == "butter":
        spec = ServerSpec("butter", [
            sys.executable, "-m", "butter.cli", "serve", "--model", args.model_path,
            "--mmproj", str(projector), "--host", HOST, "--port", str(port),
            "--parallel", "1", "--threads", str(args.threads),
            "--max-context", str(args.context)], "/health")
    else:
        spec = ServerSpec("llama-server", llama_server_argv(
            args.llama_server, args.model_path, HOST, port, slots=1, threads=args.threads,
            context=args.context, extra=["--jinja", "--mmproj", str(projector)]), "/health")
    with running_server(spec, log_dir / f"{name}.log") as proc:
        wait_ready(proc, base_url, spec.ready_path, timeout=300)
        model = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]
        return [conversation(base_url, model, seed, args.max_tokens, args.question_repeats)
                for seed in range(1, args.repeats + 1)]


def summary(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for index, label in enumerate(TURNS):
        turns = [run[index] for run in runs]
        ttfts = [t["ttft_s"] for t in turns if t["ttft_s"] is not None]
        rows.append({"turn": label, "prompt_tokens": turns[0]["prompt_tokens"],
                     "cached_tokens": [t["cached_tokens"] for t in turns],
                     "ttft_p50_s": statistics.median(ttfts) if ttfts else None})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", help="the GGUF (default: the demo model)")
    parser.add_argument("--llama-server", type=Path, default=DEFAULT_LLAMA_SERVER_BIN)
    parser.add_argument("--only", choices=["butter", "llama-server"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--question-repeats", type=int, default=8,
                        help="the question's sentence this many times (a longer first turn)")
    parser.add_argument("--projector", choices=["llava", "qwen-vl", "gemma3"],
                        default="llava",
                        help="the random projector's kind: LLaVA's `mlp` (16 positions an "
                        "image), Qwen3-VL's `qwen3vl_merger` (Qwen3.5's: a grid of "
                        "embeddings, M-RoPE positions on a Qwen-VL or Qwen3.5 model), or "
                        "Gemma 3's `gemma3` (16 embeddings that see each other)")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/butter-images"))
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    args.model_path = args.model_path or resolve_model(sys.executable)
    from butter.testing.tiny_mmproj import (
        write_tiny_gemma3_mmproj_gguf,
        write_tiny_mmproj_gguf,
        write_tiny_qwen_vl_mmproj_gguf,
    )

    args.log_dir.mkdir(parents=True, exist_ok=True)
    write = {"llava": write_tiny_mmproj_gguf, "qwen-vl": write_tiny_qwen_vl_mmproj_gguf,
             "gemma3": write_tiny_gemma3_mmproj_gguf}[args.projector]
    projector = write(Path(tempfile.mkdtemp()) / f"mmproj-{args.projector}.gguf",
                      n_embd_text=model_width(Path(args.model_path)))
    names = [args.only] if args.only else ["butter", "llama-server"]
    results = {name: summary(run_server(name, args, projector, args.log_dir))
               for name in names}
    rows = [[row["turn"], name, str(row["prompt_tokens"]),
             ", ".join(str(c) for c in row["cached_tokens"]),
             "-" if row["ttft_p50_s"] is None else f"{row['ttft_p50_s']:.2f}"]
            for index in range(len(TURNS)) for name in names
            for row in [results[name][index]]]
    table = md_table(["turn", "server", "prompt tokens", "cached tokens (each run)",
                      "TTFT p50 s"], rows)
    print(table)
    meta = run_meta()
    if args.markdown:
        write_markdown(args.markdown, f"{meta}\n\n{table}\n")
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
