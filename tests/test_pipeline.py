"""The neutral pipeline's pure parts: fitting a completion into the context."""

from __future__ import annotations

import pytest

from butter.errors import ContextLengthExceeded
from butter.pipeline.prepare import fit_completion


def test_max_tokens_beyond_the_context_is_clamped_to_what_fits() -> None:
    assert fit_completion(19_723, 32_000, 32_768, strict=False) == 32_768 - 19_723
    assert fit_completion(100, 50, 1000, strict=False) == 50  # fits: unchanged
    assert fit_completion(100, None, 1000, strict=False) is None  # the engine's budget


def test_strict_mode_refuses_what_does_not_fit() -> None:
    with pytest.raises(ContextLengthExceeded, match="strict-max-tokens") as refused:
        fit_completion(19_723, 32_000, 32_768, strict=True)
    assert refused.value.param == "max_tokens"
    assert fit_completion(100, 900, 1000, strict=True) == 900


@pytest.mark.parametrize("strict", [False, True])
def test_a_prompt_that_alone_fills_the_context_is_refused(strict: bool) -> None:
    with pytest.raises(ContextLengthExceeded, match="no room"):
        fit_completion(1000, 5, 1000, strict=strict)
    assert fit_completion(999, 5, 1000, strict=False) == 1
