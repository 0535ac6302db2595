"""The engine: one step loop that owns the backend and batches every session.

Each iteration, between steps and only there, the loop detaches finished requests
from their sessions, attaches newly admitted requests to sessions (reusing or
sharing cached prefixes), plans one step, and runs it on the backend's own thread.
All session state changes in this one task, so a step in flight never races a
lease. Requests talk to the loop only through their state (RequestState: one method per
event moves it, along TRANSITIONS) and their output buffer.
"""

from __future__ import annotations

import bisect
import contextlib
import enum
import logging
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future
from contextlib import asynccontextmanager
from typing import Literal, TypeVar

import attrs
import trio

from butter.backends.base import (
    Backend,
    BackendError,
    CopyPrefix,
    KvOp,
    RemoveTokens,
    Restored,
    RestoreSequence,
    Sampled,
    Saved,
    SaveSequence,
    Scored,
    SeqWork,
    SetSampler,
    ShiftPositions,
    StepResult,
)
from butter.backends.team import TeamStatus
from butter.chat.request import Logprobs
from butter.engine.admission import Admission, Ticket
from butter.engine.cells import CellLedger
from butter.engine.drafting import (
    PROBE_EVERY,
    Acceptance,
    DraftOffer,
    PromptLookup,
    StepCosts,
    draft_lengths,
)
from butter.engine.host_cache import HostCache, HostCacheStats, HostEntry, common_prefix_length
from butter.engine.scheduler import PendingWork, PrefillBudget, plan_step
from butter.errors import ContextLengthExceeded
from butter.kv import KvWindow
from butter.sampling import SamplingParams

log = logging.getLogger("butter")

# How a generation ended, as the engine knows it: "aborted", the engine stopped under it
# (model swap or shutdown); `error` says why. (The wire's FinishReason, with "tool_calls",
# is butter/chat/request.py's, made from this by butter/pipeline/run.py.)
Ending = Literal["stop", "length", "error", "aborted"]


class RequestState(enum.Enum):
    """Where a request is in the engine."""

    QUEUED = "queued"  # admitted: waits for a KV sequence (a choice: for its prompt's)
    RESTORING = "restoring"  # has a sequence; its cached prefix loads from host RAM
    PREFILLING = "prefilling"  # the prompt's uncached tokens are evaluated, chunk by chunk
    DECODING = "decoding"  # it has sampled a token: one more per step
    CANCELLED = "cancelled"  # the client left or stopped reading: dropped at the next step
    FINISHED = "finished"  # ended (finish_reason says how); its output may still drain


_S = RequestState
# What may follow what. Any live state can end: the client leaves (CANCELLED), or the
# request stops, fails or is aborted (FINISHED); a cancelled one is finished when the
# engine drops it.
TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    _S.QUEUED: frozenset({_S.RESTORING, _S.PREFILLING, _S.CANCELLED, _S.FINISHED}),
    _S.RESTORING: frozenset({_S.PREFILLING, _S.CANCELLED, _S.FINISHED}),
    _S.PREFILLING: frozenset({_S.DECODING, _S.CANCELLED, _S.FINISHED}),
    _S.DECODING: frozenset({_S.CANCELLED, _S.FINISHED}),
    _S.CANCELLED: frozenset({_S.FINISHED}),
    _S.FINISHED: frozenset(),
}
# States whose request holds a KV sequence and has work for a step.
STEPPING = frozenset({_S.PREFILLING, _S.DECODING})


class IllegalTransition(Exception):
    """A request was moved along no edge of TRANSITIONS: a bug in the engine."""

# Upper bounds (seconds) of the step-time histogram exported on /metrics.
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# A request that does not name max_tokens reserves its completion in steps of this
# many cells, growing while the pool has room, instead of the whole context at once.
RESERVATION_STEP = 1024

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
# a restore is a memory copy (docs/architecture.md, "The prefix cache").
IDLE_DECODE_ROWS = 256


T = TypeVar("T")


async def _wait_for(future: Future[T]) -> T:
    """The result of a future running on another thread, without a trio worker thread.

    Like `trio.to_thread.run_sync`, the wait cannot be interrupted (not by a cancellation,
    not by Ctrl+C): a step in flight always finishes, since its KV writes must be recorded,
    and whatever interrupted it lands at the next checkpoint."""
    task = trio.lowlevel.current_task()
    token = trio.lowlevel.current_trio_token()

    def wake(_: Future[T]) -> None:  # on the backend's thread (or here, if already done)
        with contextlib.suppress(trio.RunFinishedError):  # (only if the loop is gone)
            token.run_sync_soon(trio.lowlevel.reschedule, task)

    future.add_done_callback(wake)
    await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)
    return future.result()


@attrs.define(eq=False)
class Generation:
    """One request inside the engine: its input, its progress, its output buffer."""

    prompt: tuple[int, ...]
    params: SamplingParams
    max_tokens: int
    ticket: Ticket
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: Ending | None = None
    error: str | None = None
    state: RequestState = RequestState.QUEUED
    pending: tuple[int, ...] = ()  # to evaluate next: the prompt's tokens, or the last sampled
    attached: trio.Event = attrs.field(factory=trio.Event)  # cached_tokens is known
    # The request's other choices: they join once this one's prompt is in the cache (at
    # the engine's next step, always the same one, so a seeded request is reproducible).
    followers: list[Generation] = attrs.field(factory=list)
    _pieces: list[bytes] = attrs.field(factory=list)
    _logprobs: list[Logprobs] = attrs.field(factory=list)  # when params.logprobs asks
    # Score the prompt (its tokens' logprobs with this many alternatives): then it is
    # evaluated whole, never reused from the cache, and max_tokens may be 0.
    score: int | None = None
    prompt_logprobs: list[Logprobs] = attrs.field(factory=list)  # of tokens 1 .. n-1
    # perf_counter() when it got its KV sequence, sampled its first token, ended: the
    # `timings` llama-server reports (prompt and generation speed, queueing left out).
    leased_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    # Speculative decoding: the prompt-lookup index of its tokens (built at its first
    # draft), how well its drafts hold, and its draft tokens verified and accepted.
    lookup: PromptLookup | None = None
    acceptance: Acceptance = attrs.field(factory=Acceptance)
    guess_acceptance: Acceptance = attrs.field(factory=Acceptance)  # the draft model's
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    _ready: trio.Event = attrs.field(factory=trio.Event)
    # Pieces pushed that are no generated token (the end token's logprob entry): in the
    # buffer now, and in the batch `pieces` yielded last.
    _uncounted: int = 0
    _batch_uncounted: int = 0
    stopped_by_output: bool = False  # a stop string ended it (stop_inside)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def prompt_evaluated(self) -> bool:
        """Its whole prompt is in the cache (it has sampled a token)."""
        return self.first_token_at is not None

    def _enter(self, state: RequestState) -> None:
        if state not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"a {self.state.value} request cannot become "
                                    f"{state.value}")
        self.state = state

    def _leased(self, *, restoring: bool) -> None:
        """It has a KV sequence: its prompt is evaluated next (after the restore)."""
        self._enter(RequestState.RESTORING if restoring else RequestState.PREFILLING)
        if not restoring:
            self.attached.set()

    def _restore_done(self) -> None:
        if self.state is RequestState.RESTORING:  # (not if it was cancelled meanwhile)
            self._enter(RequestState.PREFILLING)
        self.attached.set()

    def _sampled(self) -> None:
        if self.state is RequestState.PREFILLING:
            self._enter(RequestState.DECODING)
            self.first_token_at = time.perf_counter()

    async def pieces(self, *, heartbeat: float | None = None) -> AsyncIterator[list[bytes]]:
        """Batches of detokenized pieces as they come; ends when generation finishes.

        With `heartbeat`, an empty batch comes whenever that many seconds pass without
        output (a long prefill), so a stream can send keep-alive events.
        """
        while True:
            self._ready = trio.Event()
            if self._pieces:
                batch, self._pieces = self._pieces, []
                self._batch_uncounted, self._uncounted = self._uncounted, 0
                yield batch
                continue
            if self.finish_reason is not None:
                return
            with trio.move_on_after(heartbeat if heartbeat is not None else float("inf")):
                await self._ready.wait()
                continue
            yield []

    def close(self, reason: Ending | None = None) -> None:
        """Drop it at the next step: the client left (no reason), or its output ended it
        (a stop string: "stop"), which the request log then says."""
        if reason is not None:
            self._finish(reason)
        elif self.state not in (RequestState.CANCELLED, RequestState.FINISHED):
            self._enter(RequestState.CANCELLED)

    def stop_inside(self, unused: int) -> None:
        """Its output hit a stop string with the last `unused` pieces of the batch `pieces`
        yielded last after it: those tokens lie past the answer's end and are not counted,
        however far ahead of its reader the engine (or a verified draft) had run."""
        self.completion_tokens -= max(0, unused - self._batch_uncounted)
        self.stopped_by_output = True
        self.close("stop")

    def take_logprobs(self) -> list[Logprobs]:
        """The logprobs of the tokens whose pieces `pieces` yielded so far, not taken yet
        (read right after a batch: they are pushed together)."""
        taken, self._logprobs = self._logprobs, []
        return taken

    def _push(self, piece: bytes, logprobs: Logprobs | None = None, *,
              counted: bool = True) -> None:
        self._pieces.append(piece)
        self._uncounted += not counted
        if logprobs is not None:
            self._logprobs.append(logprobs)
        self._ready.set()

    def _finish(self, reason: Ending, error: str | None = None) -> None:
        if self.state is not RequestState.FINISHED:
            self._enter(RequestState.FINISHED)
        if self.finish_reason is None:
            self.finish_reason = reason
            self.error = error
            self.finished_at = time.perf_counter()
        self._ready.set()
        self.attached.set()  # a request that fails before its lease must not wait forever
        for follower in self.followers:  # never joined: they end the same way
            follower._finish(reason, error)
        self.followers = []


@attrs.define(eq=False)
class Session:
    """A KV sequence and what it holds; idle sessions keep their cache for reuse."""

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


@attrs.frozen
class EngineStats:
    active: int
    queued: int
    reserved_cells: int
    total_cells: int
    idle_cached_cells: int  # cells that only cached prefixes (no running request) hold
    slots: int
    steps: int
    session_cells: tuple[int, ...]  # cached positions per sequence (busy or idle)
    # Prompt tokens a step may carry while sessions decode (PrefillBudget), and at most.
    decoding_prefill_budget: int = 0
    prefill_chunk: int = 0
    # Totals over every request that ran (since the engine started):
    requests_done: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    prefix_hits: int = 0  # requests that reused a cached prefix of MIN_USEFUL_PREFIX or more
    prefix_misses: int = 0
    # The prefix cache now: prompts cached in the KV pool, the cells every sequence holds.
    cached_entries: int = 0
    used_cells: int = 0
    host: HostCacheStats | None = None  # the host-RAM tier (None: off)
    # Speculative decoding: draft tokens verified and accepted, the steps that verified
    # any, and each running request's acceptance estimate (by sequence).
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    draft_steps: int = 0
    acceptance: tuple[tuple[int, float], ...] = ()
    # The threads steps compute on, and what they see of the machine (None: MLX).
    threads: TeamStatus | None = None


class EngineStopped(Exception):
    """Raised to requests that wait for admission when the engine stops."""


@attrs.frozen(eq=False)
class Lease:
    """Where an admitted request's prompt goes, and which cached prefix it starts from."""

    target: Session
    keep: int  # prompt tokens served from the cache
    donor: Session | None = None  # shares its first `keep` positions (CopyPrefix)
    host: HostEntry | None = None  # restored from the host-RAM tier, cut to `keep`
    restore: bytes = attrs.field(default=b"", repr=False)  # its bytes, out of the tier


class Engine:
    def __init__(
        self, backend: Backend, *, parallel: int, max_context: int, prefill_chunk: int,
        max_queue: int, window: KvWindow | None = None, decode_stall: float = 0.0,
        cache_ram_bytes: int = 0, draft_max: int = 0,
    ) -> None:
        """`decode_stall`: while sessions decode, shrink prompt chunks so that a step
        carrying one takes about this long (seconds; 0: always `prefill_chunk`).
        `cache_ram_bytes`: the host-RAM tier's budget for evicted prefixes (0: none).
        `draft_max`: speculative decoding, at most this many draft tokens per session and
        step (0: off; the backend may allow fewer, see Backend.draft_rows)."""
        self.backend = backend
        self.window = window
        self.max_context = max_context
        self.prefill_budget = PrefillBudget(full=prefill_chunk, stall=decode_stall)
        self.admission = Admission(slots=parallel, cells=backend.n_cells, max_queue=max_queue)
        # Every sequence id the backend has: `parallel` of them generate at a time, and
        # any of them may hold a cached prefix while idle.
        n_seq = max(parallel, backend.n_seq + backend.n_cache_seqs)
        self._sessions = [Session(seq=i) for i in range(n_seq)]
        self._cells = CellLedger(shares_cells=backend.shares_prefix_cells)
        self._host = HostCache(cache_ram_bytes if backend.saves_sequences else 0)
        self._saving: list[HostEntry] = []  # in the order of this step's SaveSequence ops
        self._joining: list[Generation] = []
        self._ops: list[KvOp] = []
        self._wakeup = trio.Event()
        # Read by the server's readiness check: the loop is alive, and since when (a
        # time.perf_counter() value) the step in flight has been running, if any.
        self.running = False
        self.step_started: float | None = None
        self._steps = 0
        self._step_counts = [0] * (len(STEP_BUCKETS) + 1)  # the last bucket is +Inf
        self._step_seconds = 0.0
        self._decode_rows = 0  # decode rows evaluated since the engine started
        self._totals = dict.fromkeys(
            ("requests_done", "prompt_tokens", "cached_tokens", "completion_tokens",
             "prefix_hits", "prefix_misses", "drafted_tokens", "accepted_tokens",
             "draft_steps"), 0
        )
        self.draft_max = draft_max
        self.draft_rows = backend.draft_rows
        self.speculation_off = self._speculation_off()
        self._step_costs = StepCosts()  # of decode-only steps, by rows
        self._guess_cost = 0.0  # seconds the draft model takes per guessed token (measured)

    def _speculation_off(self) -> str | None:
        """Why this engine does not speculate (None: it does)."""
        if self.draft_max <= 0:
            return "turned off (--draft-max 0)"
        if self.backend.speculation_off is not None:
            return self.backend.speculation_off
        if self.draft_rows < 2:
            return "the backend computes no batch of two rows as it computes one"
        if self.window is not None:  # (a slide would cut into the draft's positions)
            return "not with a sliding KV window (--kv-window-size)"
        return None

    # ------------------------------------------------------------------ requests

    def completion_budget(self, prompt_tokens: int) -> int:
        return self.max_context - prompt_tokens

    @asynccontextmanager
    async def generate(
        self, prompt: Sequence[int], params: SamplingParams, max_tokens: int | None
    ) -> AsyncIterator[Generation]:
        """Admit (FIFO), run, and always release, whatever happens to the caller."""
        async with self.generate_choices(prompt, [params], max_tokens) as (generation,):
            yield generation

    @asynccontextmanager
    async def generate_choices(
        self, prompt: Sequence[int], params: Sequence[SamplingParams], max_tokens: int | None,
        *, score: int | None = None,
    ) -> AsyncIterator[list[Generation]]:
        """One generation per sampling parameters, from one prompt, admitted together.

        The prompt is prefilled once: the first choice joins alone, and the others join
        once its prompt is in the cache and share it from there (seq_cp), each then
        evaluating just the prompt's last token. Always released, whatever happens."""
        limit = max_tokens if max_tokens is not None else self.completion_budget(len(prompt))
        reserve = limit if max_tokens is not None else min(limit, RESERVATION_STEP)
        cells = len(prompt) + reserve
        if self.window is not None:
            if len(prompt) >= self.window.size:
                raise ContextLengthExceeded(
                    f"the prompt has {len(prompt)} tokens but the KV window holds "
                    f"{self.window.size} (--kv-window-size)", param="messages")
            cells = min(cells, self.window.size)  # a sliding session never holds more
        tickets = await self.admission.acquire_many(cells, len(params))
        generations = [
            Generation(prompt=tuple(prompt), params=choice, max_tokens=limit, ticket=ticket)
            for choice, ticket in zip(params, tickets, strict=True)
        ]
        generations[0].followers = generations[1:]
        generations[0].score = score  # (the others share its prompt: scored once)
        try:
            self._joining.append(generations[0])
            self._wake()
            yield generations
        finally:
            for generation in generations:
                generation.close()
                self.admission.release(generation.ticket)
            self._wake()

    def check_queue_room(self) -> None:
        """Overloaded (503) when a new request could not even wait: before a stream's
        headers go out, since afterwards the refusal could only be an error event."""
        self.admission.check_queue_room()

    def limit_slots(self, slots: int) -> None:
        """Run at most this many requests at once (at most the sessions loaded)."""
        self.admission.slots = slots

    def stats(self) -> EngineStats:
        admission = self.admission.stats()
        return EngineStats(
            active=admission.active, queued=admission.queued,
            reserved_cells=admission.reserved_cells, total_cells=admission.total_cells,
            idle_cached_cells=self._cells.idle_only,
            slots=admission.slots, steps=self._steps,
            session_cells=tuple(len(s.kv_tokens) for s in self._sessions),
            decoding_prefill_budget=self.prefill_budget.decoding_budget,
            prefill_chunk=self.prefill_budget.full,
            cached_entries=sum(1 for s in self._sessions if s.generation is None and s.kv_tokens),
            used_cells=self._cells.used,
            host=self._host.stats() if self._host.enabled else None,
            acceptance=tuple(
                (s.seq, round(s.generation.acceptance.rate, 3)) for s in self._sessions
                if s.generation is not None and s.generation.lookup is not None),
            threads=self.backend.team(),
            **self._totals,
        )

    def drop_idle_caches(self) -> None:
        """Forget every cached prefix, in the KV pool and in host RAM (applied before the
        next step)."""
        for session in self._sessions:
            if session.generation is None:
                self._forget(session)
        self._host.clear()
        self._wake()

    def _wake(self) -> None:
        self._wakeup.set()

    # ------------------------------------------------------------------ the loop

    async def run(self) -> None:
        """The step loop; runs until cancelled (model unload or shutdown)."""
        self.running = True
        try:
            while True:
                self._detach_closed()
                self._attach_joining()
                self._age_out_idle()
                self._slide_windows()
                pending = self._with_drafts(self._pending_work())
                decoding = any(p.decoding and p.pending for p in pending)
                works = plan_step(pending, self.prefill_budget.for_step(decoding),
                                  self.backend.prompt_tile)
                if not works and not self._ops:
                    await self._wakeup.wait()
                    self._wakeup = trio.Event()
                    continue
                await self._step(works)
        finally:
            self.running = False
            self.abort_all("the model was unloaded")

    async def _step(self, works: list[SeqWork]) -> None:
        ops, self._ops = self._ops, []
        saving, self._saving = self._saving, []
        guessing = self.backend.guess_seconds
        started = self.step_started = time.perf_counter()
        try:
            sampled = await _wait_for(self.backend.submit_step(ops, works))
        except BackendError as exc:
            self._fail_step(works, ops, saving, str(exc))
            return
        except Exception as exc:  # a bug in a backend fails this step's requests, not all
            log.exception("engine step failed")
            self._fail_step(works, ops, saving, f"internal error in the engine step: {exc!r}")
            return
        finally:
            self.step_started = None
        seconds = time.perf_counter() - started
        self._observe_step(seconds)
        # (a draft's rows walk the pool as any decode row does)
        self._decode_rows += sum(len(w.tokens) + w.guess for w in works if not w.prompt)
        if self.speculation_off is None and works and not any(w.prompt for w in works):
            self._observe_costs(works, seconds, self.backend.guess_seconds - guessing)
        if self.prefill_budget.adapts:  # (off by default: no counting on every step)
            self.prefill_budget.observe(
                prompt_tokens=sum(len(w.tokens) for w in works if w.prompt),
                decode_rows=sum(1 for w in works if not w.prompt), seconds=seconds,
            )
        self._record_kv_outcomes(sampled, saving)
        self._totals["draft_steps"] += any(work.drafted or work.guess for work in works)
        self._record(works, sampled)

    def _observe_costs(self, works: list[SeqWork], seconds: float, guessing: float) -> None:
        """A decode-only step's cost by rows, less the draft model's guessing (measured
        apart, per guessed token)."""
        guessed = sum(work.guess for work in works)
        if guessed:
            per_token = guessing / guessed
            self._guess_cost = per_token if not self._guess_cost else \
                self._guess_cost + 0.2 * (per_token - self._guess_cost)
        rows = sum(len(work.tokens) + work.guess for work in works)
        self._step_costs.observe(rows, seconds - guessing)

    def _slide_windows(self) -> None:
        """Drop the oldest positions after the sinks of sessions about to overflow."""
        window = self.window
        if window is None:
            return
        for session in self._sessions:
            generation = session.generation
            if generation is None or generation.state is not RequestState.DECODING:
                continue
            drop = window.overflow(len(session.kv_tokens), len(generation.pending))
            if drop:
                keep = window.keep
                self._ops.append(RemoveTokens(session.seq, keep, keep + drop))
                self._ops.append(ShiftPositions(session.seq, keep + drop, -drop))
                del session.kv_tokens[keep:keep + drop]
                self._cells.remove(session.seq, keep, keep + drop)
                session.exact_prefix = min(keep, session.exact_prefix or keep)

    def _observe_step(self, seconds: float) -> None:
        self._steps += 1
        self._step_seconds += seconds
        self._step_counts[bisect.bisect_left(STEP_BUCKETS, seconds)] += 1  # first bound >= it

    def step_histogram(self) -> tuple[list[tuple[str, int]], float]:
        """Cumulative (upper bound, count) buckets and the sum, Prometheus-style."""
        buckets, running = [], 0
        for bound, count in zip([*map(str, STEP_BUCKETS), "+Inf"], self._step_counts,
                                strict=True):
            running += count
            buckets.append((bound, running))
        return buckets, self._step_seconds

    def _pending_work(self) -> list[PendingWork]:
        return [
            PendingWork(
                seq=s.seq, start=len(s.kv_tokens), pending=s.generation.pending,
                decoding=s.generation.state is RequestState.DECODING, score=s.generation.score,
            )
            for s in self._sessions
            if s.generation is not None and s.generation.state in STEPPING
        ]

    def _with_drafts(self, pending: list[PendingWork]) -> list[PendingWork]:
        """The decoding sessions' drafts for this step (speculative decoding): only in a
        step of decodes alone (a prompt chunk leaves it no spare width), and only as many
        rows as pay for themselves (drafting.draft_lengths)."""
        if self.speculation_off is not None or not pending or \
                len(pending) >= self.draft_rows or any(not p.decoding for p in pending):
            return pending  # (no spare width: not even a probe fits)
        sessions = [self._sessions[p.seq] for p in pending]
        offers = [self._offer(session) for session in sessions]
        if not any(offer.proposal for offer, _ in offers):
            return pending
        lengths = draft_lengths([offer for offer, _ in offers], len(pending),
                                self.draft_rows, self._step_costs)
        drafted: list[PendingWork] = []
        for work, session, (offer, estimate), length in zip(pending, sessions, offers,
                                                            lengths, strict=True):
            if offer.proposal and not length:
                estimate.steps_without += 1
            if not length:
                drafted.append(work)
            elif offer.guessed:
                drafted.append(attrs.evolve(work, guess=length, history=session.kv_tokens))
            else:
                drafted.append(attrs.evolve(work, draft=offer.proposal[:length]))
        return drafted

    def _offer(self, session: Session) -> tuple[DraftOffer, Acceptance]:
        """What a decoding request proposes, cut to what its max_tokens and its reserved
        cells leave room for: the prompt lookup's continuation, else as many guesses of
        the draft model (if one is loaded); and the estimate its drafts are judged by."""
        generation = session.generation
        assert generation is not None  # (a stepping session's)
        room = min(self.draft_max, generation.max_tokens - generation.completion_tokens - 1,
                   generation.ticket.cells - generation.prompt_tokens
                   - generation.completion_tokens)
        if generation.score is not None or room <= 0:
            return DraftOffer((), 0.0), generation.acceptance
        lookup = generation.lookup
        history = session.kv_tokens
        if lookup is None:
            lookup = generation.lookup = PromptLookup(history)
        elif len(lookup) < len(history):
            lookup.extend(history[len(lookup):])
        lookup.extend(generation.pending)
        proposal = lookup.propose(room)
        if not proposal and self.backend.guesses:  # (its tokens are made in the step)
            estimate = generation.guess_acceptance
            return DraftOffer((0,) * room, estimate.rate,
                              probe=estimate.steps_without >= PROBE_EVERY,
                              token_cost=self._guess_cost, guessed=True), estimate
        estimate = generation.acceptance
        offer = DraftOffer(proposal, estimate.rate, probe=estimate.steps_without >= PROBE_EVERY)
        return offer, estimate

    def _record_kv_outcomes(self, results: list[StepResult], saving: list[HostEntry]) -> None:
        """The step's saves go to the host tier; a failed restore prefills instead."""
        saves = iter(saving)
        for outcome in results:
            if isinstance(outcome, Saved):
                self._host.finish_save(next(saves), outcome.data)
            elif isinstance(outcome, Restored):
                self._restored(self._sessions[outcome.seq], outcome.ok)

    def _restored(self, session: Session, ok: bool) -> None:
        generation = session.generation
        if not ok:
            log.warning("a host-RAM prefix could not be restored into seq %d; prefilling it",
                        session.seq)
            session.kv_tokens.clear()  # (the backend emptied the sequence)
            self._cells.clear(session.seq)
            if generation is not None:
                generation.cached_tokens = 0
                generation.pending = generation.prompt
        if generation is not None:
            generation._restore_done()

    def _record(self, works: list[SeqWork], results: list[StepResult]) -> None:
        by_seq: dict[int, list[Sampled]] = {}
        for result in results:
            if isinstance(result, Sampled):
                by_seq.setdefault(result.seq, []).append(result)
            elif isinstance(result, Scored):
                scorer = self._sessions[result.seq].generation
                if scorer is not None:
                    scorer.prompt_logprobs.extend(result.logprobs)
        for work in works:
            session = self._sessions[work.seq]
            sampled = by_seq.get(work.seq, [])
            # In the cache now, whoever asked: of a draft, the tokens its samples kept (each
            # kept draft token is the sample before it)
            drafted = work.drafted or work.guess
            tokens = work.tokens
            if drafted:
                tokens = (*work.tokens[:1], *(one.token for one in sampled[:-1]))
            session.kv_tokens.extend(tokens)
            self._cells.extend(work.seq, len(tokens))
            generation = session.generation
            if generation is None or generation.state not in STEPPING:
                continue
            generation.pending = generation.pending[len(work.tokens):]
            if drafted:
                estimate = generation.guess_acceptance if work.guess else generation.acceptance
                self._count_draft(generation, estimate, drafted, accepted=len(tokens) - 1)
            for one in sampled:
                if generation.state not in STEPPING:  # (it ended inside the draft)
                    break
                self._accept(generation, one)

    def _count_draft(self, generation: Generation, estimate: Acceptance, drafted: int, *,
                     accepted: int) -> None:
        estimate.observe(drafted, accepted)
        generation.drafted_tokens += drafted
        generation.accepted_tokens += accepted
        self._totals["drafted_tokens"] += drafted
        self._totals["accepted_tokens"] += accepted

    def _accept(self, generation: Generation, sampled: Sampled) -> None:
        generation._sampled()
        if generation.followers:  # its prompt is in the cache now: they can share it
            self._joining.extend(generation.followers)
            generation.followers = []
        if sampled.error is not None:
            generation._finish("error", sampled.error)
            return
        if generation.max_tokens == 0:  # a prompt scored, nothing generated
            generation._finish("length")
            return
        if sampled.end_of_generation:
            if sampled.logprobs is not None:  # the end token was sampled too: its logprob
                generation._push(b"", sampled.logprobs, counted=False)  # (an echo's last entry)
            generation._finish("stop")
            return
        generation.completion_tokens += 1
        generation._push(sampled.piece, sampled.logprobs)
        generation.pending = (sampled.token,)
        if generation.completion_tokens >= generation.max_tokens:
            generation._finish("length")
        elif not self._has_room_for_next(generation):
            generation._finish("length")

    def _has_room_for_next(self, generation: Generation) -> bool:
        used = generation.prompt_tokens + generation.completion_tokens
        if self.window is not None:
            used = min(used, self.window.size)
        if used < generation.ticket.cells:
            return True
        step = min(RESERVATION_STEP, generation.max_tokens - generation.completion_tokens)
        if not self.admission.try_extend(generation.ticket, step):
            return False
        self._make_room(0, None)  # cached prompts may hold the cells it grows into
        return True

    def _fail_step(self, works: list[SeqWork], ops: list[KvOp], saving: list[HostEntry],
                   message: str) -> None:
        # The state of every sequence the step touched is unknown, and some of its ops may
        # not have run (a lease's sampler, an eviction): forget those sequences whole, and
        # end the requests on them. Its saves to the host tier are lost.
        for entry in saving:
            self._host.finish_save(entry, None)
        touched = {work.seq for work in works} | {
            op.dst if isinstance(op, CopyPrefix) else op.seq for op in ops}
        for seq in sorted(touched):
            session = self._sessions[seq]
            self._ops.append(RemoveTokens(session.seq, -1, -1))
            session.kv_tokens.clear()
            self._cells.clear(seq)
            if session.generation is not None:
                session.generation._finish("error", message)

    def abort_all(self, message: str) -> None:
        """End every request, queued or running, with finish reason "aborted"."""
        self.admission.close(EngineStopped(message))
        for generation in self._joining:
            generation._finish("aborted", message)
        for session in self._sessions:
            if session.generation is not None:
                session.generation._finish("aborted", message)

    # ------------------------------------------------------------------ leasing

    def _detach_closed(self) -> None:
        now = time.monotonic()
        for session in self._sessions:
            generation = session.generation
            if generation is not None and generation.state in (RequestState.CANCELLED,
                                                                RequestState.FINISHED):
                generation._finish("stop")  # no-op unless the client stopped it
                if generation.stopped_by_output:
                    self._cut_to_answer(session, generation)
                session.generation = None
                session.last_used = now
                session.idle_since_row = self._decode_rows
                self._cells.set_live(session.seq, False)  # a cached prefix from now on
                # Free the slot now, not when the HTTP response is fully written: a
                # client that stops reading must not pin a session slot.
                self.admission.release(generation.ticket)
                self._count(generation)

    def _cut_to_answer(self, session: Session, generation: Generation) -> None:
        """Forget the tokens generated past a stop string: what the client never saw cannot
        return in its next prompt, and the cache is then the same however far ahead of the
        reader the engine had run (drafts run further)."""
        keep = generation.prompt_tokens + max(0, generation.completion_tokens - 1)
        if keep >= len(session.kv_tokens) or not self._can_cut(session) or \
                self.backend.info.is_recurrent:
            return
        self._ops.append(RemoveTokens(session.seq, keep, -1))
        del session.kv_tokens[keep:]
        self._cells.remove(session.seq, keep)

    def _count(self, generation: Generation) -> None:
        self._totals["requests_done"] += 1
        self._totals["prompt_tokens"] += generation.prompt_tokens
        self._totals["cached_tokens"] += generation.cached_tokens
        self._totals["completion_tokens"] += generation.completion_tokens
        hit = generation.cached_tokens >= MIN_USEFUL_PREFIX
        self._totals["prefix_hits" if hit else "prefix_misses"] += 1

    def _attach_joining(self) -> None:
        while self._joining:
            generation = self._joining.pop(0)
            if generation.state is not RequestState.QUEUED:  # cancelled, or aborted
                continue
            lease = self._plan_lease(generation)
            if lease.host is not None:  # its cells appear before the cut: room first
                self._make_room(len(lease.host.tokens) - lease.keep, lease.target)
                self._lease(lease, generation)
            else:
                self._lease(lease, generation)
                self._make_room(0, lease.target)

    def _plan_lease(self, generation: Generation) -> Lease:
        """The cached prefix that serves most of the prompt: a prompt in the KV pool that
        the new one extends is taken over; part of one (live or idle) is shared with
        seq_cp into a free sequence, so the cached prompt stays whole for its own return;
        one in the host-RAM tier is restored when that saves a real prefill."""
        prompt = generation.prompt
        if generation.score is not None:  # every prompt token's logits are needed
            return Lease(self._free_session(None), keep=0)
        source, keep = self._best_cached(prompt)
        host, host_keep = self._best_host(prompt)
        if host is not None and host_keep >= keep + MIN_USEFUL_PREFIX:
            data = self._host.take(host, host_keep)  # (before an eviction could drop it)
            return Lease(self._free_session(source), keep=host_keep, host=host, restore=data)
        if source is None or keep == 0:
            return Lease(self._free_session(None), keep=0)
        if source.generation is None and len(source.kv_tokens) - keep < MIN_USEFUL_PREFIX:
            return Lease(source, keep=keep)  # extends it, or leaves little of it behind
        target = self._free_session(source)
        if target is source:  # no other sequence free: the cached prompt is cut back
            return Lease(source, keep=keep)
        return Lease(target, keep=keep, donor=source)

    def _best_cached(self, prompt: Sequence[int]) -> tuple[Session | None, int]:
        """The sequence (idle or busy) whose cache serves the longest prefix of `prompt`;
        among equals, an idle one, then the most recently used."""
        best: Session | None = None
        best_key = (0, False, 0.0)
        for session in self._sessions:
            if session.generation is not None and \
                    session.generation.state is RequestState.RESTORING:
                continue  # (its restore has not run yet, and may fail)
            keep = self._reusable(session, prompt)
            key = (keep, session.generation is None, session.last_used)
            if keep and key > best_key:
                best, best_key = session, key
        return best, best_key[0]

    def _reusable(self, session: Session, prompt: Sequence[int]) -> int:
        """How much of this sequence's cache the prompt can keep (one token must remain):
        all of an idle cache it extends; part of one, or a busy one's, only if it can be
        cut (or copied in part)."""
        if not session.kv_tokens:
            return 0
        keep = min(common_prefix_length(session.kv_tokens, prompt), len(prompt) - 1,
                   session.reusable_cache)
        whole = keep == len(session.kv_tokens) and session.generation is None
        if not whole and not (self._can_cut(session) and not self.backend.info.is_recurrent):
            return 0
        return keep

    def _best_host(self, prompt: Sequence[int]) -> tuple[HostEntry | None, int]:
        best: HostEntry | None = None
        best_keep = 0
        for entry in self._host.entries():
            keep = min(common_prefix_length(entry.tokens, prompt), len(prompt) - 1)
            if keep < len(entry.tokens) and self.backend.rewind_limit is not None:
                continue  # (a cache that cannot be cut is only restored whole)
            if keep > best_keep:
                best, best_keep = entry, keep
        return best, best_keep

    def _can_cut(self, session: Session) -> bool:
        """Whether this session's cache can be cut back (or copied in part): not recurrent
        state, nor a sliding-window cache that has wrapped around (backend.rewind_limit)."""
        limit = self.backend.rewind_limit
        return limit is None or len(session.kv_tokens) < limit

    def _free_session(self, keep: Session | None) -> Session:
        """An idle sequence for a new prompt: an empty one, else the least recently used
        cached prompt other than `keep` gives its place (to the host tier if it is worth
        it); `keep` itself only if there is no other."""
        idle = [s for s in self._sessions if s.generation is None and s is not keep]
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
        session, keep = lease.target, lease.keep
        if lease.host is not None:
            self._forget(session)
            self._ops.append(RestoreSequence(session.seq, lease.restore, keep))
            session.kv_tokens = list(lease.host.tokens[:keep])
            self._cells.extend(session.seq, keep)
        elif lease.donor is not None:
            self._forget(session)
            self._ops.append(CopyPrefix(lease.donor.seq, session.seq, keep))
            session.kv_tokens = list(generation.prompt[:keep])
            self._cells.copy_prefix(lease.donor.seq, session.seq, keep)
        elif keep < len(session.kv_tokens):
            if keep == 0:
                self._forget(session)
            else:
                self._ops.append(RemoveTokens(session.seq, keep, -1))
                del session.kv_tokens[keep:]
                self._cells.remove(session.seq, keep)
        session.exact_prefix = None  # what is left is exact again
        self._cells.set_live(session.seq, True)
        self._ops.append(SetSampler(session.seq, generation.params))
        generation.cached_tokens = keep
        generation.pending = generation.prompt[keep:]
        generation.leased_at = time.perf_counter()
        session.generation = generation
        generation._leased(restoring=lease.host is not None)

    def _make_room(self, extra: int, protect: Session | None) -> None:
        """Cached prefixes give way, least recently used first, until the live
        reservations, the cells only cached prefixes hold, and `extra` fit in the pool."""
        reserved = self.admission.stats().reserved_cells
        idle = sorted((s for s in self._sessions
                       if s.generation is None and s.kv_tokens and s is not protect),
                      key=lambda s: s.last_used)
        for session in idle:
            if reserved + self._cells.idle_only + extra <= self.backend.n_cells:
                return
            self._evict(session)

    def _age_out_idle(self) -> None:
        """Cached prompts left idle through IDLE_DECODE_ROWS decode rows go to host RAM."""
        if not self._host.enabled:
            return  # (without the tier, keeping them is the only way to keep them)
        for session in self._sessions:
            idle_rows = self._decode_rows - session.idle_since_row
            if session.generation is None and session.kv_tokens and \
                    idle_rows >= IDLE_DECODE_ROWS:
                self._evict(session)

    def _evict(self, session: Session) -> None:
        """Drop a cached prompt from the KV pool, saving it to the host tier first if it
        holds enough that no other cached prompt does."""
        exact = session.exact_prefix is None  # (a slid window's cache is no prefix)
        if self._host.enabled and exact and self._unique_tokens(session) >= MIN_USEFUL_PREFIX:
            self._ops.append(SaveSequence(session.seq))
            self._saving.append(self._host.begin_save(session.kv_tokens, session.last_used))
        self._forget(session)

    def _unique_tokens(self, session: Session) -> int:
        tokens = session.kv_tokens
        shared = max((common_prefix_length(other.kv_tokens, tokens)
                      for other in self._sessions if other is not session), default=0)
        return len(tokens) - max(shared, self._host.longest_shared(tokens))

    def _forget(self, session: Session) -> None:
        if session.kv_tokens:
            self._ops.append(RemoveTokens(session.seq, -1, -1))
            session.kv_tokens.clear()
        self._cells.clear(session.seq)
        session.exact_prefix = None
