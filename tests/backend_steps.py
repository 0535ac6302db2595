"""Steps on a real llama.cpp backend that several test modules read logits from."""

from __future__ import annotations

import numpy as np

from butter.backends.base import Backend, RemoveTokens, SeqWork, SetSampler
from butter.backends.llama_cpp import LlamaCppBackend
from butter.sampling import SamplingParams


def generate_greedy(backend: LlamaCppBackend, prompts: list[str], steps: int
                    ) -> tuple[dict[int, list[int]], np.ndarray]:
    """Greedy tokens of every prompt decoded side by side, and the first step's logits."""
    seqs = range(len(prompts))
    tokens = {seq: backend.tokenize(prompts[seq], add_bos=True) for seq in seqs}
    ops = [RemoveTokens(seq, 0) for seq in seqs]
    ops += [SetSampler(seq, SamplingParams(temperature=0)) for seq in seqs]
    sampled = backend.step(ops, [SeqWork(seq, tuple(tokens[seq]), 0, sample=True, prompt=True)
                                 for seq in seqs])
    batch = backend.model.batch
    first_rows = [row for row in range(batch.n_tokens) if batch.logits[row]]
    first = np.stack([backend.step_logits(row) for row in first_rows])
    out = {s.seq: [s.token] for s in sampled}
    for _ in range(steps):
        works = [SeqWork(seq, (out[seq][-1],), len(tokens[seq]) + len(out[seq]) - 1,
                         sample=True) for seq in seqs]
        for s in backend.step([], works):
            out[s.seq].append(s.token)
    return out, first


def last_prompt_logits(backend: LlamaCppBackend, first: list[int] | None,
                        prompt: list[int]) -> np.ndarray:
    """The logits of `prompt`'s last token, evaluated cold in one step, after `first`
    (another sequence's prompt in the same step) when given."""
    ops = [RemoveTokens(seq, -1, -1) for seq in (0, 1)]
    ops += [SetSampler(seq, SamplingParams(temperature=0)) for seq in (0, 1)]
    works = [SeqWork(0, tuple(prompt), 0, sample=True, prompt=True)]
    if first is not None:
        works.insert(0, SeqWork(1, tuple(first), 0, sample=True, prompt=True))
    backend.step(ops, works)
    row = (len(first) if first is not None else 0) + len(prompt) - 1
    return np.asarray(backend.step_logits(row))


def forget_everything(backend: Backend) -> None:
    """Empty every sequence id the backend has, so that the next engine starts cold."""
    backend.step([RemoveTokens(seq, -1, -1)
                  for seq in range(backend.n_seq + backend.n_cache_seqs)], [])
