"""Strict-FIFO admission with KV reservations.

A request waits here until it is at the head of the queue AND a session slot and
enough KV cells are free. Cells are reserved for prompt + requested completion
before the cache is touched, and released on completion, cancellation or failure.
Idle sessions' cached prefixes do not count: they are evicted on demand.
"""

from __future__ import annotations

import itertools
from collections import deque

import attrs
import trio

from butter.errors import ContextLengthExceeded, Overloaded
from butter.settings import RETRY_AFTER_SECONDS


@attrs.define(eq=False)
class Ticket:
    number: int
    cells: int
    released: bool = False


@attrs.define(eq=False)
class _Waiter:
    cells: int  # per ticket
    count: int = 1  # tickets granted together (a request's `n` choices)
    granted: trio.Event = attrs.field(factory=trio.Event)
    tickets: list[Ticket] = attrs.field(factory=list)
    refused: Exception | None = None


@attrs.frozen
class AdmissionStats:
    active: int
    queued: int
    reserved_cells: int
    total_cells: int
    slots: int


class Admission:
    def __init__(self, *, slots: int, cells: int, max_queue: int) -> None:
        self.slots = slots
        self.total_cells = cells
        self.max_queue = max_queue
        self._queue: deque[_Waiter] = deque()
        self._active: set[Ticket] = set()
        self._reserved = 0
        self._numbers = itertools.count(1)
        self._closed: Exception | None = None

    def close(self, reason: Exception) -> None:
        """No more admissions: every waiter (and every later caller) gets `reason`."""
        self._closed = reason
        while self._queue:
            waiter = self._queue.popleft()
            waiter.refused = reason
            waiter.granted.set()

    def stats(self) -> AdmissionStats:
        return AdmissionStats(
            active=len(self._active), queued=len(self._queue),
            reserved_cells=self._reserved, total_cells=self.total_cells, slots=self.slots,
        )

    def check_queue_room(self) -> None:
        """Refuse now (503) rather than after a stream's headers went out."""
        if len(self._queue) >= self.max_queue:
            raise self._overloaded()

    def _overloaded(self) -> Overloaded:
        return Overloaded(
            f"the server is busy: {len(self._queue)} requests are already waiting",
            retry_after=RETRY_AFTER_SECONDS,
        )

    async def acquire(self, cells: int) -> Ticket:
        """Wait (FIFO) for a slot and `cells` KV cells. Leaving the wait leaves the queue."""
        (ticket,) = await self.acquire_many(cells, 1)
        return ticket

    async def acquire_many(self, cells: int, count: int) -> list[Ticket]:
        """`count` slots with `cells` each, granted together: taken one by one, two requests
        could each hold some and wait for the other's forever."""
        if count > self.slots:
            raise ContextLengthExceeded(
                f"this request needs {count} sessions but the server has {self.slots}")
        if cells * count > self.total_cells:
            raise ContextLengthExceeded(
                f"this request needs {cells * count} KV cells but the pool has "
                f"{self.total_cells}")
        if self._closed is not None:
            raise self._closed
        waiter = _Waiter(cells, count)
        if not self._queue and self._fits_waiter(waiter):
            return self._grant(waiter)
        if len(self._queue) >= self.max_queue:
            raise self._overloaded()
        self._queue.append(waiter)
        try:
            await waiter.granted.wait()
        except BaseException:
            if waiter.tickets:
                for ticket in waiter.tickets:
                    self.release(ticket)  # granted, but the caller is gone
            else:
                self._queue.remove(waiter)
                self._grant_waiting()  # the head may have changed
            raise
        if waiter.refused is not None:
            raise waiter.refused
        return waiter.tickets

    def release(self, ticket: Ticket) -> None:
        """Idempotent, synchronous: safe in any `finally`, even while cancelled."""
        if ticket.released:
            return
        ticket.released = True
        self._active.discard(ticket)
        self._reserved -= ticket.cells
        self._grant_waiting()

    def try_extend(self, ticket: Ticket, cells: int) -> bool:
        """Grow a live reservation if nobody waits and the cells are free (never blocks)."""
        if ticket.released or self._queue or self._reserved + cells > self.total_cells:
            return False
        ticket.cells += cells
        self._reserved += cells
        return True

    def _fits_waiter(self, waiter: _Waiter) -> bool:
        slots_free = len(self._active) + waiter.count <= self.slots
        return slots_free and self._reserved + waiter.cells * waiter.count <= self.total_cells

    def _grant(self, waiter: _Waiter) -> list[Ticket]:
        for _ in range(waiter.count):
            ticket = Ticket(number=next(self._numbers), cells=waiter.cells)
            self._active.add(ticket)
            self._reserved += ticket.cells
            waiter.tickets.append(ticket)
        waiter.granted.set()
        return waiter.tickets

    def _grant_waiting(self) -> None:
        # Strict FIFO: only the head may enter, even if a smaller request behind it fits.
        while self._queue and self._fits_waiter(self._queue[0]):
            self._grant(self._queue.popleft())
