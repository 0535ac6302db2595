"""Log-probabilities of a sampled token and its most likely alternatives, from a row of
raw logits: the model's own distribution (softmax at temperature 1, before penalties,
bias and filters), which is what llama-server and vLLM report by default."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from butter.chat.request import Logprobs, TokenLogprob


def log_softmax(logits: npt.ArrayLike) -> npt.NDArray[np.float64]:
    values = np.asarray(logits, dtype=np.float64)
    shifted = values - values.max()
    result: npt.NDArray[np.float64] = shifted - np.log(np.exp(shifted).sum())
    return result


def token_logprobs(
    logits: npt.ArrayLike, token: int, top: int, piece: Callable[[int], bytes]
) -> Logprobs:
    """`token`'s log-probability and the `top` most likely tokens', most likely first."""
    logprobs = log_softmax(logits)
    best: list[int] = []
    if top > 0:
        top = min(top, len(logprobs))
        candidates = np.argpartition(-logprobs, top - 1)[:top]
        best = sorted((int(i) for i in candidates), key=lambda i: (-logprobs[i], i))

    def entry(token_id: int) -> TokenLogprob:
        return TokenLogprob(token_id, piece(token_id), float(logprobs[token_id]))

    return Logprobs(chosen=entry(token), top=tuple(entry(i) for i in best))
