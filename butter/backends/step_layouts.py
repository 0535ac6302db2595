"""How to lay out a step's output rows, chosen by measurement (pure: no llama.cpp here).

On llama.cpp's CPU backend the cost of a step on a small model is dominated by the output
projection, and its matmul kernels do not scale smoothly with the number of output rows:
more rows can cost less, and two single-row decodes less than one of two rows (the
measurements are in docs/design/step-shaping.md, "Step shaping"). So a step can be laid
out in one of four ways (`StepLayout`):

- PLAIN: the rows as they are;
- PADDED: logits requested on scratch rows up to the next multiple of 8, so that the
  projection runs on the batched kernels;
- SPLIT: one decode per row (decode-only steps of 2-3 rows);
- LLAMA_HEAD: the rows as they are, with llama.cpp's own output projection instead of
  butter's (offered only where butter's is loaded and exactness is not asked for). Where
  butter's kernel serves a matrix requantized to Q8_0 (Q6_K in Q4_K_M files: 30% more
  bytes), llama.cpp's reads less, and a one-row step, bound by memory, can be faster on it.

Which one wins depends on the hardware and the model, so the layouts times the candidates
on decode-only steps (the llama_decode calls only, same rows, different layout), keeps the
fastest, and revisits the others now and then. Candidates are limited so that results stay
exact where they were: steps with prompt rows are always PLAIN, and single rows PLAIN
unless LLAMA_HEAD is offered (never with `--deterministic`); SPLIT evaluates each row as it
would be alone; PADDED is only offered from 5 rows of a group of 8, where rows already share
batched kernels.
"""

from __future__ import annotations

import statistics
from collections import deque
from enum import Enum

PAD_MULTIPLE = 8
MIN_PADDED_REMAINDER = 5  # pad 5-7 rows (mod 8) up; fewer would double the projection
MAX_SPLIT_ROWS = 3


class StepLayout(Enum):
    PLAIN = "plain"
    PADDED = "padded"
    SPLIT = "split"
    LLAMA_HEAD = "llama-head"


def candidates(outputs: int, *, decode_only: bool, head_choice: bool = False
               ) -> tuple[StepLayout, ...]:
    """The shapes worth trying for a step that samples `outputs` rows (`head_choice`:
    whether llama.cpp's projection may stand in for butter's)."""
    if not decode_only:
        return (StepLayout.PLAIN,)
    shapes = [StepLayout.PLAIN]
    if head_choice:
        shapes.append(StepLayout.LLAMA_HEAD)
    if outputs % PAD_MULTIPLE >= MIN_PADDED_REMAINDER:
        shapes.append(StepLayout.PADDED)
    if 2 <= outputs <= MAX_SPLIT_ROWS:
        shapes.append(StepLayout.SPLIT)
    return tuple(shapes)


def padded_outputs(outputs: int) -> int:
    return -(-outputs // PAD_MULTIPLE) * PAD_MULTIPLE


class LayoutTimer:
    """Per output-row count: recent step times of each candidate shape, and the choice."""

    def __init__(self, *, trials: int = 3, revisit_every: int = 200, window: int = 5,
                 enabled: bool = True, head_choice: bool = False) -> None:
        self.trials = trials  # timings of each candidate before trusting a choice
        self.revisit_every = revisit_every  # decode-only steps between re-measurements
        self.enabled = enabled
        self.head_choice = head_choice  # LLAMA_HEAD is a candidate (see `candidates`)
        self._window = window
        self._times: dict[tuple[int, StepLayout], deque[float]] = {}
        self._since_revisit: dict[int, int] = {}

    def choose(self, outputs: int, *, decode_only: bool) -> StepLayout:
        if not self.enabled or not decode_only:
            # Steps with prompt rows stay as they are: padding their outputs would put a
            # prompt's first logits on other kernels than a cold prefill's (the guarantee
            # in llama_cpp.MIN_PROMPT_ROWS).
            return StepLayout.PLAIN
        options = self._candidates(outputs)
        if len(options) == 1:
            return options[0]
        untried = [s for s in options if len(self._timings(outputs, s)) < self.trials]
        if untried:
            # In turns, not one candidate's trials after another's: the first steps after a
            # load run slower (cold caches and pages), and back-to-back trials would put
            # that cost on the first candidate alone.
            return min(untried, key=lambda s: len(self._timings(outputs, s)))
        best = min(options, key=lambda s: statistics.median(self._timings(outputs, s)))
        # After `revisit_every` steps with the best, one fresh timing of each other one.
        since = self._since_revisit.get(outputs, 0)
        self._since_revisit[outputs] = since + 1
        revisit = since - self.revisit_every
        if revisit >= 0:
            others = [s for s in options if s is not best]
            if revisit < len(others):
                return others[revisit]
            self._since_revisit[outputs] = 0
        return best

    def observe(self, outputs: int, shape: StepLayout, seconds: float) -> None:
        """Time of one decode-only step of `outputs` rows evaluated as `shape`."""
        self._timings(outputs, shape).append(seconds)

    def best(self, outputs: int) -> StepLayout | None:
        """The fastest measured candidate, or None before every one has its trials."""
        options = self._candidates(outputs)
        timed = {s: self._times.get((outputs, s), ()) for s in options}
        if any(len(t) < self.trials for t in timed.values()):
            return None
        return min(options, key=lambda s: statistics.median(timed[s]))

    def verdicts(self) -> dict[int, str]:
        """The chosen shape per output-row count that has a choice, for /v1/server."""
        counts = sorted({outputs for outputs, _ in list(self._times)})  # (a worker adds keys)
        chosen = {outputs: self.best(outputs) for outputs in counts}
        return {outputs: shape.value for outputs, shape in chosen.items() if shape is not None}

    def _candidates(self, outputs: int) -> tuple[StepLayout, ...]:
        return candidates(outputs, decode_only=True, head_choice=self.head_choice)

    def _timings(self, outputs: int, shape: StepLayout) -> deque[float]:
        return self._times.setdefault((outputs, shape), deque(maxlen=self._window))
