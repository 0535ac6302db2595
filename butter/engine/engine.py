"""The engine: one step loop that owns the backend and batches every request.

Each iteration, between steps and only there, the loop detaches ended requests from their
KV sequences, attaches newly admitted ones (the prefix cache picks the sequence and the
cached prefix), plans one step and runs it on the backend's own thread. Every sequence's
state changes in this one task, so a step in flight never races a lease. Requests talk to
the loop only through their Generation (its state and its output buffer).

The nouns live apart: a request in generation.py, admission's FIFO and reservations in
admission.py, the sequences and what they cache in prefix_cache.py, the step's plan in
step_plan.py, speculation in drafting.py, counters in stats.py.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future
from contextlib import asynccontextmanager
from typing import TypeVar

import attrs
import trio

from butter.backends.base import (
    Backend,
    BackendError,
    CopyPrefix,
    KvOp,
    PromptImage,
    Sampled,
    Scored,
    SeqWork,
    StepResult,
)
from butter.engine.admission import Admission
from butter.engine.drafting import Speculation
from butter.engine.generation import HAS_STEP_WORK, Generation, RequestState
from butter.engine.host_cache import HostEntry
from butter.engine.prefix_cache import PrefixCache
from butter.engine.stats import EngineStats, StepTimes, Totals
from butter.engine.step_plan import PendingWork, PrefillBudget, plan_step
from butter.errors import ContextLengthExceeded, InvalidRequest
from butter.kv import KvWindow
from butter.sampling import SamplingParams
from butter.settings import DEFAULT_CHECKPOINTS_PER_SEQUENCE

log = logging.getLogger("butter")

# A request that does not name max_tokens reserves its completion in steps of this
# many cells, growing while the pool has room, instead of the whole context at once.
RESERVATION_STEP = 1024


class EngineStopped(Exception):
    """Raised to requests that wait for admission when the engine stops."""


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



class Engine:
    def __init__(
        self, backend: Backend, *, parallel: int, max_context: int, prefill_chunk: int,
        max_queue: int, window: KvWindow | None = None, decode_stall: float = 0.0,
        cache_ram_bytes: int = 0, draft_max: int = 0,
        checkpoints_per_sequence: int = DEFAULT_CHECKPOINTS_PER_SEQUENCE,
    ) -> None:
        """`decode_stall`: while sequences decode, shrink prompt chunks so that a step
        carrying one takes about this long (seconds; 0: always `prefill_chunk`).
        `cache_ram_bytes`: the host-RAM tier's budget for evicted prefixes and for
        checkpoints (0: none of either). `checkpoints_per_sequence`: a recurrent or hybrid
        model's checkpoints kept per cached prompt (PrefixCache).
        `draft_max`: speculative decoding, at most this many draft tokens per request and
        step (0: off; the backend may allow fewer, see Backend.draft_rows)."""
        self.backend = backend
        self.window = window
        self.max_context = max_context
        self.prefill_budget = PrefillBudget(full=prefill_chunk, stall=decode_stall)
        self.admission = Admission(slots=parallel, cells=backend.n_cells, max_queue=max_queue)
        # Every sequence id the backend has: `parallel` of them generate at a time, and
        # any of them may hold a cached prefix while idle.
        self.cache = PrefixCache(backend, n_seq=max(parallel, backend.n_seq + backend.n_cache_seqs),
                                 cache_ram_bytes=cache_ram_bytes,
                                 checkpoints_per_sequence=checkpoints_per_sequence,
                                 prefill_chunk=prefill_chunk)
        self.speculation = Speculation(backend, draft_max=draft_max, window=window)
        self._joining: list[Generation] = []
        self._wakeup = trio.Event()
        # Read by the server's readiness check: the loop is alive, and since when (a
        # time.perf_counter() value) the step in flight has been running, if any.
        self.running = False
        self.step_started: float | None = None
        self._step_times = StepTimes()
        self._totals = Totals()
        self._decode_rows = 0  # decode rows evaluated since the engine started

    @property
    def speculation_off(self) -> str | None:
        """Why this engine does not speculate (None: it does)."""
        return self.speculation.off

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
        *, prompt_top_logprobs: int | None = None, checkpoint_hints: Sequence[int] = (),
        images: Sequence[PromptImage] = (),
    ) -> AsyncIterator[list[Generation]]:
        """One generation per sampling parameters, from one prompt, admitted together.

        The prompt is prefilled once: the first choice joins alone, and the others join
        once its prompt is in the cache and share it from there (seq_cp), each then
        evaluating just the prompt's last token. `prompt_top_logprobs`: score the prompt
        (each token's logprob with this many alternatives). `checkpoint_hints`: prompt
        positions where a later prompt is likely to diverge (message starts), for models
        whose state is cut back only at checkpoints. `images`: where the prompt holds
        images (Backend.tokenize_media). Always released."""
        if not prompt:  # (nothing to evaluate: it would hold its sequence forever)
            raise InvalidRequest("the prompt has no tokens", param="prompt")
        limit = max_tokens if max_tokens is not None else self.completion_budget(len(prompt))
        reserve = limit if max_tokens is not None else min(limit, RESERVATION_STEP)
        cells = len(prompt) + reserve
        if self.window is not None:
            if len(prompt) >= self.window.size:
                raise ContextLengthExceeded(
                    f"the prompt has {len(prompt)} tokens but the KV window holds "
                    f"{self.window.size} (--kv-window-size)", param="messages")
            cells = min(cells, self.window.size)  # a sliding sequence never holds more
        tickets = await self.admission.acquire_many(cells, len(params))
        generations = [
            Generation(prompt=tuple(prompt), params=choice, max_tokens=limit, ticket=ticket,
                       checkpoint_hints=tuple(checkpoint_hints), images=tuple(images))
            for choice, ticket in zip(params, tickets, strict=True)
        ]
        generations[0].followers = generations[1:]
        # (the others share its prompt: scored once)
        generations[0].prompt_top_logprobs = prompt_top_logprobs
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
        """Run at most this many requests at once (at most the sequences loaded)."""
        self.admission.slots = slots

    def stats(self) -> EngineStats:
        admission = self.admission.stats()
        cache = self.cache
        return EngineStats(
            active=admission.active, queued=admission.queued,
            reserved_cells=admission.reserved_cells, total_cells=admission.total_cells,
            idle_cached_cells=cache.cells.idle_only,
            slots=admission.slots, steps=self._step_times.steps,
            session_cells=tuple(len(s.kv_tokens) for s in cache.sequences),
            decoding_prefill_budget=self.prefill_budget.decoding_budget,
            prefill_chunk=self.prefill_budget.full,
            cached_entries=cache.cached_entries(),
            used_cells=cache.cells.used,
            host=cache.host_stats(),
            checkpoints=cache.checkpoint_summary(),
            acceptance=tuple(
                (s.seq, round(s.generation.acceptance.rate, 3)) for s in cache.sequences
                if s.generation is not None and s.generation.lookup is not None),
            threads=self.backend.team(),
            **attrs.asdict(self._totals),
        )

    def step_histogram(self) -> tuple[list[tuple[str, int]], float]:
        """Cumulative (upper bound, count) buckets and the sum, Prometheus-style."""
        return self._step_times.histogram()

    def drop_idle_caches(self) -> None:
        """Forget every cached prefix, in the KV pool and in host RAM (applied before the
        next step)."""
        self.cache.drop_idle()
        self._wake()

    def abort_all(self, message: str) -> None:
        """End every request, queued or running, with finish reason "aborted"."""
        self.admission.close(EngineStopped(message))
        for generation in self._joining:
            generation._finish("aborted", message)
        for sequence in self.cache.sequences:
            if sequence.generation is not None:
                sequence.generation._finish("aborted", message)

    def _wake(self) -> None:
        self._wakeup.set()

    # ------------------------------------------------------------------ the loop

    async def step_loop(self) -> None:
        """The step loop; runs until cancelled (model unload or shutdown)."""
        self.running = True
        try:
            while True:
                self._detach_ended()
                self._attach_joining()
                self.cache.age_out_idle(self._decode_rows)
                if self.window is not None:
                    self.cache.slide(self.window)
                pending = self.speculation.with_drafts(self._pending_work(),
                                                       self.cache.sequences)
                decoding = any(p.decoding and p.pending for p in pending)
                works = plan_step(pending, self.prefill_budget.for_step(decoding),
                                  self.backend.prompt_tile)
                if not works and not self.cache.has_ops:
                    await self._wakeup.wait()
                    self._wakeup = trio.Event()
                    continue
                await self._step(works)
        finally:
            self.running = False
            self.abort_all("the model was unloaded")

    def _pending_work(self) -> list[PendingWork]:
        return [
            PendingWork(
                seq=s.seq, start=len(s.kv_tokens), pending=s.generation.pending,
                decoding=s.generation.state is RequestState.DECODING,
                prompt_top_logprobs=s.generation.prompt_top_logprobs,
                stop=s.tokens_to_next_checkpoint(), images=s.generation.images,
            )
            for s in self.cache.sequences
            if s.generation is not None and s.generation.state in HAS_STEP_WORK
        ]

    async def _step(self, works: list[SeqWork]) -> None:
        ops, saving = self.cache.take_ops()
        guessing = self.backend.guess_seconds
        started = self.step_started = time.perf_counter()
        try:
            results = await _wait_for(self.backend.submit_step(ops, works))
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
        self._step_times.observe(seconds)
        # (a draft's rows walk the pool as any decode row does)
        self._decode_rows += sum(len(w.tokens) + w.guess for w in works if not w.prompt)
        self.speculation.observe_step(works, seconds, self.backend.guess_seconds - guessing)
        if self.prefill_budget.adapts:  # (off by default: no counting on every step)
            self.prefill_budget.observe(
                prompt_tokens=sum(len(w.tokens) for w in works if w.prompt),
                decode_rows=sum(1 for w in works if not w.prompt), seconds=seconds,
            )
        self.cache.record_kv_outcomes(results, saving)
        self._totals.draft_steps += any(work.drafted or work.guess for work in works)
        self._record(works, results)

    def _fail_step(self, works: list[SeqWork], ops: list[KvOp], saving: list[HostEntry],
                   message: str) -> None:
        touched = {work.seq for work in works} | {
            op.dst if isinstance(op, CopyPrefix) else op.seq for op in ops}
        self.cache.step_failed(touched, saving, message)

    def _record(self, works: list[SeqWork], results: list[StepResult]) -> None:
        by_seq: dict[int, list[Sampled]] = {}
        for result in results:
            if isinstance(result, Sampled):
                by_seq.setdefault(result.seq, []).append(result)
            elif isinstance(result, Scored):
                scorer = self.cache.sequences[result.seq].generation
                if scorer is not None:
                    scorer.prompt_logprobs.extend(result.logprobs)
        for work in works:
            sampled = by_seq.get(work.seq, [])
            # In the cache now, whoever asked: of a draft, the tokens its samples kept (each
            # kept draft token is the sample before it)
            tokens = work.tokens
            if work.drafted or work.guess:
                tokens = (*work.tokens[:1], *(one.token for one in sampled[:-1]))
            self.cache.evaluated(work.seq, tokens)
            generation = self.cache.sequences[work.seq].generation
            if generation is None or generation.state not in HAS_STEP_WORK:
                continue
            generation.pending = generation.pending[len(work.tokens):]
            if work.drafted or work.guess:
                accepted = len(tokens) - 1
                self._totals.drafted_tokens += self.speculation.verified(
                    generation, work, accepted=accepted)
                self._totals.accepted_tokens += accepted
            for one in sampled:
                if generation.state not in HAS_STEP_WORK:  # (it ended inside the draft)
                    break
                self._accept(generation, one)

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
        # cached prompts may hold the cells it grows into
        self.cache.make_room(self.admission.stats().reserved_cells, 0)
        return True

    # ------------------------------------------------------------------ leasing

    def _detach_ended(self) -> None:
        now = time.monotonic()
        for sequence in self.cache.sequences:
            generation = sequence.generation
            if generation is not None and generation.state in (RequestState.CANCELLED,
                                                                RequestState.FINISHED):
                generation._finish("stop")  # no-op unless the client stopped it
                self.cache.detach(sequence, now=now, decode_rows=self._decode_rows)
                # Free the slot now, not when the HTTP response is fully written: a
                # client that stops reading must not pin a session slot.
                self.admission.release(generation.ticket)
                self._totals.count(generation)

    def _attach_joining(self) -> None:
        while self._joining:
            generation = self._joining.pop(0)
            if generation.state is not RequestState.QUEUED:  # cancelled, or aborted
                continue
            self.cache.attach(generation, self.admission.stats().reserved_cells)
