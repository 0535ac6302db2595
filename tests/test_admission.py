"""Admission policy under trio's MockClock: FIFO, queued cancel, release, 503, never-fits."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from butter.engine.admission import Admission, Ticket
from butter.errors import ContextLengthExceeded, Overloaded


async def test_grants_in_strict_fifo_order(autojump_clock: trio.testing.MockClock) -> None:
    admission = Admission(slots=1, cells=100, max_queue=10)
    first = await admission.acquire(10)
    order: list[int] = []

    done = [trio.Event() for _ in range(3)]

    async def waiter(name: int, cells: int) -> None:
        ticket = await admission.acquire(cells)
        order.append(name)
        await done[name].wait()  # holds the one slot until the test lets it go
        admission.release(ticket)

    async with trio.open_nursery() as nursery:
        for name, cells in enumerate([50, 5, 20]):
            nursery.start_soon(waiter, name, cells)
            await trio.testing.wait_all_tasks_blocked()  # queued: arrival order is fixed
        assert admission.stats().queued == 3
        admission.release(first)
        for name in range(3):
            await trio.testing.wait_all_tasks_blocked()
            assert order == list(range(name + 1))  # the next only after this release
            assert admission.stats().active == 1
            done[name].set()
    assert order == [0, 1, 2]
    assert admission.stats().reserved_cells == 0


async def test_head_blocks_smaller_requests_behind_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    admission = Admission(slots=4, cells=100, max_queue=10)
    big_holder = await admission.acquire(60)
    granted: dict[str, int] = {}

    async def wants(name: str, cells: int) -> None:
        ticket = await admission.acquire(cells)
        granted[name] = ticket.number  # numbers are handed out in grant order
        admission.release(ticket)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wants, "big", 50)  # does not fit until the holder leaves
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(wants, "small", 5)  # would fit, but must not overtake
        await trio.testing.wait_all_tasks_blocked()  # both are parked in acquire()
        assert admission.stats().queued == 2
        assert granted == {}
        admission.release(big_holder)
    assert granted["big"] < granted["small"]


async def test_cancelled_waiter_leaves_the_queue(autojump_clock: trio.testing.MockClock) -> None:
    admission = Admission(slots=1, cells=100, max_queue=10)
    holder = await admission.acquire(10)
    got: list[Ticket] = []

    async def patient() -> None:
        got.append(await admission.acquire(10))

    async with trio.open_nursery() as nursery:
        with trio.move_on_after(1):
            await admission.acquire(10)  # gives up while queued
        nursery.start_soon(patient)
        await trio.testing.wait_all_tasks_blocked()
        assert admission.stats().queued == 1
        admission.release(holder)
    assert len(got) == 1 and admission.stats().active == 1


async def test_full_queue_answers_overloaded(autojump_clock: trio.testing.MockClock) -> None:
    admission = Admission(slots=1, cells=100, max_queue=1)
    await admission.acquire(1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(admission.acquire, 1)
        await trio.testing.wait_all_tasks_blocked()
        assert admission.stats().queued == 1
        with pytest.raises(Overloaded) as caught:
            await admission.acquire(1)
        assert caught.value.headers() == {"Retry-After": "1"}
        with pytest.raises(Overloaded):
            admission.check_queue_room()
        nursery.cancel_scope.cancel()


async def test_never_fitting_request_is_rejected_at_once() -> None:
    admission = Admission(slots=1, cells=100, max_queue=1)
    with pytest.raises(ContextLengthExceeded, match="101"):
        await admission.acquire(101)


async def test_release_is_idempotent_and_frees_for_the_next(
    autojump_clock: trio.testing.MockClock,
) -> None:
    admission = Admission(slots=2, cells=100, max_queue=4)
    ticket = await admission.acquire(80)
    admission.release(ticket)
    admission.release(ticket)
    assert admission.stats().reserved_cells == 0
    again = await admission.acquire(100)
    assert again.cells == 100


async def test_release_on_failure_in_the_holder(autojump_clock: trio.testing.MockClock) -> None:
    admission = Admission(slots=1, cells=10, max_queue=4)

    async def failing_request() -> None:
        ticket = await admission.acquire(10)
        try:
            raise RuntimeError("backend exploded")
        finally:
            admission.release(ticket)

    with pytest.raises(RuntimeError):
        await failing_request()
    assert admission.stats().active == 0
    with trio.fail_after(1):
        await admission.acquire(10)


async def test_extension_only_when_room_and_nobody_waits(
    autojump_clock: trio.testing.MockClock,
) -> None:
    admission = Admission(slots=2, cells=100, max_queue=4)
    ticket = await admission.acquire(50)
    assert admission.try_extend(ticket, 30)
    assert ticket.cells == 80
    assert not admission.try_extend(ticket, 30)  # would exceed the pool
    async with trio.open_nursery() as nursery:
        nursery.start_soon(admission.acquire, 30)
        await trio.testing.wait_all_tasks_blocked()
        assert admission.stats().queued == 1
        assert not admission.try_extend(ticket, 1)  # a waiter has priority
        nursery.cancel_scope.cancel()
