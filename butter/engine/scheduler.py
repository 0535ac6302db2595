"""Plan one engine step (pure): which tokens of which sessions go into one decode.

Every decoding session contributes its one next token. The prefill budget is split
into equal chunks over the prefilling sessions (earliest admitted first takes any
remainder), so a long prompt never stalls the others for more than one chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from butter.backends.base import SeqWork


@attrs.frozen
class PendingWork:
    """A session's view for the planner: tokens waiting to be evaluated."""

    seq: int
    start: int  # position of the first pending token
    pending: tuple[int, ...]
    decoding: bool  # pending is the one sampled token, not prompt
    score: int | None = None  # score the prompt's tokens (SeqWork.score)


def plan_step(sessions: Sequence[PendingWork], prefill_budget: int) -> list[SeqWork]:
    works = [
        SeqWork(seq=s.seq, tokens=s.pending, start=s.start, sample=True)
        for s in sessions
        if s.decoding and s.pending
    ]
    prefilling = [s for s in sessions if not s.decoding and s.pending]
    for s, size in zip(prefilling, _chunk_sizes(prefilling, prefill_budget), strict=True):
        if size == 0:
            continue
        chunk = s.pending[:size]
        works.append(
            SeqWork(
                seq=s.seq, tokens=chunk, start=s.start, sample=size == len(s.pending),
                prompt=True, score=s.score,
                next_token=s.pending[size] if size < len(s.pending) else None,
            )
        )
    return works


def _chunk_sizes(prefilling: Sequence[PendingWork], budget: int) -> list[int]:
    """Equal shares of the budget; unused share of short prompts flows to the next ones."""
    sizes = [0] * len(prefilling)
    remaining = budget
    for index, session in enumerate(prefilling):
        share = max(1, remaining // (len(prefilling) - index)) if remaining > 0 else 0
        sizes[index] = min(len(session.pending), share)
        remaining -= sizes[index]
    return sizes
