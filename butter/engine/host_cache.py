"""The host-RAM tier of the prefix cache (`--cache-ram`).

A cached prefix evicted from the KV pool (its cells were needed, or every sequence id
was taken) is saved here as the backend's serialized sequence state, and restored into
a free sequence when a prompt that starts with it returns: a memory copy instead of a
prefill. Entries are kept least recently used first within a byte budget, which the
checkpoints of sequences in the KV pool share (they are host memory too). Pure: the
bytes are opaque, the backend makes and reads them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from butter.engine.checkpoints import Checkpoint


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@attrs.define(eq=False)
class HostEntry:
    tokens: tuple[int, ...]
    last_used: float
    data: bytes | None = None  # None until the step that saves it has run
    # A recurrent or hybrid model's checkpoints of these tokens: they come back with it.
    checkpoints: tuple[Checkpoint, ...] = ()

    @property
    def size(self) -> int:
        if self.data is None:
            return 0
        return len(self.data) + sum(c.size for c in self.checkpoints)


@attrs.frozen
class HostCacheStats:
    entries: int
    bytes: int
    budget_bytes: int
    saved: int  # entries saved since start
    restored: int  # entries restored since start
    restored_tokens: int


class HostCache:
    def __init__(self, budget_bytes: int, held_elsewhere: Callable[[], int] = lambda: 0,
                 *, cuts_at_checkpoints: bool = False) -> None:
        """`held_elsewhere`: the bytes of this budget held outside the tier now (the KV
        pool's sequences' checkpoints). `cuts_at_checkpoints`: an entry's state can be cut
        back only to its checkpoints (a recurrent or hybrid model), else anywhere."""
        self.budget_bytes = budget_bytes
        self.held_elsewhere = held_elsewhere
        self.cuts_at_checkpoints = cuts_at_checkpoints
        self._entries: list[HostEntry] = []  # least recently used first
        self._bytes = 0
        self._saved = 0
        self._restored = 0
        self._restored_tokens = 0

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def stats(self) -> HostCacheStats:
        return HostCacheStats(
            entries=sum(1 for e in self._entries if e.data is not None), bytes=self._bytes,
            budget_bytes=self.budget_bytes, saved=self._saved, restored=self._restored,
            restored_tokens=self._restored_tokens,
        )

    def entries(self) -> list[HostEntry]:
        return [entry for entry in self._entries if entry.data is not None]

    def longest_shared(self, tokens: Sequence[int]) -> int:
        """The longest prefix of `tokens` that an entry here already holds."""
        return max((common_prefix_length(e.tokens, tokens) for e in self._entries), default=0)

    def begin_save(self, tokens: Sequence[int], now: float,
                   checkpoints: Sequence[Checkpoint] = ()) -> HostEntry:
        """An entry whose bytes the next step returns (`finish_save`). Entries it
        extends are dropped where a restore of the new one cut back serves them too."""
        entry = HostEntry(tuple(tokens), now, checkpoints=tuple(checkpoints))
        cuts = {len(tokens), *(c.n_tokens for c in checkpoints)}
        for old in list(self._entries):
            if common_prefix_length(old.tokens, entry.tokens) == len(old.tokens) and \
                    (not self.cuts_at_checkpoints or len(old.tokens) in cuts):
                self._drop(old)
        self._entries.append(entry)
        return entry

    def finish_save(self, entry: HostEntry, data: bytes | None) -> None:
        """The saved bytes arrived (None: the save failed); older entries give way."""
        if entry not in self._entries:
            return
        if data is None or not data or len(data) > self.budget_bytes:
            self._entries.remove(entry)
            return
        entry.data = data
        self._bytes += entry.size
        self._saved += 1
        self._drop_oldest_until_fits(0, spare=entry)
        if self._bytes + self.held_elsewhere() > self.budget_bytes:
            self._drop(entry)  # (the KV pool's checkpoints alone fill the budget)

    def make_room(self, size: int) -> bool:
        """Drop entries, least recently used first, until `size` more bytes fit in the
        budget beside what it holds; whether they do."""
        return self._drop_oldest_until_fits(size)

    def _drop_oldest_until_fits(self, size: int, spare: HostEntry | None = None) -> bool:
        for old in list(self._entries):
            if self._bytes + self.held_elsewhere() + size <= self.budget_bytes:
                break
            if old is not spare:
                self._drop(old)
        return self._bytes + self.held_elsewhere() + size <= self.budget_bytes

    def take(self, entry: HostEntry, restored_tokens: int) -> bytes:
        """Remove an entry for its restore; it becomes a KV-pool entry again (its
        checkpoints with it: the caller takes `entry.checkpoints`)."""
        assert entry.data is not None
        data = entry.data
        self._drop(entry)
        self._restored += 1
        self._restored_tokens += restored_tokens
        return data

    def clear(self) -> None:
        for entry in list(self._entries):
            self._drop(entry)

    def _drop(self, entry: HostEntry) -> None:
        self._entries.remove(entry)
        self._bytes -= entry.size
