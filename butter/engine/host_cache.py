"""The host-RAM tier of the prefix cache (`--cache-ram`).

A cached prefix evicted from the KV pool (its cells were needed, or every sequence id
was taken) is saved here as the backend's serialized sequence state, and restored into
a free sequence when a prompt that starts with it returns: a memory copy instead of a
prefill. Entries are kept least recently used first within a byte budget. Pure: the
bytes are opaque, the backend makes and reads them.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs


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

    @property
    def size(self) -> int:
        return len(self.data) if self.data is not None else 0


@attrs.frozen
class HostCacheStats:
    entries: int
    bytes: int
    budget_bytes: int
    saved: int  # entries saved since start
    restored: int  # entries restored since start
    restored_tokens: int


class HostCache:
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
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

    def begin_save(self, tokens: Sequence[int], now: float) -> HostEntry:
        """An entry whose bytes the next step returns (`finish_save`). Entries it
        extends are dropped: a restore of the new one cut back serves them too."""
        entry = HostEntry(tuple(tokens), now)
        for old in list(self._entries):
            if common_prefix_length(old.tokens, entry.tokens) == len(old.tokens):
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
        self._bytes += len(data)
        self._saved += 1
        for old in list(self._entries):
            if self._bytes <= self.budget_bytes:
                break
            if old is not entry:
                self._drop(old)

    def take(self, entry: HostEntry, restored_tokens: int) -> bytes:
        """Remove an entry for its restore; it becomes a KV-pool entry again."""
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
