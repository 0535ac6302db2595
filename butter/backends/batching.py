"""Which decoding sessions share a batched forward pass (pure).

Batched caches left-pad every row to the longest one, so one long conversation batched with
short ones would multiply the KV memory and make every short row attend over padding. The
batch is therefore the largest group of sessions, contiguous in length order, whose padded
size stays within PADDING_BOUND times what they hold; the others decode on their own.
"""

from __future__ import annotations

from collections.abc import Mapping

PADDING_BOUND = 2.0  # padded positions / held positions, at most


def choose_batch(lengths: Mapping[int, int], bound: float = PADDING_BOUND) -> list[int]:
    """Sessions (by id) to batch, given the positions each holds; [] for fewer than two."""
    order = sorted(lengths, key=lambda seq: (lengths[seq], seq))
    best: list[int] = []
    for start in range(len(order)):
        for stop in range(len(order), start + max(1, len(best)), -1):
            group = order[start:stop]
            held = sum(lengths[seq] for seq in group)
            if len(group) * lengths[group[-1]] <= bound * max(held, 1):
                best = group
                break
    return best if len(best) > 1 else []
