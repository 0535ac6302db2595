"""The backend worker: one thread for every evaluation, and users versus close."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from butter.backends.base import BackendError
from butter.backends.worker import BackendWorker


class _Model:
    """What a backend frees: records where and how often."""

    def __init__(self) -> None:
        self.freed_on: list[str] = []

    def free(self) -> None:
        self.freed_on.append(threading.current_thread().name)


def wait_until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_work_runs_in_order_on_the_workers_one_thread() -> None:
    model = _Model()
    worker = BackendWorker("butter-test", free=model.free)
    seen: list[tuple[int, str]] = []
    futures = [worker.submit(lambda i=i: seen.append((i, threading.current_thread().name)))
               for i in range(20)]
    for future in futures:
        future.result()
    assert [i for i, _ in seen] == list(range(20))
    assert len({name for _, name in seen}) == 1 and seen[0][1].startswith("butter-test")
    assert worker.call(lambda a, b: a + b, 2, b=3) == 5
    worker.close()
    assert model.freed_on == [seen[0][1]]  # freed once, on that same thread


def test_close_waits_for_users_then_refuses_them() -> None:
    model = _Model()
    worker = BackendWorker("butter-test", free=model.free)
    inside, release = threading.Event(), threading.Event()

    def user() -> None:  # e.g. a request being tokenized on a preparing thread
        with worker.using():
            inside.set()
            release.wait()

    holder = threading.Thread(target=user)
    holder.start()
    inside.wait()
    closer = threading.Thread(target=worker.close)
    closer.start()
    wait_until(lambda: worker.closing)  # close has begun, and only a user leaving ends it
    assert closer.is_alive() and not model.freed_on  # the user still holds the model
    assert not worker.closed
    release.set()
    closer.join(timeout=10)
    holder.join(timeout=10)
    assert not closer.is_alive() and len(model.freed_on) == 1
    with pytest.raises(BackendError, match="the model was unloaded"), worker.using():
        pass
    with pytest.raises(BackendError, match="the model was unloaded"):
        worker.submit(lambda: None)
    worker.close()  # again: nothing more happens
    assert len(model.freed_on) == 1


def test_work_queued_behind_a_close_finds_the_model_unloaded() -> None:
    model = _Model()
    worker = BackendWorker("butter-test", free=model.free)
    started, release = threading.Event(), threading.Event()

    def step_in_flight() -> str:
        started.set()
        release.wait()
        return "done"

    in_flight = worker.submit(step_in_flight)
    started.wait()
    queued = worker.submit(lambda: "too late")
    closer = threading.Thread(target=worker.close)
    closer.start()
    wait_until(lambda: worker.closed)  # close has begun: free is queued behind the step
    assert closer.is_alive() and not model.freed_on  # the step in flight finishes first
    release.set()
    closer.join(timeout=10)
    assert in_flight.result() == "done" and len(model.freed_on) == 1
    with pytest.raises(BackendError, match="the model was unloaded"):
        queued.result()
