"""butter's output projection (butter/native/lmhead.c, butter/backends/lmhead.py).

The kernel is checked three ways: against the Q8_0 arithmetic written out in numpy,
against llama.cpp's own logits on the same hidden states, and by greedy generation on
the demo model, which must not change when butter computes the logits.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

import butter.backends.llama_cpp as llama_backend
import butter.backends.lmhead as lmhead_module
from butter.backends.base import BackendError, RemoveTokens, SeqWork, SetSampler
from butter.backends.gguf_tensors import read_header
from butter.backends.llama_cpp import LlamaCppBackend
from butter.backends.lmhead import ISA_VARIABLE, LmHead, Unavailable
from butter.cli import build_parser, settings_from_args
from butter.sampling import SamplingParams
from butter.server.resident import ResidentModel
from butter.testing.tiny_gguf import write_tiny_qwen3_gguf


def _head_or_skip(path: Path, *, max_rows: int = 16) -> LmHead:
    try:
        return LmHead(path, threads=2, max_rows=max_rows)
    except Unavailable as exc:
        pytest.skip(f"butter's output projection does not apply here: {exc}")


def _backend(path: Path, *, fast: bool, n_seq: int = 4) -> LlamaCppBackend:
    backend = LlamaCppBackend(path, n_cells=1024, n_seq=n_seq, n_batch=256, threads=2,
                              fast_lm_head=fast)
    if fast and backend._lm_head is None:
        backend.close()
        pytest.skip(f"butter's output projection does not apply here: {backend.lm_head}")
    return backend


# ------------------------------------------------------------------ the GGUF header


def test_header_locates_every_tensor_as_the_gguf_package_does(tiny_gguf: Path) -> None:
    header = read_header(tiny_gguf, keys=["general.architecture", "qwen3.block_count"])
    reader = gguf.GGUFReader(tiny_gguf)
    assert set(header.tensors) == {tensor.name for tensor in reader.tensors}
    for tensor in reader.tensors:
        info = header.tensors[tensor.name]
        assert info.offset == tensor.data_offset
        assert info.shape == tuple(int(n) for n in tensor.shape)
        assert info.ggml_type == int(tensor.tensor_type)
    assert header.metadata == {"general.architecture": "qwen3", "qwen3.block_count": 2}
    assert header.keys == set(reader.fields) - {"GGUF.version", "GGUF.tensor_count",
                                                "GGUF.kv_count"}


# ------------------------------------------------------------------ the kernel


def _q8_0_reference(path: Path, hidden: np.ndarray) -> np.ndarray:
    """Logits as ggml defines them: Q8_0 weights times Q8_0-quantized activations."""
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == "output.weight")
    n_embd, n_vocab = (int(n) for n in tensor.shape)
    return _reference(np.asarray(tensor.data).reshape(n_vocab, n_embd // 32, 34), hidden)


def _reference(blocks: np.ndarray, hidden: np.ndarray) -> np.ndarray:
    """`_q8_0_reference` for raw Q8_0 blocks ([n_vocab][n_embd / 32][34 bytes])."""
    n_embd = blocks.shape[1] * 32
    weight_scale = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)
    weights = blocks[..., 2:].copy().view(np.int8).astype(np.float64)
    x = hidden.reshape(len(hidden), n_embd // 32, 32).astype(np.float32)
    amax = np.abs(x).max(-1, keepdims=True)
    inverse = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax != 0)
    quantized = np.rint(x * inverse).astype(np.float64)  # half to even, like ggml's x86 code
    scale = (amax / np.float32(127)).astype(np.float16).astype(np.float64)[..., 0]
    # Exact integer dot product per block, then both scales, summed over blocks.
    dots = np.einsum("rbk,vbk->rvb", quantized, weights)
    return np.einsum("rvb,vb,rb->rv", dots, weight_scale, scale)


ISAS = ["avx512-vnni", "avx2"]


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each kernel in turn (skipped where the CPU lacks it)."""
    monkeypatch.setenv(ISA_VARIABLE, request.param)
    return str(request.param)


@pytest.mark.parametrize("rows", [1, 5, 8, 11])
def test_logits_are_the_q8_0_arithmetic(tiny_gguf: Path, rows: int, isa: str) -> None:
    head = _head_or_skip(tiny_gguf)
    assert head.isa.lower() == isa
    assert head.n_vocab % 16  # the tiny vocabulary ends in a partial tile: covered here
    hidden = np.random.default_rng(rows).standard_normal((rows, head.n_embd)).astype(np.float32)
    hidden[0, :32] = 0.0  # an all-zero block has scale 0
    ours = head.project(hidden)
    reference = _q8_0_reference(tiny_gguf, hidden)
    assert ours.shape == reference.shape
    np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-5 * np.abs(reference).max())


def test_a_rows_logits_do_not_depend_on_the_rows_beside_it(tiny_gguf: Path, isa: str) -> None:
    head = _head_or_skip(tiny_gguf)
    hidden = np.random.default_rng(7).standard_normal((11, head.n_embd)).astype(np.float32)
    together = head.project(hidden)  # a pass of 8 rows, then one of 3
    alone = np.stack([head.project(hidden[row : row + 1])[0] for row in range(11)])
    assert np.array_equal(together, alone)


def test_both_kernels_give_the_same_bits(tiny_gguf: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    hidden = np.random.default_rng(3).standard_normal((8, 64)).astype(np.float32)
    logits = []
    for name in ISAS:
        monkeypatch.setenv(ISA_VARIABLE, name)
        logits.append(_head_or_skip(tiny_gguf).project(hidden))
    assert np.array_equal(*logits)  # exact integer blocks, same float order


def test_a_kernel_the_cpu_lacks_is_refused(tiny_gguf: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ISA_VARIABLE, "sse2")
    with pytest.raises(Unavailable, match="BUTTER_LM_HEAD_ISA=sse2 is not available"):
        LmHead(tiny_gguf, threads=2, max_rows=8)


def test_too_many_rows_are_refused(tiny_gguf: Path) -> None:
    head = _head_or_skip(tiny_gguf, max_rows=4)
    with pytest.raises(ValueError, match="at most 4 rows"):
        head.project(np.zeros((5, head.n_embd), dtype=np.float32))


# ------------------------------------------------------------------ inside llama.cpp


@pytest.fixture(scope="module")
def demo_pair(demo_gguf: Path) -> Iterator[tuple[LlamaCppBackend, LlamaCppBackend]]:
    ours, theirs = _backend(demo_gguf, fast=True), _backend(demo_gguf, fast=False)
    yield ours, theirs
    ours.close()
    theirs.close()


def _generate_greedy(backend: LlamaCppBackend, prompts: list[str], steps: int
                     ) -> tuple[dict[int, list[int]], np.ndarray]:
    """Greedy tokens of every prompt decoded side by side, and the first step's logits."""
    seqs = range(len(prompts))
    tokens = {seq: backend.tokenize(prompts[seq], add_bos=True) for seq in seqs}
    ops = [RemoveTokens(seq, 0) for seq in seqs]
    ops += [SetSampler(seq, SamplingParams(temperature=0)) for seq in seqs]
    sampled = backend.step(ops, [SeqWork(seq, tuple(tokens[seq]), 0, sample=True, prompt=True)
                                 for seq in seqs])
    first_rows = [row for row in range(backend._batch.n_tokens) if backend._batch.logits[row]]
    first = np.stack([backend.step_logits(row) for row in first_rows])
    out = {s.seq: [s.token] for s in sampled}
    for _ in range(steps):
        works = [SeqWork(seq, (out[seq][-1],), len(tokens[seq]) + len(out[seq]) - 1,
                         sample=True) for seq in seqs]
        for s in backend.step([], works):
            out[s.seq].append(s.token)
    return out, first


def test_demo_model_logits_and_greedy_tokens_match_llama_cpp(
    demo_pair: tuple[LlamaCppBackend, LlamaCppBackend],
) -> None:
    ours, theirs = demo_pair
    assert ours.lm_head.startswith("butter") and theirs.lm_head.startswith("llama.cpp")
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,",
               "1, 2, 3, 4,"]
    our_tokens, our_logits = _generate_greedy(ours, prompts, steps=24)
    their_tokens, their_logits = _generate_greedy(theirs, prompts, steps=24)
    assert ours._ours and not theirs._ours  # whose logits each one sampled
    scale = np.abs(their_logits).max()
    np.testing.assert_allclose(our_logits, their_logits, rtol=0, atol=1e-4 * scale)
    assert our_tokens == their_tokens


def test_the_avx2_kernel_serves_a_backend(tiny_gguf: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    theirs = _backend(tiny_gguf, fast=False)
    reference, their_logits = _generate_greedy(theirs, ["Session 2 talks about boats"], steps=8)
    theirs.close()
    monkeypatch.setenv(ISA_VARIABLE, "avx2")
    ours = _backend(tiny_gguf, fast=True)
    try:
        assert ours.lm_head == "butter (AVX2)"
        tokens, our_logits = _generate_greedy(ours, ["Session 2 talks about boats"], steps=8)
        assert tokens == reference and ours._ours
        scale = np.abs(their_logits).max()
        np.testing.assert_allclose(our_logits, their_logits, rtol=0, atol=1e-4 * scale)
    finally:
        ours.close()


def test_a_failed_self_check_leaves_the_logits_to_llama_cpp(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    _head_or_skip(tiny_gguf)  # (only meaningful where the projection applies)
    monkeypatch.setattr(llama_backend, "LM_HEAD_TOLERANCE", -1.0)  # nothing can pass
    backend = _backend(tiny_gguf, fast=False)
    reference, _ = _generate_greedy(backend, ["Session 1 talks about boats"], steps=8)
    backend.close()
    backend = LlamaCppBackend(tiny_gguf, n_cells=1024, n_seq=4, n_batch=256, threads=2)
    try:
        assert backend._lm_head is None
        assert backend.lm_head.startswith("llama.cpp (self-check failed: its logits differ")
        tokens, _ = _generate_greedy(backend, ["Session 1 talks about boats"], steps=8)
        assert tokens == reference and not backend._ours
    finally:
        backend.close()


def test_a_float_output_matrix_is_left_to_llama_cpp(tmp_path: Path) -> None:
    path = write_tiny_qwen3_gguf(tmp_path / "f32.gguf", quantize=False)
    with pytest.raises(Unavailable, match=r"output.weight is not Q8_0 \(ggml type 0\)"):
        lmhead_module._q8_0_output(path)
    backend = LlamaCppBackend(path, n_cells=1024, n_seq=2, n_batch=256, threads=2)
    try:
        assert backend._lm_head is None and backend.lm_head.startswith("llama.cpp (")
    finally:
        backend.close()


def test_weights_of_minus_128_count_as_minus_128(
    tiny_gguf: Path, isa: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Quantizers never write -128, but Q8_0 allows it; ggml's kernels handle it."""
    rng = np.random.default_rng(5)
    n_vocab, n_embd = 40, 64
    blocks = np.zeros((n_vocab, n_embd // 32, 34), dtype=np.uint8)
    blocks[..., :2] = np.full((n_vocab, n_embd // 32), 0.01, np.float16)[..., None].view(np.uint8)
    quants = rng.integers(-128, 128, size=(n_vocab, n_embd // 32, 32)).astype(np.int8)
    quants[:5] = -128  # whole rows of the extreme value
    blocks[..., 2:] = quants.view(np.uint8)
    rows = blocks.reshape(n_vocab, -1)
    monkeypatch.setattr(lmhead_module, "_q8_0_output", lambda path: (rows, n_vocab, n_embd))
    head = _head_or_skip(tiny_gguf)
    hidden = rng.standard_normal((3, n_embd)).astype(np.float32)
    reference = _reference(blocks, hidden)
    np.testing.assert_allclose(head.project(hidden), reference, rtol=0,
                               atol=1e-5 * np.abs(reference).max())


def test_a_step_with_more_output_rows_than_the_hook_holds_uses_llama_cpp(
    tiny_gguf: Path,
) -> None:
    backend = _backend(tiny_gguf, fast=True, n_seq=1)  # the hook holds 8 rows
    try:
        assert backend._lm_head is not None and backend._lm_head.rows == 8
        prompt = tuple(backend.tokenize("Session 1 talks about boats", add_bos=False))
        backend.step([SetSampler(0, SamplingParams(temperature=0))], [])
        work = SeqWork(0, prompt, 0, sample=True, prompt=True)
        sampled = backend._decode([work], outputs=12)  # 12 rows with logits
        assert backend._batch.n_tokens >= 12 and not backend._ours
        assert sampled[0].token == int(np.argmax(backend.step_logits(len(prompt) - 1)))
        # The next step fits again, and butter's projection takes it.
        backend.step([], [SeqWork(0, (sampled[0].token,), len(prompt), sample=True)])
        assert backend._ours
    finally:
        backend.close()


def test_a_step_split_into_micro_batches_is_evaluated_again_by_llama_cpp(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """butter's logits of a split step may be out of order: they must never be sampled."""
    create = llama_backend.ll.llama_init_from_model

    def micro_batches_of_8(model: object, params: Any) -> Any:
        params.n_ubatch = 8  # llama.cpp then evaluates a 13-row step in two micro-batches
        return create(model, params)

    monkeypatch.setattr(llama_backend.ll, "llama_init_from_model", micro_batches_of_8)
    prompts = ["Session 4 talks about boats", "Session 5 likes the sea"]
    theirs = _backend(tiny_gguf, fast=False)
    reference, _ = _generate_greedy(theirs, prompts, steps=4)
    theirs.close()
    backend = _backend(tiny_gguf, fast=True)
    try:
        tokens, _ = _generate_greedy(backend, prompts, steps=4)
        assert backend.lm_head_redos == 1  # the prompt step; decode steps have 2 rows
        assert tokens == reference
    finally:
        backend.close()


def test_a_closed_backend_refuses_steps_and_closes_once(tiny_gguf: Path) -> None:
    backend = _backend(tiny_gguf, fast=False)
    backend.close()
    backend.close()  # a no-op
    with pytest.raises(BackendError, match="unloaded"):
        backend.step([], [SeqWork(0, (1,), 0, sample=True)])


def test_every_evaluation_runs_on_one_thread_whoever_calls(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """llama.cpp's OpenMP teams are per calling thread (docs/architecture.md)."""
    decoding_threads: set[str] = set()
    decode = llama_backend.ll.llama_decode

    def recording_decode(ctx: object, batch: object) -> int:
        decoding_threads.add(threading.current_thread().name)
        return int(decode(ctx, batch))

    monkeypatch.setattr(llama_backend.ll, "llama_decode", recording_decode)
    backend = LlamaCppBackend(tiny_gguf, n_cells=1024, n_seq=2, n_batch=256, threads=2)
    try:
        prompt = tuple(backend.tokenize("Session 3 talks about boats", add_bos=False))
        ops = [SetSampler(0, SamplingParams(temperature=0))]
        callers = [
            threading.Thread(target=backend.step, args=(ops, [SeqWork(0, prompt, 0, True, True)])),
            threading.Thread(target=backend.step, args=([RemoveTokens(0, 0)], [])),
            threading.Thread(target=backend.step, args=([], [SeqWork(0, prompt, 0, True, True)])),
        ]
        for caller in callers:  # one after another, each from a new thread
            caller.start()
            caller.join()
        assert len(decoding_threads) == 1
        assert decoding_threads.pop().startswith("butter-llama")
    finally:
        backend.close()


@pytest.mark.parametrize("flags", [[], ["--no-fast-lm-head"]])
def test_the_flag_reaches_the_loaded_backend(tiny_gguf: Path, flags: list[str]) -> None:
    _head_or_skip(tiny_gguf)  # (only meaningful where the projection applies)
    args = build_parser().parse_args(["serve", "--model", str(tiny_gguf), *flags])
    resident = ResidentModel.load_sync(settings_from_args(args))
    try:
        assert isinstance(resident.backend, LlamaCppBackend)
        shown = resident.lm_head()  # what /v1/server shows
        assert shown is not None and shown["by"] == resident.backend.lm_head
        if flags:
            assert resident.backend._lm_head is None
            assert shown["by"] == "llama.cpp (--no-fast-lm-head)"
        else:  # on by default wherever the kernel applies to this model
            assert resident.backend._lm_head is not None
            assert shown["by"] == f"butter ({resident.backend._lm_head.isa})"
    finally:
        resident.close()
