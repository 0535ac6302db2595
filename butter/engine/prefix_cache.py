"""The prefix cache: every KV sequence, what each holds, and which one a new prompt gets.

The counterpart of nano-vllm's BlockManager, by sequence rather than by block: a request
is leased a sequence whose cached tokens serve the longest prefix of its prompt (taken
over, shared with seq_cp, or restored from the host-RAM tier), idle sequences keep their
prompts until their cells or their ids are needed, and evicted prompts worth keeping go
to host RAM (`--cache-ram`). Nothing here touches the backend: each change is queued as a
KvOp that the engine's next step applies before its batch, so the bookkeeping here is
always what the KV will hold once that step runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

import attrs

from butter.backends.base import (
    Backend,
    CopyPrefix,
    KvOp,
    RemoveTokens,
    Restored,
    RestoreSequence,
    Saved,
    SaveSequence,
    SetSampler,
    ShiftPositions,
    StepResult,
)
from butter.engine.cells import CellLedger
from butter.engine.generation import Generation, RequestState
from butter.engine.host_cache import HostCache, HostCacheStats, HostEntry, common_prefix_length
from butter.kv import KvWindow

log = logging.getLogger("butter")

# Cached prefixes shorter than this many tokens are not worth a cache's place: an entry
# is saved to the host-RAM tier only if it holds this many tokens no other entry holds, a
# restore must save at least this many tokens of prefill, and a cached prompt whose tail
# beyond a new prompt's match is shorter than this is taken over rather than kept beside
# it. (The chat template's header, which every prompt shares, is far shorter.)
MIN_USEFUL_PREFIX = 32

# Every decode row's attention walks every cell of the KV pool's window, cached prompts'
# included (llama.cpp's CPU flash attention skips another sequence's cells one mask check
# at a time): so with the host-RAM tier on, a cached prompt that stays idle while the
# engine decodes this many rows moves there, where keeping it costs the steps nothing and
# a restore is a memory copy (docs/design/prefix-cache.md).
IDLE_DECODE_ROWS = 256


@attrs.define(eq=False)
class KvSequence:
    """One KV sequence id and the tokens it holds; an idle one keeps them for reuse."""

    seq: int
    kv_tokens: list[int] = attrs.field(factory=list)
    last_used: float = 0.0
    generation: Generation | None = None
    # After a window slide, only this many leading cached positions are still exactly
    # what a fresh prefill would compute (the rest attended to dropped tokens).
    exact_prefix: int | None = None
    idle_since_row: int = 0  # the engine's decode-row count when it was last left idle

    @property
    def reusable_cache(self) -> int:
        n = len(self.kv_tokens)
        return n if self.exact_prefix is None else min(n, self.exact_prefix)

    @property
    def idle_cache(self) -> bool:
        """It holds a cached prompt and no request."""
        return self.generation is None and bool(self.kv_tokens)


@attrs.frozen(eq=False)
class Lease:
    """Where an admitted request's prompt goes, and which cached prefix it starts from."""

    target: KvSequence
    keep: int  # prompt tokens served from the cache
    donor: KvSequence | None = None  # shares its first `keep` positions (CopyPrefix)
    host: HostEntry | None = None  # restored from the host-RAM tier, cut to `keep`
    restore: bytes = attrs.field(default=b"", repr=False)  # its bytes, out of the tier


class PrefixCache:
    def __init__(self, backend: Backend, *, n_seq: int, cache_ram_bytes: int) -> None:
        self.backend = backend
        self.sequences = [KvSequence(seq=i) for i in range(n_seq)]
        self.cells = CellLedger(shares_cells=backend.shares_prefix_cells)
        self.host = HostCache(cache_ram_bytes if backend.saves_sequences else 0)
        self._ops: list[KvOp] = []
        self._saving: list[HostEntry] = []  # in the order of the queued SaveSequence ops

    # ------------------------------------------------------------------ the step's side

    def take_ops(self) -> tuple[list[KvOp], list[HostEntry]]:
        """The KV operations queued since the last step, and the host entries its saves
        fill (in the order of its SaveSequence ops): the next step applies them."""
        ops, self._ops = self._ops, []
        saving, self._saving = self._saving, []
        return ops, saving

    @property
    def has_ops(self) -> bool:
        return bool(self._ops)

    def evaluated(self, seq: int, tokens: Sequence[int]) -> None:
        """A step put these tokens into the sequence's KV."""
        self.sequences[seq].kv_tokens.extend(tokens)
        self.cells.extend(seq, len(tokens))

    def record_kv_outcomes(self, results: Iterable[StepResult], saving: list[HostEntry]) -> None:
        """The step's saves go to the host tier; a failed restore prefills instead."""
        saves = iter(saving)
        for outcome in results:
            if isinstance(outcome, Saved):
                self.host.finish_save(next(saves), outcome.data)
            elif isinstance(outcome, Restored):
                self._restored(self.sequences[outcome.seq], outcome.ok)

    def _restored(self, sequence: KvSequence, ok: bool) -> None:
        generation = sequence.generation
        if not ok:
            log.warning("a host-RAM prefix could not be restored into seq %d; prefilling it",
                        sequence.seq)
            sequence.kv_tokens.clear()  # (the backend emptied the sequence)
            self.cells.clear(sequence.seq)
            if generation is not None:
                generation.cached_tokens = 0
                generation.pending = generation.prompt
        if generation is not None:
            generation._restore_done()

    def step_failed(self, seqs: Iterable[int], saving: list[HostEntry], message: str) -> None:
        """A step failed: the state of every sequence it touched is unknown, and some of its
        ops may not have run (a lease's sampler, an eviction). Those sequences are forgotten
        whole and the requests on them end; the step's saves to the host tier are lost."""
        for entry in saving:
            self.host.finish_save(entry, None)
        for seq in sorted(set(seqs)):
            sequence = self.sequences[seq]
            self._ops.append(RemoveTokens(seq, -1, -1))
            sequence.kv_tokens.clear()
            self.cells.clear(seq)
            if sequence.generation is not None:
                sequence.generation._finish("error", message)

    def slide(self, window: KvWindow) -> None:
        """Drop the oldest positions after the sinks of decoding sequences about to
        overflow the window."""
        for sequence in self.sequences:
            generation = sequence.generation
            if generation is None or generation.state is not RequestState.DECODING:
                continue
            drop = window.overflow(len(sequence.kv_tokens), len(generation.pending))
            if drop:
                keep = window.keep
                self._ops.append(RemoveTokens(sequence.seq, keep, keep + drop))
                self._ops.append(ShiftPositions(sequence.seq, keep + drop, -drop))
                del sequence.kv_tokens[keep:keep + drop]
                self.cells.remove(sequence.seq, keep, keep + drop)
                sequence.exact_prefix = min(keep, sequence.exact_prefix or keep)

    # ------------------------------------------------------------------ requests

    def attach(self, generation: Generation, reserved_cells: int) -> None:
        """Give an admitted request the sequence that serves most of its prompt, and make
        room for it: cached prefixes give way until the reservations fit the pool."""
        lease = self._plan_lease(generation)
        if lease.host is not None:  # its cells appear before the cut: room first
            self.make_room(reserved_cells, len(lease.host.tokens) - lease.keep, lease.target)
            self._lease(lease, generation)
        else:
            self._lease(lease, generation)
            self.make_room(reserved_cells, 0, lease.target)

    def detach(self, sequence: KvSequence, *, now: float, decode_rows: int) -> None:
        """Its request ended: the sequence keeps the prompt (and answer) as a cached prefix."""
        generation = sequence.generation
        assert generation is not None
        if generation.stopped_by_output:
            self._cut_to_answer(sequence, generation)
        sequence.generation = None
        sequence.last_used = now  # (time.monotonic())
        sequence.idle_since_row = decode_rows
        self.cells.set_live(sequence.seq, False)  # a cached prefix from now on

    def _cut_to_answer(self, sequence: KvSequence, generation: Generation) -> None:
        """Forget the tokens generated past a stop string: what the client never saw cannot
        return in its next prompt, and the cache is then the same however far ahead of the
        reader the engine had run (drafts run further)."""
        keep = generation.prompt_tokens + max(0, generation.completion_tokens - 1)
        if keep >= len(sequence.kv_tokens) or not self._can_cut(sequence) or \
                self.backend.info.is_recurrent:
            return
        self._ops.append(RemoveTokens(sequence.seq, keep, -1))
        del sequence.kv_tokens[keep:]
        self.cells.remove(sequence.seq, keep)

    def _plan_lease(self, generation: Generation) -> Lease:
        """The cached prefix that serves most of the prompt: a prompt in the KV pool that
        the new one extends is taken over; part of one (live or idle) is shared with
        seq_cp into a free sequence, so the cached prompt stays whole for its own return;
        one in the host-RAM tier is restored when that saves a real prefill."""
        prompt = generation.prompt
        if generation.prompt_top_logprobs is not None:  # every prompt token's logits
            return Lease(self._free_sequence(None), keep=0)
        source, keep = self._best_cached(prompt)
        host, host_keep = self._best_host(prompt)
        if host is not None and host_keep >= keep + MIN_USEFUL_PREFIX:
            data = self.host.take(host, host_keep)  # (before an eviction could drop it)
            return Lease(self._free_sequence(source), keep=host_keep, host=host, restore=data)
        if source is None or keep == 0:
            return Lease(self._free_sequence(None), keep=0)
        if source.generation is None and len(source.kv_tokens) - keep < MIN_USEFUL_PREFIX:
            return Lease(source, keep=keep)  # extends it, or leaves little of it behind
        target = self._free_sequence(source)
        if target is source:  # no other sequence free: the cached prompt is cut back
            return Lease(source, keep=keep)
        return Lease(target, keep=keep, donor=source)

    def _best_cached(self, prompt: Sequence[int]) -> tuple[KvSequence | None, int]:
        """The sequence (idle or busy) whose cache serves the longest prefix of `prompt`;
        among equals, an idle one, then the most recently used."""
        best: KvSequence | None = None
        best_key = (0, False, 0.0)
        for sequence in self.sequences:
            if sequence.generation is not None and \
                    sequence.generation.state is RequestState.RESTORING:
                continue  # (its restore has not run yet, and may fail)
            keep = self._reusable(sequence, prompt)
            key = (keep, sequence.generation is None, sequence.last_used)
            if keep and key > best_key:
                best, best_key = sequence, key
        return best, best_key[0]

    def _reusable(self, sequence: KvSequence, prompt: Sequence[int]) -> int:
        """How much of this sequence's cache the prompt can keep (one token must remain):
        all of an idle cache it extends; part of one, or a busy one's, only if it can be
        cut (or copied in part)."""
        if not sequence.kv_tokens:
            return 0
        keep = min(common_prefix_length(sequence.kv_tokens, prompt), len(prompt) - 1,
                   sequence.reusable_cache)
        whole = keep == len(sequence.kv_tokens) and sequence.generation is None
        if not whole and not (self._can_cut(sequence) and not self.backend.info.is_recurrent):
            return 0
        return keep

    def _best_host(self, prompt: Sequence[int]) -> tuple[HostEntry | None, int]:
        best: HostEntry | None = None
        best_keep = 0
        for entry in self.host.entries():
            keep = min(common_prefix_length(entry.tokens, prompt), len(prompt) - 1)
            if keep < len(entry.tokens) and self.backend.rewind_limit is not None:
                continue  # (a cache that cannot be cut is only restored whole)
            if keep > best_keep:
                best, best_keep = entry, keep
        return best, best_keep

    def _can_cut(self, sequence: KvSequence) -> bool:
        """Whether this sequence's cache can be cut back (or copied in part): not recurrent
        state, nor a sliding-window cache that has wrapped around (backend.rewind_limit)."""
        limit = self.backend.rewind_limit
        return limit is None or len(sequence.kv_tokens) < limit

    def _free_sequence(self, keep: KvSequence | None) -> KvSequence:
        """An idle sequence for a new prompt: an empty one, else the least recently used
        cached prompt other than `keep` gives its place (to the host tier if it is worth
        it); `keep` itself only if there is no other."""
        idle = [s for s in self.sequences if s.generation is None and s is not keep]
        if not idle:
            assert keep is not None  # admission grants at most `parallel` tickets
            return keep
        empty = [s for s in idle if not s.kv_tokens]
        if empty:
            return empty[0]
        oldest = min(idle, key=lambda s: s.last_used)
        self._evict(oldest)
        return oldest

    def _lease(self, lease: Lease, generation: Generation) -> None:
        sequence, keep = lease.target, lease.keep
        if lease.host is not None:
            self._forget(sequence)
            self._ops.append(RestoreSequence(sequence.seq, lease.restore, keep))
            sequence.kv_tokens = list(lease.host.tokens[:keep])
            self.cells.extend(sequence.seq, keep)
        elif lease.donor is not None:
            self._forget(sequence)
            self._ops.append(CopyPrefix(lease.donor.seq, sequence.seq, keep))
            sequence.kv_tokens = list(generation.prompt[:keep])
            self.cells.copy_prefix(lease.donor.seq, sequence.seq, keep)
        elif keep < len(sequence.kv_tokens):
            if keep == 0:
                self._forget(sequence)
            else:
                self._ops.append(RemoveTokens(sequence.seq, keep, -1))
                del sequence.kv_tokens[keep:]
                self.cells.remove(sequence.seq, keep)
        sequence.exact_prefix = None  # what is left is exact again
        self.cells.set_live(sequence.seq, True)
        self._ops.append(SetSampler(sequence.seq, generation.params))
        generation.cached_tokens = keep
        generation.pending = generation.prompt[keep:]
        generation.leased_at = time.perf_counter()
        sequence.generation = generation
        generation._leased(restoring=lease.host is not None)

    # ------------------------------------------------------------------ eviction

    def make_room(self, reserved_cells: int, extra: int,
                  protect: KvSequence | None = None) -> None:
        """Cached prefixes give way, least recently used first, until the live
        reservations, the cells only cached prefixes hold, and `extra` fit in the pool."""
        idle = sorted((s for s in self.sequences if s.idle_cache and s is not protect),
                      key=lambda s: s.last_used)
        for sequence in idle:
            if reserved_cells + self.cells.idle_only + extra <= self.backend.n_cells:
                return
            self._evict(sequence)

    def age_out_idle(self, decode_rows: int) -> None:
        """Cached prompts left idle through IDLE_DECODE_ROWS decode rows go to host RAM."""
        if not self.host.enabled:
            return  # (without the tier, keeping them is the only way to keep them)
        for sequence in self.sequences:
            if sequence.idle_cache and \
                    decode_rows - sequence.idle_since_row >= IDLE_DECODE_ROWS:
                self._evict(sequence)

    def drop_idle(self) -> None:
        """Forget every cached prefix, in the KV pool and in host RAM."""
        for sequence in self.sequences:
            if sequence.generation is None:
                self._forget(sequence)
        self.host.clear()

    def _evict(self, sequence: KvSequence) -> None:
        """Drop a cached prompt from the KV pool, saving it to the host tier first if it
        holds enough that no other cached prompt does."""
        exact = sequence.exact_prefix is None  # (a slid window's cache is no prefix)
        if self.host.enabled and exact and self._unique_tokens(sequence) >= MIN_USEFUL_PREFIX:
            self._ops.append(SaveSequence(sequence.seq))
            self._saving.append(self.host.begin_save(sequence.kv_tokens, sequence.last_used))
        self._forget(sequence)

    def _unique_tokens(self, sequence: KvSequence) -> int:
        tokens = sequence.kv_tokens
        shared = max((common_prefix_length(other.kv_tokens, tokens)
                      for other in self.sequences if other is not sequence), default=0)
        return len(tokens) - max(shared, self.host.longest_shared(tokens))

    def _forget(self, sequence: KvSequence) -> None:
        if sequence.kv_tokens:
            self._ops.append(RemoveTokens(sequence.seq, -1, -1))
            sequence.kv_tokens.clear()
        self.cells.clear(sequence.seq)
        sequence.exact_prefix = None

    # ------------------------------------------------------------------ what it holds

    def cached_entries(self) -> int:
        return sum(1 for s in self.sequences if s.idle_cache)

    def host_stats(self) -> HostCacheStats | None:
        return self.host.stats() if self.host.enabled else None
