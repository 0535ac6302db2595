"""Connections: at most `--max-connections`, and a write deadline for clients that stop
reading.

hypercorn (0.18) writes every response chunk with `stream.send_all` inside a shielded
cancel scope and has no write timeout, so a client that stops reading keeps its socket, its
task and the unsent output for as long as it likes (and a client that repeats it grows the
server's file descriptors until `accept` fails for everyone). hypercorn also has no hook
for the streams it serves or for how many, so butter accepts the sockets itself and hands
each one, wrapped, to hypercorn's per-connection protocol (`TCPServer`):

- `GuardedStream.send_all` gives up on a client that has taken no bytes for
  `write_timeout` seconds: it closes the socket and raises BrokenResourceError, which
  hypercorn treats as the client going away (the request is cancelled and releases its
  session; the connection ends). Progress, not total time, is what counts, so a slow
  reader and a long stream are never cut.
- `Connections.handle` answers 503 at once past `max_connections`, and closes every socket
  in `finally`, whatever hypercorn did.
- `serve_hypercorn` is hypercorn's `worker_serve` for plain HTTP with that handler: the one
  place that depends on hypercorn's internals (tests/test_connections.py covers it).
"""

from __future__ import annotations

import errno
import json
import logging
import struct
import sys
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from socket import SO_LINGER, SOL_SOCKET

import trio
from hypercorn.config import Config
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState, Framework, LifespanState
from hypercorn.utils import ShutdownError, raise_shutdown, repr_socket_addr, wrap_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from butter.errors import Overloaded
from butter.settings import RETRY_AFTER_SECONDS

# The hypercorn release whose internals serve_hypercorn uses (pinned in pyproject.toml), and
# the SHA-256 of that release's `hypercorn.trio.run.worker_serve` source, which it follows:
# tests/test_connections.py fails when either changes, so an upgrade is a reviewed one.
HYPERCORN_RELEASE = "0.18.0"
WORKER_SERVE_SHA256 = "8dc8347a9fc357ca334f8c3e4bcf0368176510a96d434f21a5eb4c9ec4103726"

log = logging.getLogger("butter")

# A refused connection's request is read and dropped for at most this long before the
# close: closing with unread input sends a reset, which can destroy the 503 before the
# client reads it. At most MAX_LINGERING refusals linger at once (each holds a descriptor;
# settings.FD_RESERVE leaves room for them); past that they are closed at once.
REFUSAL_LINGER_SECONDS = 1.0
REFUSAL_DRAIN_BYTES = 64 * 1024
MAX_LINGERING = 32
# A blocked write looks at the socket's send queue at least this often, to see whether
# the client took bytes although the socket did not become writable yet.
MAX_PROGRESS_POLL_SECONDS = 1.0
_CLOSED_ERRNOS = {errno.EBADF, errno.ENOTSOCK}
if sys.platform.startswith("linux"):
    import fcntl
    import termios

    SIOCOUTQ: int | None = termios.TIOCOUTQ  # the same ioctl number for sockets
else:
    SIOCOUTQ = None

ServeStream = Callable[[trio.abc.HalfCloseableStream], Awaitable[None]]


def _refusal() -> bytes:
    error = Overloaded("too many open connections: try again shortly",
                       retry_after=RETRY_AFTER_SECONDS)
    error.code = "too_many_connections"
    body = json.dumps(error.openai_body()).encode()
    head = ("HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nretry-after: {RETRY_AFTER_SECONDS}\r\n"
            "connection: close\r\n\r\n")
    return head.encode() + body


REFUSAL = _refusal()


def queued_bytes(sock: trio.socket.SocketType) -> int | None:
    """Bytes the kernel still holds for the peer (unsent or unacknowledged). Once the
    client's receive window is full they shrink only as the client reads, even while the
    socket is not yet writable again (Linux wakes a writer only when a third of the send
    buffer is free). None where the platform cannot tell (only Linux is asked)."""
    if SIOCOUTQ is None:
        return None
    try:
        raw = fcntl.ioctl(sock.fileno(), SIOCOUTQ, b"\0\0\0\0")
    except (OSError, ValueError):  # closed meanwhile (fileno -1)
        return None
    return int(struct.unpack("i", raw)[0])


class GuardedStream(trio.abc.HalfCloseableStream):
    """A socket stream whose writes give up once the client has read nothing for
    `write_timeout` seconds (0: never). hypercorn shields its writes from cancellation,
    so the deadline has to live below it, here."""

    def __init__(self, stream: trio.SocketStream, write_timeout: float,
                 on_abandon: Callable[[], None]) -> None:
        self._stream = stream
        self.socket = stream.socket  # hypercorn reads the peer's and our address from it
        self._write_timeout = write_timeout
        self._on_abandon = on_abandon

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._write_timeout <= 0 or not data:
            await self._stream.send_all(data)
            return
        if self.socket.did_shutdown_SHUT_WR:
            raise trio.ClosedResourceError("can't send data after sending EOF")
        with memoryview(data) as view:
            sent = 0
            while sent < len(view):
                with view[sent:] as rest:
                    sent += await self._send_some(rest)

    async def _send_some(self, data: memoryview) -> int:
        """One partial send: waits while the client keeps taking bytes, abandons the
        connection once it has taken none for the write timeout."""
        poll = min(MAX_PROGRESS_POLL_SECONDS, self._write_timeout / 4)
        deadline = trio.current_time() + self._write_timeout
        queued = queued_bytes(self.socket)
        while True:
            with trio.move_on_at(min(deadline, trio.current_time() + poll)):
                return await self._send(data)
            now_queued = queued_bytes(self.socket)
            if queued is not None and now_queued is not None and now_queued < queued:
                deadline = trio.current_time() + self._write_timeout  # the client read
            queued = now_queued
            if trio.current_time() >= deadline:
                self._abandon()
                raise trio.BrokenResourceError(
                    f"the client read nothing for {self._write_timeout:g}s")

    async def _send(self, data: memoryview) -> int:
        try:
            return await self.socket.send(data)
        except OSError as exc:
            if exc.errno in _CLOSED_ERRNOS:
                raise trio.ClosedResourceError("the socket was closed") from exc
            raise trio.BrokenResourceError(exc) from exc

    def _abandon(self) -> None:
        self._on_abandon()
        try:  # close with a reset: a plain close would leave the kernel holding the unsent
            # output for a client that does not read it (FIN waits behind the data)
            self.socket.setsockopt(SOL_SOCKET, SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass  # already gone
        # Closing also wakes hypercorn's reader with ClosedResourceError: the connection ends.
        self.socket.close()

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        return await self._stream.receive_some(max_bytes)

    async def send_eof(self) -> None:
        await self._stream.send_eof()

    async def aclose(self) -> None:
        await self._stream.aclose()


class Connections:
    """Counts the open connections, refuses those past the limit, and guards the rest."""

    def __init__(self, *, max_connections: int, write_timeout: float) -> None:
        self.max_connections = max_connections
        self.write_timeout = write_timeout
        self.open = 0
        self.refused = 0
        self.abandoned = 0
        self._lingering = 0

    async def handle(self, stream: trio.SocketStream, serve: ServeStream) -> None:
        try:
            if self.open >= self.max_connections:
                await self._refuse(stream)
                return
            self.open += 1
            try:
                await serve(GuardedStream(stream, self.write_timeout, self._abandoned))
            finally:
                self.open -= 1
        finally:
            # hypercorn closes in its own `finally` too, but after an await that a
            # cancellation (shutdown) interrupts; this close cannot be skipped.
            stream.socket.close()

    def _abandoned(self) -> None:
        self.abandoned += 1
        log.info("closed a connection whose client read nothing for %gs (--write-timeout)",
                 self.write_timeout)

    async def _refuse(self, stream: trio.SocketStream) -> None:
        self.refused += 1
        linger = self._lingering < MAX_LINGERING
        self._lingering += 1
        try:
            with trio.move_on_after(REFUSAL_LINGER_SECONDS if linger else 0.05):
                await stream.send_all(REFUSAL)  # a new socket's buffer takes it at once
                await stream.send_eof()
                drained = 0
                while linger and drained < REFUSAL_DRAIN_BYTES:
                    chunk = await stream.receive_some(REFUSAL_DRAIN_BYTES)
                    if not chunk:
                        break
                    drained += len(chunk)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client is gone already: nothing to tell it
        finally:
            self._lingering -= 1


class ConnectionCollector(Collector):
    """The connection counters for /metrics."""

    def __init__(self, connections: Connections) -> None:
        self._connections = connections

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        connections = self._connections
        yield GaugeMetricFamily("butter_open_connections", "HTTP connections open now",
                                value=connections.open)
        yield CounterMetricFamily("butter_refused_connections",
                                  "Connections answered 503 past --max-connections",
                                  value=connections.refused)
        yield CounterMetricFamily("butter_abandoned_responses",
                                  "Responses abandoned because the client read nothing for "
                                  "--write-timeout seconds", value=connections.abandoned)


async def serve_hypercorn(
    app: Framework, config: Config, connections: Connections, *,
    shutdown_trigger: Callable[[], Awaitable[None]],
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """`hypercorn.trio.serve` (0.18, `trio/run.py: worker_serve`) for plain HTTP, with each
    accepted socket handed to `connections`: same lifespan, same graceful shutdown (stop
    accepting when `shutdown_trigger` returns, then `config.graceful_timeout` for the open
    connections), same binds reported to `task_status`."""
    wrapped = wrap_app(app, config.wsgi_max_body_size, "asgi")
    lifespan_state: LifespanState = {}
    lifespan = Lifespan(wrapped, config, lifespan_state)
    context = WorkerContext(None)
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        state = ConnectionState(lifespan_state.copy())

        async def serve_stream(stream: trio.abc.HalfCloseableStream) -> None:
            await TCPServer(wrapped, config, context, state, stream)  # type: ignore[arg-type]

        async with trio.open_nursery() as server_nursery:
            listeners = await _listeners(config)
            task_status.started([f"http://{_bind(listener)}" for listener in listeners])
            try:
                async with trio.open_nursery(strict_exception_groups=True) as nursery:
                    nursery.start_soon(raise_shutdown, shutdown_trigger)
                    nursery.start_soon(partial(
                        trio.serve_listeners, partial(connections.handle, serve=serve_stream),
                        listeners, handler_nursery=server_nursery,
                    ))
                    await trio.sleep_forever()
            except BaseExceptionGroup as error:
                _, other_errors = error.split((ShutdownError, KeyboardInterrupt))
                if other_errors is not None:
                    raise other_errors from None
            finally:
                await context.terminated.set()  # idle keep-alive connections close now
                server_nursery.cancel_scope.deadline = (trio.current_time()
                                                        + config.graceful_timeout)
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()


async def _listeners(config: Config) -> list[trio.SocketListener]:
    if config.ssl_enabled:
        raise ValueError("butter serves plain HTTP only")
    listeners = []
    for sock in config.create_sockets().insecure_sockets:
        sock.listen(config.backlog)
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
        listeners.append(listener)
        await config.log.info(f"Running on http://{_bind(listener)} (CTRL + C to quit)")
    return listeners


def _bind(listener: trio.SocketListener) -> str:
    sock = listener.socket
    return str(repr_socket_addr(sock.family, sock.getsockname()))
