"""The one thread a backend evaluates on, and who may use its model while it closes.

Both backends run every evaluation on one thread they own, the model's load included:
llama.cpp's OpenMP builds keep a team of threads per calling thread (docs/design/threads.md,
"One llama.cpp thread"), and mlx ties unevaluated arrays to the thread that built them.
Meanwhile requests are prepared (tokenized, their grammar compiled) on other threads, side
by side, and a model swap may close the backend from yet another: closing waits for those
users, then frees the model on the backend's thread after the step in flight.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from butter.backends.base import BackendError

UNLOADED = "the model was unloaded"

P = ParamSpec("P")
T = TypeVar("T")


class BackendWorker:
    """A backend's own thread (steps, in order) and its users-versus-close guard: any
    number of users at once, or one closer once they are done, and none after it."""

    def __init__(self, thread_name: str, free: Callable[[], None]) -> None:
        """`free`: releases the backend's model; run once, on the thread, by `close`."""
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name)
        self._free = free
        self._changed = threading.Condition()
        self._users = 0
        self._closing = False  # a close has begun: it waits for the users to leave
        self._closed = False

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        """Run `fn` on the thread after what is queued; BackendError once closed (also
        for work queued before the close that had not started)."""

        def unless_closed() -> T:
            if self._closed:
                raise BackendError(UNLOADED)
            return fn(*args, **kwargs)

        try:
            return self._thread.submit(unless_closed)
        except RuntimeError:  # the thread is shut down: closed
            raise BackendError(UNLOADED) from None

    def call(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`submit`, waited for."""
        return self.submit(fn, *args, **kwargs).result()

    @contextlib.contextmanager
    def using(self) -> Iterator[None]:
        """Use the model from any thread (tokenize, compile a grammar); BackendError once
        it is closed. A close waits until every user is done."""
        with self._changed:
            if self._closed:
                raise BackendError(UNLOADED)
            self._users += 1
        try:
            yield
        finally:
            with self._changed:
                self._users -= 1
                self._changed.notify_all()

    def abandon(self) -> None:
        """Stop the thread when there is no model to free (its load failed)."""
        self._closed = True
        self._thread.shutdown()

    def close(self) -> None:
        """Free the model on the thread, after its users and the step in flight. Idempotent:
        later calls (and users arriving meanwhile) wait for the first one to finish."""
        with self._changed:
            self._closing = True
            self._changed.wait_for(lambda: self._users == 0)
            if self._closed:
                return
            self._closed = True
            try:
                self._thread.submit(self._free).result()
            finally:
                self._thread.shutdown()
