"""ServeServer: a ModelHolder's model over HTTP, on hypercorn's trio worker.

    server = ServeServer(host="127.0.0.1", port=0, holder=FixedHolder(model=model))
    host, port = await nursery.start(server.serve)   # or: await server.run_forever()

Cancelling the scope stops it; `request_shutdown()` stops accepting and gives active
requests `shutdown_grace` seconds; idle keep-alive connections are closed at once (see
ShieldResponseEnd). SIGINT/SIGTERM under run_forever `drain()` first: /ready turns 503,
new work gets 503, and the requests in flight finish within the grace before the
listener closes (butter/server/readiness.py).
"""

from __future__ import annotations

import logging
import signal
import warnings
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from hypercorn.config import Config

from butter.chat.images import DEFAULT_MAX_IMAGES
from butter.server.access import AccessPolicy, ApiKeys
from butter.server.app import HttpLimits, create_app
from butter.server.connections import ConnectionCollector, Connections, serve_hypercorn
from butter.server.holders import ModelHolder
from butter.server.readiness import CountInFlight, Readiness
from butter.settings import (
    DEFAULT_BODY_TIMEOUT_SECONDS,
    DEFAULT_KEEP_ALIVE_SECONDS,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_MESSAGES,
    DEFAULT_SHUTDOWN_GRACE_SECONDS,
    DEFAULT_STREAM_FLUSH_SECONDS,
    DEFAULT_WRITE_TIMEOUT_SECONDS,
    default_max_connections,
)

log = logging.getLogger("butter")

AsgiApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


class ShieldResponseEnd:
    """ASGI wrapper that shields the send of a response's last body message.

    hypercorn (0.18) restarts the connection's keep-alive timer inside that call, and
    quart-trio cancels the request's task right after it, which killed the timer: idle
    keep-alive connections then stayed open forever, and shutdown waited the whole grace
    period for them. Shielded, they close after the keep-alive timeout, and at once on
    shutdown.
    """

    def __init__(self, app: AsgiApp) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        async def send_with_shielded_end(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body"):
                with trio.CancelScope(shield=True):
                    await send(message)
            else:
                await send(message)

        await self.app(scope, receive, send_with_shielded_end)


def _holder(holder: ModelHolder | None, backend: ModelHolder | None) -> ModelHolder:
    if backend is not None:
        warnings.warn("ServeServer(backend=...) is now ServeServer(holder=...)",
                      DeprecationWarning, stacklevel=3)
        holder = holder or backend
    if holder is None:
        raise TypeError("ServeServer needs holder= (FixedHolder or SwappableHolder)")
    return holder


class ServeServer:
    def __init__(
        self, *, host: str, port: int, holder: ModelHolder | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE_SECONDS,
        stream_flush: float = DEFAULT_STREAM_FLUSH_SECONDS,
        max_messages: int = DEFAULT_MAX_MESSAGES, max_images: int = DEFAULT_MAX_IMAGES,
        api_key: str | None = None,
        body_timeout: float = DEFAULT_BODY_TIMEOUT_SECONDS,
        write_timeout: float = DEFAULT_WRITE_TIMEOUT_SECONDS,
        max_connections: int | None = None, api_keys: ApiKeys | None = None,
        allowed_hosts: tuple[str, ...] = (), cors_origins: tuple[str, ...] = (),
        ui: bool = True, backend: ModelHolder | None = None,
    ) -> None:
        """`holder`: what serves the model (FixedHolder or SwappableHolder; `backend` is its
        deprecated name). `api_key` or `api_keys` (several, reloadable): the keys requests
        must carry.
        `allowed_hosts`, `cors_origins`: beyond the loopback names and origins that are
        always allowed (butter/server/access.py). `ui`: the chat page at / for browsers."""
        holder = _holder(holder, backend)
        if api_keys is None:
            api_keys = ApiKeys([api_key] if api_key else [])
        self.api_keys = api_keys
        self.access = AccessPolicy(bound_host=host, allowed_hosts=allowed_hosts,
                                   cors_origins=cors_origins)
        self.limits = HttpLimits(max_body_bytes=max_body_bytes, max_messages=max_messages,
                                 max_images=max_images,
                                 stream_flush=stream_flush, api_keys=api_keys,
                                 access=self.access, body_timeout=body_timeout, ui=ui)
        self.host = host
        self.port = port
        self.holder = holder
        self.shutdown_grace = shutdown_grace
        self.shutdown_requested = trio.Event()  # hypercorn stops accepting
        self.shutdown_started = trio.Event()  # a drain or a shutdown began
        self.readiness = Readiness(holder)
        self._http_config: Config | None = None
        self.connections = Connections(
            max_connections=max_connections or default_max_connections(),
            write_timeout=write_timeout)
        self.app = create_app(self.holder, self.limits,
                              collectors=[ConnectionCollector(self.connections)],
                              readiness=self.readiness)

    @property
    def backend(self) -> ModelHolder:
        """Deprecated: `holder`."""
        warnings.warn("ServeServer.backend is now ServeServer.holder", DeprecationWarning,
                      stacklevel=2)
        return self.holder

    def routes(self) -> list[str]:
        """"METHOD /path" of every route the app serves, read from the app itself."""
        rules = [rule for rule in self.app.url_map.iter_rules() if rule.endpoint != "static"]
        paths = {rule.rule for rule in rules}
        lines = []
        for rule in sorted(rules, key=lambda rule: rule.rule):
            if "/v1" + rule.rule in paths:
                continue  # the same route without /v1: said once, in the README
            methods = sorted((rule.methods or set()) - {"HEAD", "OPTIONS"})
            lines.append(f"{'/'.join(methods):<5} {rule.rule}")
        return lines

    def _config(self) -> Config:
        config = Config()
        config.bind = [f"[{self.host}]:{self.port}" if ":" in self.host else
                       f"{self.host}:{self.port}"]
        config.graceful_timeout = self.shutdown_grace
        config.keep_alive_timeout = DEFAULT_KEEP_ALIVE_SECONDS
        config.h11_max_incomplete_size = DEFAULT_MAX_HEADER_BYTES
        config.accesslog = None
        config.errorlog = log
        return config

    def request_shutdown(self) -> None:
        """Stop accepting; active requests get `shutdown_grace` seconds to finish."""
        self.shutdown_started.set()
        self.shutdown_requested.set()

    async def drain(self) -> None:
        """Stop being ready, answer new work 503 (routers retry it on another replica), let
        the requests in flight finish, all within `shutdown_grace`; then stop accepting.

        The listener stays open while requests are in flight: a router that has not seen
        /ready turn 503 yet gets a 503 it retries, not a refused or reset connection."""
        self.shutdown_started.set()
        self.readiness.start_draining()
        deadline = trio.current_time() + self.shutdown_grace
        with trio.move_on_at(deadline):
            await self.readiness.wait_idle()
        if self._http_config is not None:  # the grace is spent: cut what still runs
            self._http_config.graceful_timeout = max(0.0, deadline - trio.current_time())
        self.shutdown_requested.set()

    async def serve(
        self, *, task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Run until shutdown is requested or the caller's scope is cancelled.

        Works with `nursery.start`: reports the bound (host, port); port 0 picks one.
        """
        app = ShieldResponseEnd(CountInFlight(self.app, self.readiness))  # type: ignore[arg-type]
        await self.holder.start()  # the model is loaded before any traffic
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(self._serve_http, app)
            host, _, port = binds[0].removeprefix("http://").rpartition(":")
            task_status.started((host.strip("[]"), int(port)))

    async def _serve_http(
        self, app: ShieldResponseEnd, *,
        task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        self._http_config = self._config()  # drain() shortens its grace to what is left
        await serve_hypercorn(
            app,  # type: ignore[arg-type]
            self._http_config, self.connections, shutdown_trigger=self.shutdown_requested.wait,
            task_status=task_status,
        )

    async def run_forever(self) -> None:
        """Serve until SIGINT/SIGTERM, then shut down gracefully."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.shutdown_on_signals)
            nursery.start_soon(self.reload_keys_on_sighup)
            await self.serve()
            nursery.cancel_scope.cancel()

    async def reload_keys_on_sighup(self) -> None:
        """With an --api-key-file: read it again on each SIGHUP (add or revoke keys without
        a restart). Without one SIGHUP keeps its default meaning."""
        if self.api_keys.key_file is None or not hasattr(signal, "SIGHUP"):
            return
        with trio.open_signal_receiver(signal.SIGHUP) as signals:
            async for _ in signals:
                self.api_keys.reload()

    async def shutdown_on_signals(self) -> None:
        """The first SIGINT/SIGTERM drains; the default handlers are back meanwhile, so a
        second one ends the process at once."""
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                log.info("received %s: draining (in flight: %d), then shutting down",
                         signal.Signals(signum).name, self.readiness.state().in_flight)
                break
        await self.drain()
