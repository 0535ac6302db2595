"""Real server processes over real sockets: disconnects, FIFO queueing, overload, health."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.conftest import ServerProcess

SETTLE_TIMEOUT_S = 30


@pytest.fixture(scope="module")
def single_slot_server(tiny_gguf: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(["--model", str(tiny_gguf), "--alias", "tiny", "--parallel", "1",
                            "--max-queue", "3", "--max-context", "4096", "--threads", "1"])
    yield server
    server.stop()


def chat_body(content: str, max_tokens: int, stream: bool) -> bytes:
    return json.dumps({
        "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
        "stream": stream, "seed": 1,
    }).encode()


async def open_raw_request(server: ServerProcess, body: bytes) -> trio.SocketStream:
    host, port = server.base_url.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\n"
        f"Host: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    await stream.send_all(head + body)
    return stream


async def wait_until_idle(server: ServerProcess) -> dict[str, int]:
    async with httpx.AsyncClient() as client:
        with trio.fail_after(SETTLE_TIMEOUT_S):
            while True:
                stats = (await client.get(f"{server.api}/server")).json()["engine"]
                if stats["active"] == 0 and stats["queued"] == 0:
                    assert stats["reserved_cells"] == 0
                    return stats  # type: ignore[no-any-return]
                await trio.sleep(0.05)


async def wait_for_engine(server: ServerProcess, *, active: int, queued: int = 0) -> None:
    """Until /v1/server shows this many requests running and waiting (the engine's own
    count: what a sleep could only hope for)."""
    async with httpx.AsyncClient() as client:
        with trio.fail_after(SETTLE_TIMEOUT_S):
            while True:
                stats = (await client.get(f"{server.api}/server")).json()["engine"]
                if (stats["active"], stats["queued"]) == (active, queued):
                    return
                await trio.sleep(0.01)


async def session_cells(server: ServerProcess) -> list[int]:
    async with httpx.AsyncClient() as client:
        stats = (await client.get(f"{server.api}/server")).json()["engine"]
    return list(stats["session_cells"])


def grown(before: list[int], after: dict[str, Any]) -> list[int]:
    """The cached positions of the sequences that changed since `before` (the server keeps
    earlier tests' prompts cached in the others)."""
    return [now for was, now in zip(before, after["session_cells"], strict=True) if now != was]


async def test_killing_a_streaming_client_mid_decode_frees_its_session(
    tiny_server: ServerProcess,
) -> None:
    before = await session_cells(tiny_server)
    stream = await open_raw_request(tiny_server, chat_body("tell me everything", 1900, True))
    data = b""
    while not re.search(rb'"content":"[^"]', data):  # a token (the first delta is empty)
        chunk = await stream.receive_some(65536)
        assert chunk, data
        data += chunk
    assert data.startswith(b"HTTP/1.1 200")
    await stream.aclose()  # the client vanishes mid-decode
    stats = await wait_until_idle(tiny_server)
    # It was stopped early: far fewer than prompt + 1900 positions were evaluated.
    changed = grown(before, stats)
    assert changed and max(changed) < 1900
    async with httpx.AsyncClient(timeout=60) as client:
        response = await client.post(f"{tiny_server.api}/chat/completions",
                                     content=chat_body("still there?", 8, False))
    assert response.status_code == 200


async def test_killing_a_non_stream_client_mid_prefill_frees_its_session(
    demo_server: ServerProcess,
) -> None:
    long_prompt = "Describe the ocean in detail. " * 300  # ~2000 tokens: seconds of prefill
    before = await session_cells(demo_server)
    stream = await open_raw_request(demo_server, chat_body(long_prompt, 16, False))
    await wait_for_engine(demo_server, active=1)  # admitted: its prefill takes seconds
    await stream.aclose()
    stats = await wait_until_idle(demo_server)
    changed = grown(before, stats)
    assert all(cells < 1900 for cells in changed)  # the remaining prefill chunks never ran


async def test_queued_clients_proceed_in_fifo_order(single_slot_server: ServerProcess) -> None:
    first_content: dict[str, float] = {}

    async def streamed(name: str, max_tokens: int) -> None:
        async with httpx.AsyncClient(timeout=120) as client, client.stream(
            "POST", f"{single_slot_server.api}/chat/completions",
            content=chat_body(f"request {name}", max_tokens, True),
        ) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    first_content.setdefault(name, time.monotonic())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(streamed, "holder", 1500)
        await wait_for_engine(single_slot_server, active=1)
        nursery.start_soon(streamed, "A", 300)
        await wait_for_engine(single_slot_server, active=1, queued=1)
        impatient = await open_raw_request(single_slot_server, chat_body("impatient", 8, True))
        await wait_for_engine(single_slot_server, active=1, queued=2)
        nursery.start_soon(streamed, "B", 300)
        await wait_for_engine(single_slot_server, active=1, queued=3)
        await impatient.aclose()  # it leaves the queue between A and B
    assert first_content["holder"] < first_content["A"] < first_content["B"]
    await wait_until_idle(single_slot_server)


async def fill_the_queue(server: ServerProcess) -> list[trio.SocketStream]:
    """One request holds the only slot; three more fill --max-queue 3."""
    streams = [await open_raw_request(server, chat_body("hold", 3000, True))]
    await wait_for_engine(server, active=1)
    for _ in range(3):
        streams.append(await open_raw_request(server, chat_body("wait", 4, False)))
    await wait_for_engine(server, active=1, queued=3)
    return streams


async def test_full_queue_answers_503_with_retry_after(
    single_slot_server: ServerProcess,
) -> None:
    streams = await fill_the_queue(single_slot_server)
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(f"{single_slot_server.api}/chat/completions",
                                     content=chat_body("one too many", 4, False))
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "queue_full"
        # Health and models never wait behind generation.
        with trio.fail_after(2):
            assert (await client.get(f"{single_slot_server.base_url}/health")).text == "ok"
            assert (await client.get(f"{single_slot_server.api}/models")).status_code == 200
    for stream in streams:
        await stream.aclose()
    await wait_until_idle(single_slot_server)


async def test_full_queue_on_messages_is_529_overloaded(
    single_slot_server: ServerProcess,
) -> None:
    streams = await fill_the_queue(single_slot_server)
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(f"{single_slot_server.base_url}/v1/messages", json={
            "max_tokens": 4, "messages": [{"role": "user", "content": "one too many"}]})
    assert response.status_code == 529
    assert response.json()["error"]["type"] == "overloaded_error"
    assert response.headers["retry-after"] == "1"
    for stream in streams:
        await stream.aclose()
    await wait_until_idle(single_slot_server)
