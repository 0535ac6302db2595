"""Plan one engine step (pure): which tokens of which sessions go into one decode.

Every decoding session contributes its one next token. The prefill budget is split
into equal chunks over the prefilling sessions (the first in session order takes any
remainder), so a long prompt never stalls the others for more than one chunk, then
shifted so that the prompts this step can finish do (`_chunk_sizes`).

How large that chunk may be while others decode is `PrefillBudget`'s call: a session gets
one token per step, so a step that carries a chunk is a stall for everyone streaming.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from butter.backends.base import PromptImage, SeqWork


@attrs.frozen
class PendingWork:
    """A session's view for the planner: tokens waiting to be evaluated."""

    seq: int
    start: int  # position of the first pending token
    pending: tuple[int, ...]
    decoding: bool  # pending is the one sampled token, not prompt
    prompt_top_logprobs: int | None = None  # score the prompt (SeqWork.prompt_top_logprobs)
    draft: tuple[int, ...] = ()  # a decode's guess at the tokens after it (SeqWork.drafted)
    guess: int = 0  # or: the draft model guesses this many (SeqWork.guess)
    history: Sequence[int] = ()  # the sequence's tokens, for the draft model
    # A prompt chunk ends after at most this many tokens (None: wherever), so that the
    # state there can be checkpointed before the next chunk (prefix_cache.py).
    stop: int | None = None
    images: tuple[PromptImage, ...] = ()  # the prompt's images (SeqWork.images)

    @property
    def can_take(self) -> int:
        """The prompt tokens a chunk of this step may hold."""
        return len(self.pending) if self.stop is None else min(len(self.pending), self.stop)


# The smallest chunk the budget shrinks to while sessions decode. llama.cpp's CPU flash
# attention computes queries in 64-row tiles, and a partial tile costs a full one: below 64
# rows a chunk would pay for attention it does not get (docs/design/prompt-chunks.md).
MIN_DECODING_BUDGET = 64


@attrs.define
class PrefillBudget:
    """The prompt tokens one step may carry: `full` when nobody decodes (time to first
    token is all that matters then), and while sessions decode, as much as keeps a step
    near `stall` seconds. A prompt chunk's attention spans the whole prompt so far, so
    the same chunk that takes 50 ms at the start of a 16k prompt takes seconds at its end
    (2 cores), while the cost per prompt token barely depends on the chunk's size.

    Steps that carry both are measured: over `stall` the budget halves (down to
    MIN_DECODING_BUDGET), under a third of it the budget doubles (up to `full`), so one
    change cannot overshoot the other way. `stall` 0 turns this off."""

    full: int
    stall: float
    decoding_budget: int = attrs.field()

    @decoding_budget.default
    def _start_full(self) -> int:
        return self.full

    @property
    def adapts(self) -> bool:
        """Whether steps are measured at all (a `stall` target is set)."""
        return self.stall > 0

    def for_step(self, decoding: bool) -> int:
        """The budget for a step, given whether any session decodes in it."""
        return self.decoding_budget if decoding else self.full

    def observe(self, prompt_tokens: int, decode_rows: int, seconds: float) -> None:
        """Adjust to a step that took `seconds` (only steps carrying both count)."""
        if not self.adapts or prompt_tokens == 0 or decode_rows == 0:
            return
        floor = min(MIN_DECODING_BUDGET, self.full)
        if seconds > self.stall:
            self.decoding_budget = max(floor, self.decoding_budget // 2)
        elif seconds < self.stall / 3:
            self.decoding_budget = min(self.full, self.decoding_budget * 2)


def plan_step(sessions: Sequence[PendingWork], prefill_budget: int, tile: int = 1
              ) -> list[SeqWork]:
    """One step's works: every decoding session's token, then the prompt chunks (`tile`:
    the backend's Backend.prompt_tile)."""
    works = [
        SeqWork(seq=s.seq, tokens=s.pending + s.draft, start=s.start, sample=True,
                drafted=len(s.draft), guess=s.guess, history=s.history)
        for s in sessions
        if s.decoding and s.pending
    ]
    prefilling = [s for s in sessions if not s.decoding and s.pending]
    sizes = _chunk_sizes(prefilling, prefill_budget)
    if tile > 1 and sum(1 for size in sizes if size) > 1:
        sizes = _whole_tiles(prefilling, sizes, prefill_budget, tile)
        # Chunks that stop short of their prompt's end (whole tiles) first, so that the
        # prompts ending here share at most the batch's last tiles.
        order = sorted(range(len(prefilling)),
                       key=lambda i: sizes[i] == len(prefilling[i].pending))
        prefilling = [prefilling[i] for i in order]
        sizes = [sizes[i] for i in order]
    if any(not image.causal for s in prefilling for image in s.images):
        sizes = _whole_images(prefilling, sizes, prefill_budget)
    for s, size in zip(prefilling, sizes, strict=True):
        if size == 0:
            continue
        chunk = s.pending[:size]
        works.append(
            SeqWork(
                seq=s.seq, tokens=chunk, start=s.start, sample=size == len(s.pending),
                prompt=True, prompt_top_logprobs=s.prompt_top_logprobs,
                next_token=s.pending[size] if size < len(s.pending) else None,
                images=tuple(image for image in s.images
                             if image.start < s.start + size and image.end > s.start),
            )
        )
    return works


def _image_cut(session: PendingWork, size: int, *, extend: bool) -> int:
    """`size`, or, where the chunk would end inside an image that is evaluated whole (not
    causal), the chunk up to that image's start; if that leaves nothing and `extend`, the
    chunk up to the image's end."""
    end = session.start + size
    for image in session.images:
        if not image.causal and image.start < end < image.end:
            if image.start > session.start or not extend:
                return max(0, image.start - session.start)
            return min(image.end - session.start, len(session.pending))
    return size


def _whole_images(prefilling: Sequence[PendingWork], sizes: list[int], budget: int
                  ) -> list[int]:
    """The step's chunks cut so that none ends inside an image evaluated whole (Gemma 3's:
    its embeddings see each other). A chunk that starts at such an image holds all of it,
    even past the budget (one such chunk a step where it does not fit beside another: an
    image is never more than a batch, Projector checks); the others give way."""
    planned = sizes
    sizes = [_image_cut(s, size, extend=False) if size else 0
             for s, size in zip(prefilling, sizes, strict=True)]
    whole = 0
    for index, session in enumerate(prefilling):
        if sizes[index] or not planned[index]:  # (a prompt given no share waits)
            continue
        size = _image_cut(session, 1, extend=True)  # (a chunk that starts at the image)
        if size > 1 and (whole == 0 or whole + size <= budget):
            sizes[index] = size
            whole += size
    over = sum(sizes) - max(budget, whole)
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        if over <= 0:
            break
        if _image_cut(prefilling[index], 1, extend=True) > 1 and sizes[index] > 1:
            continue  # (a whole image)
        smaller = _image_cut(prefilling[index], max(0, sizes[index] - over), extend=False)
        over -= sizes[index] - smaller
        sizes[index] = smaller
    return sizes


def _chunk_sizes(prefilling: Sequence[PendingWork], budget: int) -> list[int]:
    """Equal shares of the budget, then whatever finishes prompts this step.

    Equal shares keep long prompts fair to each other, but leave a burst of similar short
    prompts (8 chat requests of ~33 tokens against 256) all a token or two short, so none
    would get its first token from this step. So, in session order, a prompt left short is
    topped up to its end from the budget nobody used, else from prompts that cannot finish
    in this step anyway (longest first, each giving at most half of its share). Budget
    still unused then goes to the unfinished prompts, in session order."""
    needs = [session.can_take for session in prefilling]
    sizes = _equal_shares(needs, budget)
    givable = [size // 2 if size < need else 0 for size, need in zip(sizes, needs, strict=True)]
    spare = budget - sum(sizes)
    for index, need in enumerate(needs):
        short = need - sizes[index]
        if short <= 0:
            continue
        donors = sorted(
            (j for j in range(len(needs)) if j != index and givable[j] and sizes[j] < needs[j]),
            key=lambda j: (-needs[j], -j),
        )
        if short > spare + sum(givable[j] for j in donors):
            continue  # it cannot finish in this step: leave the shares as they are
        from_spare = min(short, spare)
        spare -= from_spare
        short -= from_spare
        for j in donors:
            given = min(givable[j], short)
            sizes[j] -= given
            givable[j] -= given
            short -= given
        sizes[index] = need
    for index, need in enumerate(needs):
        extra = min(spare, need - sizes[index])
        sizes[index] += extra
        spare -= extra
    return sizes


def _whole_tiles(prefilling: Sequence[PendingWork], sizes: list[int], budget: int,
                 tile: int) -> list[int]:
    """The same step cut so that every chunk that does not end its prompt is whole tiles.

    A backend tile holding two prompts' rows computes each against what either sees
    (llama.cpp's flash attention skips a block of the cache only where the whole tile is
    masked from it), so whole tiles prefill several prompts faster than equal shares
    (docs/design/prompt-chunks.md, "Prompts prefilled together", measured by
    benchmarks/prompts_together.py).
    Prompts that end in this step keep their size; the budget they leave is split into
    tiles among the others, the extra tiles going to the least advanced (with fewer tiles
    than prompts, those furthest behind go first). Where not one whole tile is left, the
    step stays as it was."""
    needs = [s.can_take for s in prefilling]
    sizes = list(sizes)
    ending = {i for i, size in enumerate(sizes) if size == needs[i]}
    going_on = sorted((i for i in range(len(needs)) if i not in ending),
                      key=lambda i: prefilling[i].start)
    tiles = max(0, budget - sum(sizes[i] for i in ending)) // tile
    if not going_on or tiles == 0:  # (not one whole tile left: as they are, never starved)
        return sizes
    each, extra = divmod(tiles, len(going_on))
    for rank, i in enumerate(going_on):
        sizes[i] = min(needs[i], (each + (rank < extra)) * tile)
    return sizes


def _equal_shares(needs: Sequence[int], budget: int) -> list[int]:
    """Equal shares of the budget; unused share of short prompts flows to the next ones."""
    sizes = [0] * len(needs)
    remaining = budget
    for index, need in enumerate(needs):
        share = max(1, remaining // (len(needs) - index)) if remaining > 0 else 0
        sizes[index] = min(need, share)
        remaining -= sizes[index]
    return sizes
