"""Clients that stop reading, too many connections, and what they leave behind (issue 21).

The write deadline is checked twice: on GuardedStream itself over loopback sockets (exact
and quick), and on real servers with raw sockets that never read, read slowly, or just sit
there. Afterwards the server holds no more file descriptors than before and no work.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import trio

from butter.server import connections
from butter.server.connections import GuardedStream
from butter.testing.tiny_gguf import ENDOFTEXT, IM_END, special_token_ids
from tests.conftest import ServerProcess

WRITE_TIMEOUT = 2.0
ON_LINUX = sys.platform.startswith("linux")
needs_proc = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(),
                                reason="counts descriptors in /proc/<pid>/fd")


def peer_closed(sock: socket.socket | trio.socket.SocketType) -> bool:
    """A reset or FIN from the other side, seen without reading what is buffered."""
    poller = select.poll()
    rdhup = getattr(select, "POLLRDHUP", 0)  # Linux: a FIN behind unread data
    poller.register(sock.fileno(), rdhup | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(0))


# --- GuardedStream on its own -------------------------------------------------------------


async def stream_pair(
    client_rcvbuf: int = 4096, server_sndbuf: int = 16384,
) -> tuple[trio.SocketStream, trio.socket.SocketType]:
    """(server side, client socket); small buffers so writes block soon."""
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    client = trio.socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, client_rcvbuf)
    async with listener:
        await client.connect(listener.socket.getsockname())
        server = await listener.accept()
    server.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, server_sndbuf)
    return server, client


async def test_a_write_gives_up_on_a_client_that_reads_nothing() -> None:
    server, client = await stream_pair()
    abandoned: list[bool] = []
    guarded = GuardedStream(server, 0.5, lambda: abandoned.append(True))
    with client, trio.fail_after(10):  # the deadline, plus time to fill the buffers
        with pytest.raises(trio.BrokenResourceError):
            await guarded.send_all(b"x" * (8 << 20))
        assert abandoned == [True]
        assert server.socket.fileno() == -1  # closed: hypercorn's reader wakes up
        while not peer_closed(client):  # a reset, though nothing was read  # noqa: ASYNC110
            await trio.sleep(0.01)


async def test_a_slow_steady_reader_is_never_cut() -> None:
    """Reads of 4 KiB every 0.2 s, for several times the 1 s deadline: never cut, even
    while the socket stays unwritable (Linux wakes writers once a third of the buffer is
    free; the send queue shows the progress sooner)."""
    server, client = await stream_pair()
    payload = os.urandom(128 * 1024)
    abandoned: list[bool] = []
    guarded = GuardedStream(server, 1.0, lambda: abandoned.append(True))
    received = bytearray()

    async def read_slowly() -> None:
        while len(received) < len(payload):
            await trio.sleep(0.2)  # the workload (a slow reader), not synchronisation
            received.extend(await client.recv(4096))

    start = time.monotonic()
    with client, trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_slowly)
            await guarded.send_all(payload)
    assert bytes(received) == payload and not abandoned
    assert time.monotonic() - start > 3  # it did take several deadlines' time
    await guarded.aclose()


async def test_no_write_timeout_writes_as_the_socket_stream_does() -> None:
    server, client = await stream_pair()
    guarded = GuardedStream(server, 0, lambda: None)
    with client:
        await guarded.send_all(b"hello")
        assert await client.recv(5) == b"hello"
        await guarded.send_eof()
        assert await client.recv(5) == b""
    await guarded.aclose()


# --- on a real server ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def guarded_server(tiny_gguf: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(["--model", str(tiny_gguf), "--alias", "tiny", "--parallel", "3",
                            "--max-context", "4096", "--stream-flush-ms", "0",
                            "--write-timeout", str(WRITE_TIMEOUT)])
    yield server
    server.stop()


def address(server: ServerProcess) -> tuple[str, int]:
    host, port = server.base_url.removeprefix("http://").split(":")
    return host, int(port)


def open_fds(server: ServerProcess) -> int:
    return len(os.listdir(f"/proc/{server.process.pid}/fd"))


def fd_links(server: ServerProcess) -> list[str]:
    folder = Path(f"/proc/{server.process.pid}/fd")
    return sorted(os.readlink(folder / name) for name in os.listdir(folder))


def client_ports(server: ServerProcess) -> list[int]:
    """The peer ports of the TCP connections the server holds a descriptor for (its TCP
    sockets other than the listener): a connection is here from its accept until the server
    closes it."""
    folder = Path(f"/proc/{server.process.pid}/fd")
    inodes = set()
    for name in os.listdir(folder):
        with contextlib.suppress(OSError):  # closed meanwhile
            link = os.readlink(folder / name)
            if link.startswith("socket:["):
                inodes.add(link.removeprefix("socket:[").removesuffix("]"))
    ports = []
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{server.process.pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            # sl local_address rem_address st ... inode (the tenth field); st 0A: LISTEN
            fields = line.split()
            if fields[9] in inodes and fields[3] != "0A":
                ports.append(int(fields[2].rsplit(":", 1)[1], 16))
    return ports


def wait_for_client_ports(server: ServerProcess, done: Callable[[list[int]], bool],
                          what: str) -> None:
    """Poll the server's connections (bounded) until `done` holds for their peer ports."""
    deadline = time.monotonic() + 30
    while not done(ports := client_ports(server)):
        assert time.monotonic() < deadline, f"{what}: the server holds {ports}"
        time.sleep(0.02)


def metric(server: ServerProcess, name: str) -> float:
    text = get(server, "/metrics").text
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


def get(server: ServerProcess, path: str) -> httpx.Response:
    """A GET on a connection the server closes at once: a kept-alive one would hold a
    descriptor for the keep-alive timeout (5 s), even after this side closed it."""
    return httpx.get(f"{server.base_url}{path}", headers={"Connection": "close"}, timeout=60)


def work(server: ServerProcess) -> tuple[int, int, int]:
    stats = get(server, "/v1/server").json()["engine"]
    return stats["active"], stats["queued"], stats["reserved_cells"]


def idle_fds(server: ServerProcess) -> int:
    """The server's descriptors with no work and no client connection open."""
    assert work(server) == (0, 0, 0)
    # The server closes that request's connection (Connection: close) after answering.
    wait_for_client_ports(server, lambda ports: not ports, "no client connection left")
    return open_fds(server)


def assert_nothing_left(server: ServerProcess, baseline_fds: int | None) -> None:
    """No work in the engine and (on Linux) no more descriptors than the baseline, once
    the keep-alive timeout (5 s) has closed what clients left idle."""
    deadline = time.monotonic() + 30
    while (left := work(server)) != (0, 0, 0):
        assert time.monotonic() < deadline, f"active, queued, reserved: {left}"
        time.sleep(0.2)
    while baseline_fds is not None and open_fds(server) > baseline_fds:
        assert time.monotonic() < deadline, (baseline_fds, fd_links(server))
        time.sleep(0.2)


def streaming_request(max_tokens: int, content: str = "go on", top_logprobs: int = 0) -> bytes:
    # The tiny random model may end at any step: its end tokens are banned, so a stream
    # is as long as asked.
    ends = {str(special_token_ids()[text]): -100 for text in (ENDOFTEXT, IM_END)}
    fields: dict[str, object] = {"messages": [{"role": "user", "content": content}],
                                 "max_tokens": max_tokens, "stream": True,
                                 "logit_bias": ends}
    if top_logprobs:  # ~1.7 KiB of SSE per token at 20, against ~0.2 KiB without
        fields |= {"logprobs": True, "top_logprobs": top_logprobs}
    body = json.dumps(fields).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
            b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
            + b"\r\n\r\n" + body)


def non_reader(server: ServerProcess, max_tokens: int, top_logprobs: int = 0) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(address(server))
    sock.sendall(streaming_request(max_tokens, top_logprobs=top_logprobs))
    return sock


def largest_send_buffer() -> int:
    """How far Linux may grow a TCP socket's send buffer (tcp_wmem's maximum; 4 MiB by
    default): a stream shorter than that can sit whole in the kernel while nobody reads."""
    return int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])


# The longest stream the guarded server runs (its --max-context, less the prompt), with
# top-20 log-probabilities: ~7 MiB of SSE.
LONG_STREAM_TOKENS, LONG_STREAM_BYTES_PER_TOKEN = 4000, 1700


@needs_proc
def test_non_reading_streamers_are_closed_and_their_requests_cancelled(
    guarded_server: ServerProcess,
) -> None:
    server = guarded_server
    baseline = idle_fds(server)
    abandoned = metric(server, "butter_abandoned_responses_total")
    cancelled = metric(server, "butter_cancellations_total")
    log_start = len(server.output)
    # Longer than the kernel can buffer, or the whole stream may be written before any
    # write blocks (loopback grows the send buffer as far as tcp_wmem allows).
    if LONG_STREAM_TOKENS * LONG_STREAM_BYTES_PER_TOKEN < 1.5 * largest_send_buffer():
        pytest.skip("this kernel may buffer the longest stream whole")
    # All three fit the KV pool (--max-context is per session).
    sockets = [non_reader(server, LONG_STREAM_TOKENS, top_logprobs=20) for _ in range(3)]
    try:
        deadline = time.monotonic() + 120  # generation until the buffers fill, then 2 s
        while not all(peer_closed(sock) for sock in sockets):
            assert time.monotonic() < deadline, "a client that reads nothing was kept"
            time.sleep(0.1)
    finally:
        for sock in sockets:
            sock.close()
    assert metric(server, "butter_abandoned_responses_total") == abandoned + 3
    assert metric(server, "butter_cancellations_total") == cancelled + 3
    # Each request is logged as cancelled. (Whether its generation had ended by then
    # depends on the machine: the engine fills its output buffer while the writes block.)
    finished = [line for line in server.output[log_start:] if "finish=" in line]
    assert len(finished) == 3 and all("cancelled=True" in line for line in finished)
    assert_nothing_left(server, baseline)


@pytest.mark.skipif(not ON_LINUX, reason="progress is read from the send queue on Linux")
def test_a_slow_reader_on_the_server_is_never_cut(guarded_server: ServerProcess) -> None:
    """2 KiB read every half second from a 4 KiB receive buffer, far slower than the
    tiny model writes, for several write timeouts in all: the stream is never cut. (How
    long the server's own writes stay blocked depends on how far the kernel grows its
    send buffer on loopback; the blocked-writer mechanism itself is tested on the stream
    above, with small buffers on both ends.)"""
    server = guarded_server
    abandoned = metric(server, "butter_abandoned_responses_total")
    log_start = len(server.output)
    sock = non_reader(server, 600)  # ~90 KiB of SSE
    received = bytearray()
    started = time.monotonic()
    with sock:
        sock.settimeout(30)
        while not received.endswith(b"\r\n0\r\n\r\n"):  # the last chunk
            time.sleep(0.5)  # the workload (a slow reader), not synchronisation
            chunk = sock.recv(2048)
            assert chunk, "closed before the end: " + received[-300:].decode(errors="replace")
            received.extend(chunk)
    assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in received
    assert metric(server, "butter_abandoned_responses_total") == abandoned
    assert time.monotonic() - started > 2 * WRITE_TIMEOUT  # the reader was slow
    finished = next(line for line in server.output[log_start:] if "finish=" in line)
    assert "cancelled=False" in finished


@needs_proc
def test_a_mix_of_hostile_clients_leaves_nothing_behind(
    guarded_server: ServerProcess,
) -> None:
    """Non-readers, half-sent headers, idle sockets and mid-stream hang-ups at once."""
    server = guarded_server
    baseline = idle_fds(server)
    request = streaming_request(400)
    sockets = [non_reader(server, 2000) for _ in range(2)]
    for _ in range(3):
        half = socket.create_connection(address(server))
        half.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n")
        idle = socket.create_connection(address(server))
        hang_up = socket.create_connection(address(server))
        hang_up.sendall(request)
        hang_up.recv(100)
        sockets += [half, idle, hang_up]
    hung_up = sockets[-1].getsockname()[1]
    sockets[-1].close()  # a hang-up mid-stream
    # The server has noticed: it let go of that connection (the others stay held).
    wait_for_client_ports(server, lambda ports: hung_up not in ports, "the hang-up is held")
    ok = httpx.post(f"{server.api}/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 4},
        headers={"Connection": "close"})
    assert ok.status_code == 200  # meanwhile, normal requests are served
    for sock in sockets:
        sock.close()
    assert_nothing_left(server, baseline)


@needs_proc
def test_connections_past_the_limit_get_503_at_once(tiny_gguf: Path) -> None:
    server = ServerProcess(["--model", str(tiny_gguf), "--max-connections", "3"])
    try:
        baseline = idle_fds(server)
        held = [socket.create_connection(address(server)) for _ in range(3)]
        ports = {sock.getsockname()[1] for sock in held}
        # Accepted: the server holds all three (its accept loop hands each to the counting
        # handler before it takes the next connection).
        wait_for_client_ports(server, lambda seen: ports <= set(seen), "not yet accepted")
        with socket.create_connection(address(server)) as extra:
            extra.settimeout(10)
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            reply = b""
            while chunk := extra.recv(4096):
                reply += chunk
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), reply[:200]
        assert b"retry-after: 1" in head.lower()
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        held.pop().close()  # hypercorn lets go of it within the keep-alive timeout (5 s)
        deadline = time.monotonic() + 15
        while get(server, "/health").status_code == 503:
            assert time.monotonic() < deadline, "a closed connection still counts"
            time.sleep(0.5)
        for sock in held:
            sock.close()
        assert metric(server, "butter_refused_connections_total") >= 1
        assert_nothing_left(server, baseline)
    finally:
        server.stop()


def test_write_timeout_and_max_connections_flags() -> None:
    from butter.cli import build_parser, settings_from_args
    from butter.settings import default_max_connections

    args = build_parser().parse_args(["serve", "--model", "m"])
    settings = settings_from_args(args)
    assert settings.write_timeout == 30.0
    assert settings.max_connections == default_max_connections() >= 1
    args = build_parser().parse_args(["serve", "--model", "m", "--write-timeout", "0",
                                      "--max-connections", "7"])
    settings = settings_from_args(args)
    assert (settings.write_timeout, settings.max_connections) == (0.0, 7)
    if ON_LINUX:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        assert default_max_connections() < soft  # room is left for the model and logs


def test_hypercorn_is_the_release_whose_internals_butter_follows() -> None:
    """serve_hypercorn follows hypercorn's own worker_serve and calls its private
    constructors: another release, or a changed worker_serve, must be reviewed first."""
    import hashlib
    import inspect
    from importlib.metadata import version

    import hypercorn.trio.run
    from hypercorn.trio.lifespan import Lifespan
    from hypercorn.trio.tcp_server import TCPServer
    from hypercorn.trio.worker_context import WorkerContext

    assert version("hypercorn") == connections.HYPERCORN_RELEASE
    source = inspect.getsource(hypercorn.trio.run.worker_serve)
    assert hashlib.sha256(source.encode()).hexdigest() == connections.WORKER_SERVE_SHA256, (
        "hypercorn's worker_serve changed: bring serve_hypercorn in line, then its digest")
    parameters = {cls: list(inspect.signature(cls.__init__).parameters)[1:]
                  for cls in (TCPServer, WorkerContext, Lifespan)}
    assert parameters == {TCPServer: ["app", "config", "context", "state", "stream"],
                          WorkerContext: ["max_requests"],
                          Lifespan: ["app", "config", "state"]}
