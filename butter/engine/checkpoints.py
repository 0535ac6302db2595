"""Context checkpoints: where a recurrent or hybrid model's sequence can be cut back to.

A hybrid model (Qwen3.5, LFM2, Granite 4, Nemotron-H) carries, beside its attention KV, a
recurrent state that holds the whole past in a fixed size and cannot be rewound. So a
cached prompt serves a new one only up to a position where a copy of that state was
taken: a checkpoint (llama-server's context checkpoints). Restoring one and cutting the
attention KV there turns a prompt that diverges inside the cache into a short prefill.

Pure: which positions to checkpoint, and which checkpoints to keep. The prefix cache
takes and restores them (docs/concurrency.md, "Recurrent and hybrid models").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

# The last checkpoint of a prompt is taken this many tokens before its end: a chat
# client sends the answer back re-rendered, and templates that open the answer with a
# thinking tag, or drop it from history, differ from the generation prompt in its last
# few tokens (llama-server takes the same 4).
TAIL = 4

# A long prompt is also checkpointed every this many tokens (llama-server's
# --checkpoint-min-step), so that one diverging deep inside does not start from 0.
STEP = 8192

# Of planned positions closer together than this, only the last is checkpointed: the
# chat template's answer header and the prompt's tail lie a token or two apart, and each
# checkpoint copies the whole recurrent state and splits a step. The last serves the most
# of a returning turn (its answer's header is rendered again); one that diverges before
# it falls back to the checkpoint before (the last message's start, as llama-server's).
CLOSEST = 16



@attrs.frozen(eq=False)
class Checkpoint:
    """A sequence's recurrent state after its first `n_tokens` tokens (opaque bytes)."""

    n_tokens: int
    data: bytes = attrs.field(repr=lambda data: f"{len(data)} bytes")

    @property
    def size(self) -> int:
        return len(self.data)


def positions(prompt_length: int, cached: int, chunk: int,
              message_starts: Iterable[int] = ()) -> list[int]:
    """Where to checkpoint a prompt of `prompt_length` tokens whose first `cached` are
    already in the KV: TAIL tokens before its end, one prefill chunk before that, every
    STEP tokens, and where the template starts a message (`message_starts`), all past
    `cached` and before the prompt's last token (which must be evaluated to sample), the
    last of any closer than CLOSEST."""
    end = prompt_length - TAIL
    wanted = {end, end - chunk, *range(STEP, prompt_length, STEP), *message_starts}
    kept: list[int] = []
    for position in sorted((p for p in wanted if cached < p < prompt_length), reverse=True):
        if not kept or kept[-1] - position >= CLOSEST:
            kept.append(position)
    return kept[::-1]


def newest_within(checkpoints: Sequence[Checkpoint], limit: int) -> Checkpoint | None:
    """The checkpoint furthest along that holds no more than `limit` tokens."""
    fitting = [c for c in checkpoints if c.n_tokens <= limit]
    return max(fitting, key=lambda c: c.n_tokens) if fitting else None


def with_checkpoint(checkpoints: Sequence[Checkpoint], new: Checkpoint,
                    most: int) -> list[Checkpoint]:
    """The list with `new` in its place (by position; it replaces one at the same
    position), thinned to `most`: the checkpoint closest behind the one before it goes
    first, since restoring its predecessor instead costs the least prefill; the newest
    is never dropped."""
    kept = sorted([c for c in checkpoints if c.n_tokens != new.n_tokens] + [new],
                  key=lambda c: c.n_tokens)
    while len(kept) > max(most, 1):
        candidates = [i for i in range(len(kept)) if kept[i] is not new]
        gap = {i: kept[i].n_tokens - (kept[i - 1].n_tokens if i else 0) for i in candidates}
        del kept[min(candidates, key=lambda i: (gap[i], i))]
    return kept


def up_to(checkpoints: Sequence[Checkpoint], keep: int) -> list[Checkpoint]:
    """The checkpoints still valid once a sequence is cut back to `keep` tokens."""
    return [c for c in checkpoints if c.n_tokens <= keep]
