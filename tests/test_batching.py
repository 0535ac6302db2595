"""Which decoding sessions batch together (pure): padding stays bounded, the batch is as
large as the bound allows."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from butter.backends.batching import PADDING_BOUND, choose_batch


def _fits(lengths: dict[int, int], group: list[int]) -> bool:
    held = sum(lengths[seq] for seq in group)
    return len(group) * max(lengths[seq] for seq in group) <= PADDING_BOUND * max(held, 1)


def test_examples() -> None:
    assert choose_batch({0: 2000, 1: 5, 2: 6, 3: 5}) == [1, 3, 2]  # the long one alone
    assert sorted(choose_batch({0: 50, 1: 40, 2: 45, 3: 60})) == [0, 1, 2, 3]
    assert choose_batch({7: 30}) == []  # nothing to share a pass with
    assert choose_batch({}) == []


@given(st.dictionaries(st.integers(0, 15), st.integers(0, 5000), max_size=12))
def test_padding_is_bounded_and_the_batch_is_the_largest_that_fits(
        lengths: dict[int, int]) -> None:
    batch = choose_batch(lengths)
    order = sorted(lengths, key=lambda seq: (lengths[seq], seq))
    if batch:
        assert len(batch) >= 2 and _fits(lengths, batch)
        start = order.index(batch[0])
        assert order[start:start + len(batch)] == batch  # contiguous in length order
    larger = [order[i:j] for i in range(len(order)) for j in range(i + 1, len(order) + 1)
              if j - i > max(len(batch), 1)]
    assert not any(_fits(lengths, group) for group in larger)
