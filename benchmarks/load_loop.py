"""A light load loop: N concurrent streaming requests per wave over one pooled client.

Unlike compare.py it parses only the usage chunk, so the client itself takes little CPU
from the server on a 2-core machine. Usage:

    python benchmarks/load_loop.py http://127.0.0.1:8000 8 4   # base URL, concurrency, waves
"""

from __future__ import annotations

import json
import sys
import time

import httpx
import trio

MAX_TOKENS = 64


async def one_request(client: httpx.AsyncClient, url: str, lane: int, wave: int,
                      tokens: list[int]) -> None:
    body = {
        "messages": [{"role": "user", "content": f"Write a story. lane {lane} wave {wave}"}],
        "max_tokens": MAX_TOKENS, "temperature": 0.7, "top_p": 0.9, "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if '"usage"' in line and '"choices":[]' in line:
                tokens.append(json.loads(line.removeprefix("data: "))["usage"][
                    "completion_tokens"])


async def main(url: str, concurrency: int, waves: int) -> None:
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        tokens: list[int] = []
        start = time.perf_counter()
        for wave in range(waves):
            async with trio.open_nursery() as nursery:
                for lane in range(concurrency):
                    nursery.start_soon(one_request, client, url, lane, wave, tokens)
        elapsed = time.perf_counter() - start
    print(f"c={concurrency}: {sum(tokens) / elapsed:.1f} tok/s over {waves} waves")


if __name__ == "__main__":
    trio.run(main, sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
