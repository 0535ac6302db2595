"""The prefix cache: every KV sequence, what each holds, and which one a new prompt gets.

The counterpart of nano-vllm's BlockManager, by sequence rather than by block: a request
is leased a sequence whose cached tokens serve the longest prefix of its prompt (taken
over, shared with seq_cp, or restored from the host-RAM tier), idle sequences keep their
prompts until their cells or their ids are needed, and evicted prompts worth keeping go
to host RAM (`--cache-ram`). A recurrent or hybrid model's sequence can only be cut back
to one of its checkpoints (checkpoints.py), taken as its prompts are evaluated. Nothing
here touches the backend: each change is queued as a KvOp that the engine's next step
applies before its batch, so the bookkeeping here is always what the KV will hold once
that step runs.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Sequence

import attrs

from butter.backends.base import (
    Backend,
    Checkpointed,
    CopyPrefix,
    KvOp,
    RemoveTokens,
    RestoreCheckpoint,
    Restored,
    RestoreSequence,
    SaveCheckpoint,
    Saved,
    SaveSequence,
    SetSampler,
    ShiftPositions,
    StepResult,
)
from butter.engine import checkpoints
from butter.engine.cells import CellLedger
from butter.engine.checkpoints import Checkpoint
from butter.engine.generation import Generation, RequestState
from butter.engine.host_cache import HostCache, HostCacheStats, HostEntry, common_prefix_length
from butter.kv import KvWindow
from butter.settings import DEFAULT_CHECKPOINTS_PER_SEQUENCE

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
    # Where its state can be cut back to (a recurrent or hybrid model), by position; and
    # the positions of its prompt still to checkpoint as it is evaluated.
    checkpoints: list[Checkpoint] = attrs.field(factory=list)
    planned: list[int] = attrs.field(factory=list)
    # The checkpoints queued and not back yet (an id each, and the length it saves at).
    saving_checkpoints: dict[int, int] = attrs.field(factory=dict)
    # Changes whenever tokens it holds are dropped: a queued restore's outcome that comes
    # back after that belongs to what it held before.
    lineage: int = 0
    restoring: bool = False  # a restore into it is queued and has not come back yet

    @property
    def reusable_cache(self) -> int:
        n = len(self.kv_tokens)
        return n if self.exact_prefix is None else min(n, self.exact_prefix)

    @property
    def idle_cache(self) -> bool:
        """It holds a cached prompt and no request."""
        return self.generation is None and bool(self.kv_tokens)

    def tokens_to_next_checkpoint(self) -> int | None:
        """How many more tokens a step may evaluate before the next planned checkpoint."""
        return self.planned[0] - len(self.kv_tokens) if self.planned else None

    def truncate(self, keep: int) -> None:
        """It keeps its first `keep` tokens (and the checkpoints within them)."""
        del self.kv_tokens[keep:]
        self.checkpoints = checkpoints.up_to(self.checkpoints, keep)
        self.planned = [p for p in self.planned if p > keep]
        self.saving_checkpoints = {i: n for i, n in self.saving_checkpoints.items() if n <= keep}
        self.lineage += 1


@attrs.frozen(eq=False)
class Lease:
    """Where an admitted request's prompt goes, and which cached prefix it starts from."""

    target: KvSequence
    keep: int  # prompt tokens served from the cache
    donor: KvSequence | None = None  # shares its first `keep` positions (CopyPrefix)
    host: HostEntry | None = None  # restored from the host-RAM tier, cut to `keep`
    restore: bytes = attrs.field(default=b"", repr=False)  # its bytes, out of the tier
    # Recurrent state cannot be cut: it is restored from this checkpoint at `keep`.
    checkpoint: Checkpoint | None = None


@attrs.define
class CheckpointStats:
    taken: int = 0
    skipped: int = 0  # not taken: the --cache-ram budget had no room
    restored: int = 0
    restored_tokens: int = 0  # prompt tokens served from the KV by a restored checkpoint
    held: int = 0  # now, in the KV pool's sequences and the host tier
    bytes: int = 0


def image_edge(prompt: Sequence[int], keep: int) -> int:
    """`keep`, or, where it falls inside an image of the prompt (between two of its
    image_token_ids), where that image starts: a cache is cut, copied or checkpointed only
    at an image's edge. On a model whose images take M-RoPE positions an image's cells
    share one position, which no cut can split (backends/llama_cpp/positions.py); on others
    the rest of an image is rarely worth keeping apart (a request cancelled inside one)."""
    while 0 < keep < len(prompt) and prompt[keep - 1] < 0 and prompt[keep] < 0:
        keep -= 1
    return keep


class PrefixCache:
    def __init__(self, backend: Backend, *, n_seq: int, cache_ram_bytes: int,
                 prefill_chunk: int,
                 checkpoints_per_sequence: int = DEFAULT_CHECKPOINTS_PER_SEQUENCE) -> None:
        """`cache_ram_bytes` holds the host tier and every checkpoint; a recurrent or
        hybrid model keeps at most `checkpoints_per_sequence` for each cached prompt (0:
        none), placed with `prefill_chunk` in mind (checkpoints.positions)."""
        self.backend = backend
        self.sequences = [KvSequence(seq=i) for i in range(n_seq)]
        self.cells = CellLedger(shares_cells=backend.shares_prefix_cells)
        budget = cache_ram_bytes if backend.saves_sequences or backend.checkpoint_bytes else 0
        self.host = HostCache(budget, self._checkpoint_bytes_in_pool,
                              cuts_at_checkpoints=backend.info.is_recurrent)
        self.host_tier = self.host.enabled and backend.saves_sequences
        self.checkpoint_size = backend.checkpoint_bytes if self.host.enabled else 0
        self.checkpoints_per_sequence = checkpoints_per_sequence if self.checkpoint_size else 0
        self.prefill_chunk = prefill_chunk
        self.checkpoint_stats = CheckpointStats()
        self._ops: list[KvOp] = []
        self._saving: list[HostEntry] = []  # in the order of the queued SaveSequence ops
        # the sequence and an id, for each queued SaveCheckpoint, in order
        self._checkpointing: list[tuple[KvSequence, int]] = []
        self._checkpoint_ids = itertools.count()
        # the sequence and its lineage, for each queued restore, in order
        self._restoring: list[tuple[KvSequence, int]] = []

    @property
    def checkpoints_on(self) -> bool:
        return self.checkpoints_per_sequence > 0

    def _checkpoint_bytes_in_pool(self) -> int:
        """What the KV pool's checkpoints hold of the budget, queued ones included (a
        checkpoint that a prefix copy shares between sequences counts once)."""
        return sum(c.size for c in self._pool_checkpoints()) + \
            len(self._checkpointing) * self.checkpoint_size

    def _pool_checkpoints(self) -> list[Checkpoint]:
        unique = {id(c): c for s in self.sequences for c in s.checkpoints}
        return list(unique.values())

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
        """A step put these tokens into the sequence's KV; where that reaches a planned
        checkpoint, the next step saves one before its batch."""
        sequence = self.sequences[seq]
        sequence.kv_tokens.extend(tokens)
        self.cells.extend(seq, len(tokens))
        length = len(sequence.kv_tokens)
        while sequence.planned and sequence.planned[0] <= length:
            if sequence.planned.pop(0) == length:
                self._checkpoint(sequence)

    def _checkpoint(self, sequence: KvSequence) -> None:
        """Queue a checkpoint of the sequence as it stands, if the budget has room."""
        length = len(sequence.kv_tokens)
        # (room for a whole one, even where one of its own then gives way: that one may
        # be shared with a copy, and free nothing)
        if not self._room_for_checkpoint(sequence, self.checkpoint_size):
            self.checkpoint_stats.skipped += 1
            return
        self._ops.append(SaveCheckpoint(sequence.seq))
        save = next(self._checkpoint_ids)
        sequence.saving_checkpoints[save] = length
        self._checkpointing.append((sequence, save))

    def _room_for_checkpoint(self, sequence: KvSequence, size: int) -> bool:
        """Make room in the budget: host-tier entries go first (least recently used
        first), then idle cached prompts' checkpoints (the same order)."""
        if self.host.make_room(size):
            return True
        idle = sorted((s for s in self.sequences
                       if s is not sequence and s.generation is None and s.checkpoints),
                      key=lambda s: s.last_used)
        for other in idle:
            other.checkpoints = []
            if self.host.make_room(size):
                return True
        return False

    def record_kv_outcomes(self, results: Iterable[StepResult], saving: list[HostEntry]) -> None:
        """The step's saves go to the host tier, its checkpoints to their sequences; a
        failed restore prefills instead."""
        saves = iter(saving)
        for outcome in results:
            if isinstance(outcome, Saved):
                self.host.finish_save(next(saves), outcome.data)
            elif isinstance(outcome, Checkpointed):
                self._checkpointed(outcome.data)
            elif isinstance(outcome, Restored):
                self._restored(outcome.ok)

    def _checkpointed(self, data: bytes | None) -> None:
        sequence, save = self._checkpointing.pop(0)
        length = sequence.saving_checkpoints.pop(save, None)
        if data is None or length is None:
            return  # (the backend could not save it, or its tokens were dropped since)
        sequence.checkpoints = checkpoints.with_checkpoint(
            sequence.checkpoints, Checkpoint(length, data), self.checkpoints_per_sequence)
        self.checkpoint_stats.taken += 1

    def _restored(self, ok: bool) -> None:
        sequence, lineage = self._restoring.pop(0)
        if lineage != sequence.lineage:
            return  # (given up while it loaded; nothing built on what it loaded)
        sequence.restoring = False
        generation = sequence.generation
        if not ok:
            log.warning("a cached prefix could not be restored into seq %d; prefilling it",
                        sequence.seq)
            sequence.truncate(0)  # (the backend emptied the sequence)
            self.cells.clear(sequence.seq)
            if generation is not None:
                generation.cached_tokens = 0
                generation.pending = generation.prompt
                self._plan_checkpoints(sequence, generation)
        if generation is not None:
            generation._restore_done()

    def step_failed(self, seqs: Iterable[int], saving: list[HostEntry], message: str) -> None:
        """A step failed: the state of every sequence it touched is unknown, and some of its
        ops may not have run (a lease's sampler, an eviction). Those sequences are forgotten
        whole and the requests on them end; the step's saves to the host tier are lost."""
        for entry in saving:
            self.host.finish_save(entry, None)
        self._checkpointing.clear()
        self._restoring.clear()
        for seq in sorted(set(seqs)):
            sequence = self.sequences[seq]
            self._ops.append(RemoveTokens(seq, -1, -1))
            sequence.truncate(0)
            sequence.restoring = False
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
                sequence.checkpoints = checkpoints.up_to(sequence.checkpoints, keep)
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
        sequence.truncate(keep)
        self.cells.remove(sequence.seq, keep)

    def _plan_lease(self, generation: Generation) -> Lease:
        """The cached prefix that serves most of the prompt: a prompt in the KV pool that
        the new one extends is taken over; part of one (live or idle) is shared with
        seq_cp into a free sequence, so the cached prompt stays whole for its own return;
        one in the host-RAM tier is restored when that saves a real prefill. A state that
        cannot be cut back is restored from its checkpoint at the point it serves to."""
        prompt = generation.prompt
        if generation.prompt_top_logprobs is not None:  # every prompt token's logits
            return Lease(self._free_sequence(None), keep=0)
        source, keep = self._best_cached(prompt)
        host, host_keep = self._best_host(prompt)
        if host is not None and host_keep >= keep + MIN_USEFUL_PREFIX:
            checkpoint = self._cut_point(host.checkpoints, len(host.tokens), host_keep)
            data = self.host.take(host, host_keep)  # (before an eviction could drop it)
            return Lease(self._free_sequence(source), keep=host_keep, host=host, restore=data,
                         checkpoint=checkpoint)
        if source is None or keep == 0:
            return Lease(self._free_sequence(None), keep=0)
        checkpoint = self._cut_point(source.checkpoints, len(source.kv_tokens), keep)
        if source.generation is None and len(source.kv_tokens) - keep < MIN_USEFUL_PREFIX:
            return Lease(source, keep=keep, checkpoint=checkpoint)  # (little left behind)
        target = self._free_sequence(source)
        if target is source:  # no other sequence free: the cached prompt is cut back
            return Lease(source, keep=keep, checkpoint=checkpoint)
        return Lease(target, keep=keep, donor=source, checkpoint=checkpoint)

    def _cut_point(self, saved: Sequence[Checkpoint], length: int, keep: int
                   ) -> Checkpoint | None:
        """The checkpoint at `keep` that a state holding `length` tokens is cut back to,
        where only checkpoints cut it (None: it is cut as it is, or kept whole)."""
        if keep >= length or not self.checkpoints_on:
            return None
        checkpoint = checkpoints.newest_within(saved, keep)
        assert checkpoint is not None and checkpoint.n_tokens == keep  # (_reusable chose it)
        return checkpoint

    def _best_cached(self, prompt: Sequence[int]) -> tuple[KvSequence | None, int]:
        """The sequence (idle or busy) whose cache serves the longest prefix of `prompt`;
        among equals, an idle one, then the most recently used."""
        best: KvSequence | None = None
        best_key = (0, False, 0.0)
        for sequence in self.sequences:
            if sequence.restoring:
                continue  # (its restore has not run yet, and may fail)
            keep = self._reusable(sequence, prompt)
            key = (keep, sequence.generation is None, sequence.last_used)
            if keep and key > best_key:
                best, best_key = sequence, key
        return best, best_key[0]

    def _reusable(self, sequence: KvSequence, prompt: Sequence[int]) -> int:
        """How much of this sequence's cache the prompt can keep (one token must remain):
        all of an idle cache it extends; part of one, or a busy one's, only if it can be
        cut (or copied in part), and for a state that cannot be cut, as far as its
        newest checkpoint within the part in common."""
        if not sequence.kv_tokens:
            return 0
        keep = min(common_prefix_length(sequence.kv_tokens, prompt), len(prompt) - 1,
                   sequence.reusable_cache)
        if keep == len(sequence.kv_tokens) and sequence.generation is None:
            return keep  # (it extends the whole cache)
        keep = image_edge(prompt, keep)  # (cut or copied in part: at an image's edge)
        if self._can_cut(sequence) and not self.backend.info.is_recurrent:
            return keep
        return self._checkpoint_within(sequence.checkpoints, keep)

    def _checkpoint_within(self, saved: Sequence[Checkpoint], keep: int) -> int:
        """How far the newest of these checkpoints within `keep` tokens serves (0: none)."""
        if not self.checkpoints_on:
            return 0
        checkpoint = checkpoints.newest_within(saved, keep)
        return checkpoint.n_tokens if checkpoint is not None else 0

    def _best_host(self, prompt: Sequence[int]) -> tuple[HostEntry | None, int]:
        best: HostEntry | None = None
        best_keep = 0
        for entry in self.host.entries():
            keep = min(common_prefix_length(entry.tokens, prompt), len(prompt) - 1)
            if keep < len(entry.tokens):
                keep = image_edge(prompt, keep)
            if keep < len(entry.tokens) and self.backend.rewind_limit is not None:
                # (a cache that cannot be cut is restored whole, or to a checkpoint)
                keep = self._checkpoint_within(entry.checkpoints, keep)
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
        empty = [s for s in idle if not s.kv_tokens and not s.restoring]
        if empty:
            return empty[0]
        oldest = min(idle, key=lambda s: s.last_used)
        self._evict(oldest)
        return oldest

    def _lease(self, lease: Lease, generation: Generation) -> None:
        sequence, keep, checkpoint = lease.target, lease.keep, lease.checkpoint
        restoring = lease.host is not None or checkpoint is not None
        if lease.host is not None:
            self._forget(sequence)
            restore = b"" if checkpoint is None else checkpoint.data
            self._ops.append(RestoreSequence(sequence.seq, lease.restore, keep, restore))
            sequence.kv_tokens = list(lease.host.tokens[:keep])
            sequence.checkpoints = checkpoints.up_to(lease.host.checkpoints, keep)
            self.cells.extend(sequence.seq, keep)
        elif lease.donor is not None:
            self._forget(sequence)
            self._ops.append(CopyPrefix(lease.donor.seq, sequence.seq, keep))
            if checkpoint is not None:
                self._ops.append(RestoreCheckpoint(sequence.seq, checkpoint.data, keep))
            sequence.kv_tokens = list(generation.prompt[:keep])
            sequence.checkpoints = checkpoints.up_to(lease.donor.checkpoints, keep)
            self.cells.copy_prefix(lease.donor.seq, sequence.seq, keep)
        elif keep < len(sequence.kv_tokens):
            if keep == 0:
                self._forget(sequence)
            else:
                self._ops.append(RemoveTokens(sequence.seq, keep, -1) if checkpoint is None
                                 else RestoreCheckpoint(sequence.seq, checkpoint.data, keep))
                sequence.truncate(keep)
                self.cells.remove(sequence.seq, keep)
        if restoring:
            sequence.restoring = True
            self._restoring.append((sequence, sequence.lineage))
        if checkpoint is not None:
            self.checkpoint_stats.restored += 1
            self.checkpoint_stats.restored_tokens += keep
        sequence.exact_prefix = None  # what is left is exact again
        self.cells.set_live(sequence.seq, True)
        self._ops.append(SetSampler(sequence.seq, generation.params))
        generation.cached_tokens = keep
        generation.pending = generation.prompt[keep:]
        generation.leased_at = time.perf_counter()
        sequence.generation = generation
        self._plan_checkpoints(sequence, generation)
        generation._leased(restoring=restoring)

    def _plan_checkpoints(self, sequence: KvSequence, generation: Generation) -> None:
        if self.checkpoints_on:
            prompt = generation.prompt
            sequence.planned = [  # (a state is cut back to its checkpoint: at an image's edge)
                at for at in checkpoints.positions(len(prompt), len(sequence.kv_tokens),
                                                   self.prefill_chunk,
                                                   generation.checkpoint_hints)
                if image_edge(prompt, at) == at]

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
        if not self.host_tier:
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
        if self.host_tier and exact and not sequence.restoring and \
                self._unique_tokens(sequence) >= MIN_USEFUL_PREFIX:
            self._ops.append(SaveSequence(sequence.seq))
            self._saving.append(self.host.begin_save(sequence.kv_tokens, sequence.last_used,
                                                     sequence.checkpoints))
        self._forget(sequence)

    def _unique_tokens(self, sequence: KvSequence) -> int:
        tokens = sequence.kv_tokens
        shared = max((common_prefix_length(other.kv_tokens, tokens)
                      for other in self.sequences if other is not sequence), default=0)
        return len(tokens) - max(shared, self.host.longest_shared(tokens))

    def _forget(self, sequence: KvSequence) -> None:
        if sequence.kv_tokens:
            self._ops.append(RemoveTokens(sequence.seq, -1, -1))
        sequence.truncate(0)
        sequence.restoring = False  # (a restore queued before the removal changes nothing)
        self.cells.clear(sequence.seq)
        sequence.exact_prefix = None

    # ------------------------------------------------------------------ what it holds

    def cached_entries(self) -> int:
        return sum(1 for s in self.sequences if s.idle_cache)

    def host_stats(self) -> HostCacheStats | None:
        return self.host.stats() if self.host_tier else None

    def checkpoint_summary(self) -> CheckpointStats | None:
        """What the checkpoints did and hold now (None: this model takes none)."""
        if not self.checkpoints_on:
            return None
        held = list({id(c): c for c in [*self._pool_checkpoints(), *(
            c for entry in self.host.entries() for c in entry.checkpoints)]}.values())
        return attrs.evolve(self.checkpoint_stats, held=len(held),
                            bytes=sum(c.size for c in held))
