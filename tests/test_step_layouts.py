"""Step shaping: the pure chooser, and what each shape does inside llama.cpp (tiny GGUF)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import llama_cpp as ll
import numpy as np
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from butter.backends.base import RemoveTokens, SeqWork, SetSampler
from butter.backends.llama_cpp import LlamaCppBackend
from butter.backends.step_layouts import LayoutTimer, StepLayout, candidates, padded_outputs
from butter.cli import build_parser, settings_from_args
from butter.pipeline.resident import ResidentModel
from butter.sampling import SamplingParams
from butter.testing.tiny_gguf import write_tiny_qwen3_gguf
from tests.conftest import ServerProcess

# ------------------------------------------------------------------ the chooser (pure)


def test_candidates_keep_single_rows_and_small_batches_exact() -> None:
    assert candidates(1, decode_only=True) == (StepLayout.PLAIN,)
    assert candidates(2, decode_only=True) == (StepLayout.PLAIN, StepLayout.SPLIT)
    assert candidates(3, decode_only=False) == (StepLayout.PLAIN,)  # never split prompt steps
    assert candidates(4, decode_only=True) == (StepLayout.PLAIN,)
    assert candidates(6, decode_only=True) == (StepLayout.PLAIN, StepLayout.PADDED)
    assert candidates(8, decode_only=True) == (StepLayout.PLAIN,)
    assert candidates(13, decode_only=True) == (StepLayout.PLAIN, StepLayout.PADDED)
    assert candidates(6, decode_only=False) == (StepLayout.PLAIN,)  # prompt logits stay exact
    assert [padded_outputs(n) for n in (5, 7, 8, 13)] == [8, 8, 8, 16]


def test_llama_cpps_projection_is_a_candidate_only_where_offered() -> None:
    assert candidates(1, decode_only=True, head_choice=True) == (StepLayout.PLAIN,
                                                                 StepLayout.LLAMA_HEAD)
    assert StepLayout.LLAMA_HEAD in candidates(6, decode_only=True, head_choice=True)
    assert candidates(1, decode_only=False, head_choice=True) == (StepLayout.PLAIN,)
    layouts = LayoutTimer(trials=2, revisit_every=50, head_choice=True)
    for _ in range(2):
        layouts.observe(1, StepLayout.PLAIN, 0.033)
        layouts.observe(1, StepLayout.LLAMA_HEAD, 0.031)
    assert layouts.choose(1, decode_only=True) is StepLayout.LLAMA_HEAD
    assert layouts.verdicts() == {1: "llama-head"}


def _timed(layouts: LayoutTimer, outputs: int, cost: dict[StepLayout, float], steps: int
           ) -> list[StepLayout]:
    chosen = []
    for _ in range(steps):
        shape = layouts.choose(outputs, decode_only=True)
        layouts.observe(outputs, shape, cost[shape])
        chosen.append(shape)
    return chosen


def test_tries_every_candidate_then_keeps_the_fastest() -> None:
    layouts = LayoutTimer(trials=3, revisit_every=50)
    chosen = _timed(layouts, 6, {StepLayout.PLAIN: 0.055, StepLayout.PADDED: 0.044}, 60)
    assert chosen[:6].count(StepLayout.PLAIN) == 3 and chosen[:6].count(StepLayout.PADDED) == 3
    assert layouts.best(6) is StepLayout.PADDED
    assert chosen[6:].count(StepLayout.PLAIN) == 1  # one fresh look at the loser per 50 steps
    assert chosen[6 + 50] is StepLayout.PLAIN
    # Steps with prompt rows are never reshaped.
    assert layouts.choose(6, decode_only=False) is StepLayout.PLAIN


def test_trials_take_turns_so_a_slow_start_does_not_decide() -> None:
    layouts = LayoutTimer(trials=3, revisit_every=50, head_choice=True)
    cost = {StepLayout.PLAIN: 0.020, StepLayout.LLAMA_HEAD: 0.022}
    chosen = []
    for step in range(8):
        shape = layouts.choose(1, decode_only=True)
        cold = 0.030 if step < 2 else 0.0  # the first two steps after a load run slow
        layouts.observe(1, shape, cost[shape] + cold)
        chosen.append(shape)
    assert chosen[:6] == [StepLayout.PLAIN, StepLayout.LLAMA_HEAD] * 3
    assert layouts.best(1) is StepLayout.PLAIN


def test_follows_a_change_in_costs() -> None:
    layouts = LayoutTimer(trials=2, revisit_every=10, window=3)
    _timed(layouts, 2, {StepLayout.PLAIN: 0.020, StepLayout.SPLIT: 0.030}, 20)
    assert layouts.best(2) is StepLayout.PLAIN
    _timed(layouts, 2, {StepLayout.PLAIN: 0.040, StepLayout.SPLIT: 0.030}, 60)
    assert layouts.best(2) is StepLayout.SPLIT


def test_disabled_shaper_is_always_plain() -> None:
    layouts = LayoutTimer(enabled=False)
    assert {layouts.choose(n, decode_only=d) for n in range(1, 17) for d in (True, False)} == {
        StepLayout.PLAIN}


@given(st.lists(st.tuples(st.integers(1, 16), st.booleans(), st.floats(0.001, 1.0)),
                max_size=200))
def test_every_choice_is_a_candidate(steps: list[tuple[int, bool, float]]) -> None:
    layouts = LayoutTimer(trials=2, revisit_every=7)
    for outputs, decode_only, seconds in steps:
        shape = layouts.choose(outputs, decode_only=decode_only)
        assert shape in candidates(outputs, decode_only=decode_only)
        if decode_only:
            layouts.observe(outputs, shape, seconds)


# ------------------------------------------------------------------ inside llama.cpp


@pytest.fixture(scope="module", params=[True, False], ids=["butter-lm-head", "llama-lm-head"])
def backend(tiny_gguf: Path, request: pytest.FixtureRequest) -> Iterator[LlamaCppBackend]:
    backend = LlamaCppBackend(tiny_gguf, n_cells=2048, n_seq=8, n_batch=256, threads=2,
                              fast_lm_head=request.param)
    if request.param and not backend.lm_head.startswith("butter"):
        backend.close()
        pytest.skip(f"butter's output projection does not apply here: {backend.lm_head}")
    yield backend
    backend.close()


def _prefill(backend: LlamaCppBackend, seqs: range) -> list[SeqWork]:
    """Fresh sessions with different prompts; their first decode works."""
    ops: list[RemoveTokens | SetSampler] = [RemoveTokens(seq, -1, -1) for seq in range(8)]
    ops += [SetSampler(seq, SamplingParams(temperature=0)) for seq in seqs]
    prompts = {seq: backend.tokenize(f"Session {seq} talks about boats", add_bos=False)
               for seq in seqs}
    backend.layouts.enabled = False
    sampled = backend.step(ops, [SeqWork(seq, tuple(p), 0, sample=True, prompt=True)
                                 for seq, p in prompts.items()])
    return [SeqWork(s.seq, (s.token,), len(prompts[s.seq]), sample=True) for s in sampled]


def _logits(backend: LlamaCppBackend, rows: int) -> np.ndarray:
    return np.stack([backend.step_logits(row) for row in range(rows)])


def test_split_rows_equal_plain_rows(backend: LlamaCppBackend) -> None:
    works = _prefill(backend, range(2))
    backend.stepper.decode(works, outputs=0)
    plain = _logits(backend, 2)
    backend.step([RemoveTokens(w.seq, w.start) for w in works], [])  # rewind one position
    first = backend.stepper.decode(works[:1], outputs=0)
    alone = [_logits(backend, 1)[0]]
    backend.stepper.decode(works[1:], outputs=0)
    alone.append(_logits(backend, 1)[0])
    assert np.array_equal(plain, np.stack(alone))  # SPLIT is exact: same kernels per row
    assert first[0].seq == works[0].seq


def test_padding_rows_change_no_real_row_and_leave_no_trace(backend: LlamaCppBackend) -> None:
    works = _prefill(backend, range(8))
    backend.stepper.decode(works, outputs=0)  # a real batch of 8 decode rows
    eight = _logits(backend, 8)
    backend.step([RemoveTokens(w.seq, w.start) for w in works], [])
    sampled = backend.stepper.decode(works[:6], outputs=padded_outputs(6))  # + 2 scratch
    padded = _logits(backend, 6)
    # Eight rows with logits went through llama.cpp, two of them scratch...
    batch = backend.model.batch
    assert batch.n_tokens == 8 and all(batch.logits[row] for row in range(8))
    # ...and the six real rows are bit-identical to theirs in a real batch of 8.
    assert np.array_equal(padded, eight[:6])
    assert [s.seq for s in sampled] == list(range(6))
    assert ll.llama_memory_seq_pos_max(backend.model.mem, backend.model.pad_seq) == -1  # no trace


def test_decode_rows_beside_a_long_prompt_chunk_go_first_on_their_own(
    backend: LlamaCppBackend,
) -> None:
    """A step with other sessions' decode rows and a prompt chunk of 64 rows or more is
    two evaluations: the decode rows exactly as a decode-only step, then the chunk alone.
    A short chunk stays in one evaluation with them."""
    works = _prefill(backend, range(3))
    decoding = works[:2]
    long_prompt = tuple(backend.tokenize(" ".join(["boats and harbours"] * 40),
                                         add_bos=False))[:100]
    assert len(long_prompt) == 100
    backend.step([RemoveTokens(4, -1, -1), SetSampler(4, SamplingParams(temperature=0))], [])
    alone = backend.step([], decoding)  # the reference: a decode-only step
    backend.step([RemoveTokens(w.seq, w.start) for w in decoding], [])
    before = backend.stepper.separated_steps
    beside = backend.step([], [*decoding, SeqWork(4, long_prompt, 0, sample=True,
                                                  prompt=True)])
    assert backend.stepper.separated_steps == before + 1
    assert [(s.seq, s.token) for s in beside[:2]] == [(s.seq, s.token) for s in alone]
    assert [s.seq for s in beside] == [0, 1, 4]
    # The chunk was the last evaluation, alone.
    assert backend.model.batch.n_tokens == len(long_prompt)
    # A short chunk shares the step's one evaluation.
    backend.step([RemoveTokens(w.seq, w.start) for w in decoding] + [RemoveTokens(4, -1, -1)],
                 [])
    short = SeqWork(4, long_prompt[:16], 0, sample=True, prompt=True)
    backend.step([], [*decoding, short])
    assert backend.stepper.separated_steps == before + 1
    assert backend.model.batch.n_tokens == 2 + 16


@pytest.fixture(scope="module")
def tiny_f16_head_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with an F16 output matrix, which butter's projection requantizes."""
    return write_tiny_qwen3_gguf(tmp_path_factory.mktemp("f16") / "tiny-f16-head.gguf",
                                 f16_output=True)


@pytest.mark.parametrize("repack", [True, False], ids=["repacked", "deterministic"])
def test_llama_head_rows_are_llama_cpps_own_logits(tiny_f16_head_gguf: Path, repack: bool
                                                   ) -> None:
    def load(fast: bool) -> LlamaCppBackend:
        return LlamaCppBackend(tiny_f16_head_gguf, n_cells=2048, n_seq=8, n_batch=256,
                               threads=2, fast_lm_head=fast, repack=repack)

    ours, theirs = load(True), load(False)
    try:
        if not ours.lm_head.startswith("butter"):
            pytest.skip(f"butter's output projection does not apply here: {ours.lm_head}")
        # Offered only where both projections exist, exactness was not asked for, and
        # butter's serves a requantized matrix (this file's output is F16).
        assert ours.layouts.head_choice is repack and theirs.layouts.head_choice is False
        logits = []
        for backend in (ours, theirs):
            works = _prefill(backend, range(2))
            backend.stepper.decode(works, outputs=0, ours=False)
            assert backend.stepper.ours is False
            logits.append(_logits(backend, 2))
        assert np.array_equal(logits[0], logits[1])
    finally:
        ours.close()
        theirs.close()


def test_a_q8_0_head_is_not_raced_against_llama_cpps(tiny_gguf: Path) -> None:
    backend = LlamaCppBackend(tiny_gguf, n_cells=1024, n_seq=2, n_batch=256, threads=2,
                              repack=True)
    try:
        head = backend.model.lm_head
        if head is None:
            pytest.skip(f"butter's output projection does not apply here: {backend.lm_head}")
        assert head.exact  # the file's own Q8_0 matrix: both projections read the same bytes
        assert backend.layouts.head_choice is False  # so same seed, same tokens, every run
    finally:
        backend.close()


# ------------------------------------------------------------------ served


@pytest.mark.parametrize(("flags", "enabled"), [([], True), (["--no-step-shaping"], False)])
def test_the_flag_reaches_the_loaded_backend(tiny_gguf: Path, flags: list[str],
                                             enabled: bool) -> None:
    args = build_parser().parse_args(["serve", "--model", str(tiny_gguf), *flags])
    resident = ResidentModel.load_sync(settings_from_args(args))
    try:
        assert isinstance(resident.backend, LlamaCppBackend)
        assert resident.backend.layouts.enabled is enabled
        shown = resident.metadata()["step_shapes"]  # what /v1/server shows
        assert (shown is None) is not enabled
    finally:
        resident.close()


async def test_server_reports_the_shapes_it_chose(tiny_gguf: Path) -> None:
    server = ServerProcess(["--model", str(tiny_gguf), "--alias", "tiny", "--parallel", "2",
                            "--max-context", "1024"])
    try:
        async with httpx.AsyncClient(base_url=server.api, timeout=60) as client:

            async def ask(seed: int) -> None:
                reply = await client.post("/chat/completions", json={
                    "model": "tiny", "messages": [{"role": "user", "content": f"Hi {seed}"}],
                    "max_tokens": 24, "seed": seed})
                assert reply.status_code == 200

            async with trio.open_nursery() as nursery:
                for seed in range(2):
                    nursery.start_soon(ask, seed)
            meta = (await client.get("/server")).json()["model"]["meta"]
        # Two decoding side by side: plain, split and llama.cpp's projection were each
        # timed, one was kept.
        assert meta["step_shapes"]["2"] in ("plain", "split", "llama-head")
        # Who computed the logits, and no step had to be evaluated again.
        assert meta["lm_head"]["by"].startswith(("butter (", "llama.cpp ("))
        assert meta["lm_head"]["redone_steps"] == 0
    finally:
        server.stop()
