"""Embed butter in a trio application: generate in-process, then serve the same model.

    python examples/embed_in_trio.py [MODEL]     # MODEL: a .gguf path or gemma-3-270m

The server and the in-process calls share one engine, so they batch together.
"""

from __future__ import annotations

import sys

import httpx
import trio

import butter


async def main(model_id: str) -> None:
    model = await butter.Model.load(model_id)
    text = await model.generate("Write a haiku", max_tokens=32, temperature=0.7, seed=1)
    print("generate:", repr(text))

    print("stream:", end=" ")
    async for piece in model.generate_stream([{"role": "user", "content": "Hi"}],
                                             max_tokens=32):
        print(piece.text, end="")
        if piece.usage is not None:
            print(f"\n  finish={piece.finish_reason} usage={piece.usage}")

    holder = butter.FixedHolder(model=model, model_id="my-model", maximum_concurrent_requests=8)
    server = butter.ServeServer(host="127.0.0.1", port=0, holder=holder)
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(server.serve)  # port 0: the OS picks a free one
        async with httpx.AsyncClient(base_url=f"http://{host}:{port}", timeout=60) as client:
            response = await client.post("/v1/chat/completions", json={
                "model": "my-model", "max_tokens": 16,
                "messages": [{"role": "user", "content": "Hello over HTTP"}]})
            print("http:", response.json()["choices"][0]["message"]["content"][:60])
        nursery.cancel_scope.cancel()  # stopping the nursery stops the server
    await model.aclose()


if __name__ == "__main__":
    trio.run(main, sys.argv[1] if len(sys.argv) > 1 else "gemma-3-270m")
