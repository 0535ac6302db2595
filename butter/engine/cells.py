"""Which KV cells each sequence holds, so the engine knows what an eviction frees.

llama.cpp's unified cache tags each cell with the set of sequences that use it:
`seq_cp` adds a tag to existing cells instead of copying them, so a prefix shared by
several cached prompts costs its cells once. The ledger mirrors that: every position a
sequence holds is a cell id, a copied prefix shares the source's ids, and a cell is
free again once no sequence refers to it. It also counts the cells that only idle
sequences (cache entries) refer to: those are what cached prefixes cost beyond the live
requests' reservations, and what evicting them can give back.

Pure bookkeeping: no model, no trio. A backend whose prefix copies really copy (MLX)
gets fresh ids on every copy (`shares_cells=False`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable


class CellLedger:
    def __init__(self, *, shares_cells: bool = True) -> None:
        self.shares_cells = shares_cells
        self._cells: dict[int, list[int]] = {}  # seq -> cell id per position
        self._live: set[int] = set()  # sequences a running request owns
        self._refs: dict[int, int] = {}  # cell -> sequences holding it
        self._live_refs: dict[int, int] = {}  # cell -> live sequences holding it
        self._ids = itertools.count()
        self.used = 0  # distinct cells held by any sequence
        self.idle_only = 0  # cells that no live sequence holds

    # ------------------------------------------------------------------ queries

    def length(self, seq: int) -> int:
        return len(self._cells.get(seq, ()))

    def is_live(self, seq: int) -> bool:
        return seq in self._live

    def unique(self, seq: int) -> int:
        """Cells only this sequence holds: what dropping it frees."""
        return sum(1 for cell in self._cells.get(seq, ()) if self._refs[cell] == 1)

    # ------------------------------------------------------------------ changes

    def extend(self, seq: int, count: int) -> None:
        """`count` newly computed positions at the end of `seq`."""
        self._add(seq, [next(self._ids) for _ in range(count)])

    def copy_prefix(self, src: int, dst: int, count: int) -> None:
        """`dst` (empty) takes `src`'s first `count` positions."""
        if self._cells.get(dst):
            raise ValueError(f"seq {dst} is not empty")
        if not self.shares_cells:
            self.extend(dst, count)
            return
        self._add(dst, self._cells.get(src, [])[:count])

    def remove(self, seq: int, start: int, end: int | None = None) -> None:
        """Drop positions [start, end) of `seq` (end None: to its end)."""
        cells = self._cells.get(seq, [])
        stop = len(cells) if end is None else end
        live = seq in self._live
        for cell in cells[start:stop]:
            self._unref(cell, live)
        del cells[start:stop]

    def clear(self, seq: int) -> None:
        self.remove(seq, 0)

    def set_live(self, seq: int, live: bool) -> None:
        """A request takes (True) or leaves (False) this sequence."""
        if live == (seq in self._live):
            return
        cells = self._cells.get(seq, [])
        if live:
            self._live.add(seq)
            for cell in cells:
                self._add_live(cell)
        else:
            self._live.discard(seq)
            for cell in cells:
                self._drop_live(cell)

    # ------------------------------------------------------------------ reference counts

    def _add(self, seq: int, cells: Iterable[int]) -> None:
        held = self._cells.setdefault(seq, [])
        live = seq in self._live
        for cell in cells:
            refs = self._refs.get(cell, 0)
            self._refs[cell] = refs + 1
            if refs == 0:
                self.used += 1
                self.idle_only += 1  # until a live holder counts it out below
            if live:
                self._add_live(cell)
            held.append(cell)

    def _unref(self, cell: int, live: bool) -> None:
        if live:
            self._drop_live(cell)
        refs = self._refs[cell] - 1
        if refs:
            self._refs[cell] = refs
            return
        del self._refs[cell]
        self.used -= 1
        self.idle_only -= 1  # (a cell with no holder at all has no live one either)

    def _add_live(self, cell: int) -> None:
        count = self._live_refs.get(cell, 0)
        self._live_refs[cell] = count + 1
        if count == 0:
            self.idle_only -= 1

    def _drop_live(self, cell: int) -> None:
        count = self._live_refs[cell] - 1
        if count:
            self._live_refs[cell] = count
            return
        del self._live_refs[cell]
        self.idle_only += 1
