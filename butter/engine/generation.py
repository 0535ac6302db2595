"""A request inside the engine: its states, the events that move it, its output buffer.

The step loop (engine.py) is the only writer: it moves a `Generation` along TRANSITIONS
with one method per event (`_leased`, `_restore_done`, `_sampled`, `_push`, `_finish`).
The request's own task only reads its output (`pieces`, `take_logprobs`) and may close it.
"""

from __future__ import annotations

import enum
import time
from collections.abc import AsyncIterator
from typing import Literal

import attrs
import trio

from butter.backends.base import PromptImage
from butter.chat.request import Logprobs
from butter.engine.admission import Ticket
from butter.engine.drafting import Acceptance, PromptLookup
from butter.sampling import SamplingParams

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
HAS_STEP_WORK = frozenset({_S.PREFILLING, _S.DECODING})


class IllegalTransition(Exception):
    """A request was moved along no edge of TRANSITIONS: a bug in the engine."""



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
    prompt_top_logprobs: int | None = None
    prompt_logprobs: list[Logprobs] = attrs.field(factory=list)  # of tokens 1 .. n-1
    # Prompt positions worth a checkpoint on a model whose state cannot be cut back (where
    # the chat template starts a message): a later prompt that diverges past one of them
    # starts from there (checkpoints.py).
    checkpoint_hints: tuple[int, ...] = ()
    # The images in the prompt, where they sit (their positions hold image_token_ids).
    images: tuple[PromptImage, ...] = ()
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

