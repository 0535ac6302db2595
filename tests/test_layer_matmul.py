"""butter's Q8_0 layer matmuls inside llama.cpp (butter/native/layer_matmul.cpp,
butter/backends/llama_cpp/layer_matmul.py).

Checked on the real engine: which matrices the kernel takes (a file's plain 2-D Q8_0
layer matrices, nothing else), that llama.cpp's graph multiplies them there, that the
logits and greedy tokens stay llama.cpp's own (on the tiny model and on the demo model's
real weights), and that where it does not apply the reason is said and nothing is taken.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import llama_cpp as ll
import numpy as np
import pytest

import butter.backends.llama_cpp.loading as llama_loading
from butter.backends.base import RemoveTokens, SeqWork, SetSampler
from butter.backends.llama_cpp import LlamaCppBackend, layer_matmul
from butter.backends.llama_cpp.layer_matmul import Counters, LayerMatmul, Unavailable
from butter.cli import build_parser, settings_from_args
from butter.pipeline.resident import ResidentModel
from butter.sampling import SamplingParams
from butter.testing.tiny_gguf import N_LAYER, write_tiny_qwen3_gguf

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def tiny_256_q8_0_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model 256 wide (products of 8 blocks, several tiles per matrix)."""
    return write_tiny_qwen3_gguf(tmp_path_factory.mktemp("q8_0") / "tiny-256-q8_0.gguf",
                                 width=256)


def _kernel_or_skip() -> LayerMatmul:
    llama_loading.init_llama_backend()
    try:
        return layer_matmul.registered()
    except Unavailable as exc:
        pytest.skip(f"butter's layer matmuls do not apply here: {exc}")


def _backend(path: Path, *, fast_layers: bool, repack: bool = True) -> LlamaCppBackend:
    return LlamaCppBackend(path, n_cells=1024, n_seq=4, n_batch=256, threads=2,
                           fast_layers=fast_layers, repack=repack)


def _plain_q8_0_layer_matrices(path: Path) -> int:
    """What the kernel should take from a file, counted by the gguf package."""
    reader = gguf.GGUFReader(path)
    return sum(1 for t in reader.tensors
               if t.name.startswith("blk.") and len(t.shape) == 2
               and t.tensor_type == gguf.GGMLQuantizationType.Q8_0)


def _since(before: Counters, after: Counters) -> Counters:
    return Counters(after.matrices - before.matrices, after.packed_bytes - before.packed_bytes,
                    after.matmuls - before.matmuls, after.rows - before.rows)


@pytest.mark.parametrize("fixture", ["tiny_gguf", "tiny_q4_k_m_gguf", "demo_gguf"])
def test_a_files_q8_0_layer_matrices_and_nothing_else_are_taken(
    fixture: str, request: pytest.FixtureRequest,
) -> None:
    kernel = _kernel_or_skip()
    path: Path = request.getfixturevalue(fixture)
    expected = _plain_q8_0_layer_matrices(path)
    before = kernel.counters()
    backend = _backend(path, fast_layers=True)
    try:
        taken = _since(before, kernel.counters())
        assert taken.matrices == expected
        if expected:
            assert backend.model.layers_by == f"butter (AVX512-VNNI; {expected} Q8_0 matrices)"
        else:  # Q4_K_M: Q4_K goes to llama.cpp's repacking, Q6_K stays llama.cpp's
            assert backend.model.layers_by == "llama.cpp (no plain Q8_0 layer matrices)"
    finally:
        backend.close()


def test_the_graph_multiplies_those_matrices_with_the_kernel(tiny_gguf: Path) -> None:
    kernel = _kernel_or_skip()
    matrices = _plain_q8_0_layer_matrices(tiny_gguf)
    backend = _backend(tiny_gguf, fast_layers=True)
    try:
        before = kernel.counters()
        _generate_greedy(backend, PROMPTS[:3], steps=4)
        done = _since(before, kernel.counters())
        assert done.matrices == 0
        # every evaluation multiplies each matrix once, for every row of its batch
        assert done.matmuls > 0 and done.matmuls % matrices == 0
        # (llama.cpp drops the rows it needs no logits for before the last layer's FFN)
        prompt_rows = sum(len(backend.tokenize(p, add_bos=True)) for p in PROMPTS[:3])
        first_layer = matrices // N_LAYER
        assert done.rows >= first_layer * (prompt_rows + 3 * 4)
    finally:
        backend.close()


def _generate_greedy(backend: LlamaCppBackend, prompts: list[str], steps: int
                     ) -> tuple[dict[int, list[int]], np.ndarray]:
    """Greedy tokens of every prompt decoded side by side, and the first step's logits."""
    seqs = range(len(prompts))
    tokens = {seq: backend.tokenize(prompts[seq], add_bos=True) for seq in seqs}
    ops = [RemoveTokens(seq, 0) for seq in seqs]
    ops += [SetSampler(seq, SamplingParams(temperature=0)) for seq in seqs]
    sampled = backend.step(ops, [SeqWork(seq, tuple(tokens[seq]), 0, sample=True, prompt=True)
                                 for seq in seqs])
    batch = backend.model.batch
    first = np.stack([backend.step_logits(row) for row in range(batch.n_tokens)
                      if batch.logits[row]])
    out = {s.seq: [s.token] for s in sampled}
    for _ in range(steps):
        works = [SeqWork(seq, (out[seq][-1],), len(tokens[seq]) + len(out[seq]) - 1,
                         sample=True) for seq in seqs]
        for s in backend.step([], works):
            out[s.seq].append(s.token)
    return out, first


@pytest.fixture(scope="module")
def demo_pair(demo_gguf: Path) -> Iterator[tuple[LlamaCppBackend, LlamaCppBackend]]:
    """The demo model with butter's layer matmuls and with llama.cpp's, each with the
    same output projection, so that only the layers differ."""
    _kernel_or_skip()
    ours, theirs = _backend(demo_gguf, fast_layers=True), _backend(demo_gguf, fast_layers=False)
    yield ours, theirs
    ours.close()
    theirs.close()


def test_the_demo_models_logits_and_greedy_tokens_stay_llama_cpps(
    demo_pair: tuple[LlamaCppBackend, LlamaCppBackend],
) -> None:
    ours, theirs = demo_pair
    assert ours.model.layers_by.startswith("butter") and theirs.model.layers_by.startswith(
        "llama.cpp")
    our_tokens, our_logits = _generate_greedy(ours, PROMPTS, steps=24)
    their_tokens, their_logits = _generate_greedy(theirs, PROMPTS, steps=24)
    # Exact integer block products and the same activation quantization: only float sums
    # over blocks may run in another order (on this model the logits come out the same bits).
    assert llama_loading.relative_rms_error(our_logits, their_logits) < 1e-4
    assert our_tokens == their_tokens


# What llama.cpp names the outputs of layer 0's first three matmuls, whose input (the
# normed embeddings) is the same bits either way.
FIRST_MATMULS = ("Qcur-0", "Kcur-0", "Vcur-0")


def _first_matmul_outputs(path: Path, *, fast_layers: bool, tokens: int) -> dict[str, Any]:
    """FIRST_MATMULS' outputs for one prompt, read with llama.cpp's eval callback."""
    base = layer_matmul._ggml_libraries()[0]
    base.ggml_get_name.argtypes, base.ggml_get_name.restype = [ctypes.c_void_p], ctypes.c_char_p
    base.ggml_get_data.argtypes, base.ggml_get_data.restype = [ctypes.c_void_p], ctypes.c_void_p
    base.ggml_nbytes.argtypes, base.ggml_nbytes.restype = [ctypes.c_void_p], ctypes.c_size_t
    seen: dict[str, Any] = {}

    def look(tensor: int, ask: bool, user_data: int) -> bool:
        name = base.ggml_get_name(tensor).decode()
        if ask:
            return name in FIRST_MATMULS
        raw = ctypes.string_at(base.ggml_get_data(tensor), base.ggml_nbytes(tensor))
        seen[name] = np.frombuffer(raw, dtype=np.float32).copy()
        return True

    hook = ll.ggml_backend_sched_eval_callback(look)
    model, _ = llama_loading._load_model(path, repack=True, fast_layers=fast_layers)
    params = ll.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_threads, params.n_threads_batch = 512, 512, 2, 2
    params.cb_eval, params.cb_eval_user_data = hook, None
    ctx = ll.llama_init_from_model(model, params)
    batch = ll.llama_batch_init(tokens, 0, 1)
    try:
        n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
        batch.n_tokens = tokens
        for i in range(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = (i * 37 + 11) % n_vocab, i, 1
            batch.seq_id[i][0], batch.logits[i] = 0, i == tokens - 1
        assert ll.llama_decode(ctx, batch) == 0
    finally:
        ll.llama_batch_free(batch)
        ll.llama_free(ctx)
        ll.llama_model_free(model)
    return seen


@pytest.mark.parametrize("tokens", [1, 3, 8, 21])
def test_each_product_is_llama_cpps_to_float_rounding(tiny_256_q8_0_gguf: Path,
                                                      tokens: int) -> None:
    """The same inputs give llama.cpp's outputs but for the float sums' order (a model of
    random weights then carries such last-bit differences into visible ones, through the
    next layers' activation rounding: hence a check at the matmul itself)."""
    kernel = _kernel_or_skip()
    before = kernel.counters()
    ours = _first_matmul_outputs(tiny_256_q8_0_gguf, fast_layers=True, tokens=tokens)
    ran = _since(before, kernel.counters())
    theirs = _first_matmul_outputs(tiny_256_q8_0_gguf, fast_layers=False, tokens=tokens)
    assert ran.matmuls > 0 and _since(before, kernel.counters()).matmuls == ran.matmuls
    assert sorted(ours) == sorted(theirs) == sorted(FIRST_MATMULS)
    for name in FIRST_MATMULS:
        scale = np.abs(theirs[name]).max()
        np.testing.assert_allclose(ours[name], theirs[name], rtol=0, atol=1e-6 * scale)


def _last_prompt_logits(backend: LlamaCppBackend, first: list[int] | None,
                        prompt: list[int]) -> np.ndarray:
    """`prompt`'s last logits evaluated cold in one step, after another sequence's prompt
    `first` in the same step when given."""
    ops = [RemoveTokens(seq, -1, -1) for seq in (0, 1)]
    ops += [SetSampler(seq, SamplingParams(temperature=0)) for seq in (0, 1)]
    works = [SeqWork(0, tuple(prompt), 0, sample=True, prompt=True)]
    if first is not None:
        works.insert(0, SeqWork(1, tuple(first), 0, sample=True, prompt=True))
    backend.step(ops, works)
    row = (len(first) if first is not None else 0) + len(prompt) - 1
    return np.asarray(backend.step_logits(row))


def test_a_rows_result_does_not_depend_on_the_rows_beside_it(tiny_gguf: Path) -> None:
    _kernel_or_skip()
    backend = _backend(tiny_gguf, fast_layers=True)
    try:
        assert backend.model.layers_by.startswith("butter")
        prompt = backend.tokenize(PROMPTS[0], add_bos=False)
        other = backend.tokenize(PROMPTS[1], add_bos=False)
        alone = _last_prompt_logits(backend, None, prompt)
        beside = _last_prompt_logits(backend, other, prompt)
        np.testing.assert_array_equal(alone, beside)
    finally:
        backend.close()


@pytest.mark.parametrize(("flags", "reason"), [
    ([], None),
    (["--no-fast-layers"], "llama.cpp (--no-fast-layers)"),
    (["--deterministic"], "llama.cpp (--deterministic turns llama.cpp's extra buffer types off)"),
])
def test_the_flags_reach_the_loaded_model_and_server_info(
    tiny_gguf: Path, flags: list[str], reason: str | None,
) -> None:
    kernel = _kernel_or_skip()
    args = build_parser().parse_args(["serve", "--model", str(tiny_gguf), *flags])
    before = kernel.counters()
    resident = ResidentModel.load_sync(settings_from_args(args))
    try:
        assert isinstance(resident.backend, LlamaCppBackend)
        shown = resident.metadata()["layer_matmuls"]  # what /v1/server shows
        taken = _since(before, kernel.counters()).matrices
        if reason is None:  # on by default wherever it applies
            assert shown.startswith("butter (") and taken == _plain_q8_0_layer_matrices(tiny_gguf)
        else:
            assert shown == reason and taken == 0
    finally:
        resident.close()


class _MirrorOf:
    """The real library, but reporting another ggml_tensor size than it was built with."""

    def __init__(self, lib: Any, tensor_bytes: int) -> None:
        self._lib = lib
        self._tensor_bytes = tensor_bytes
        self.butter_layer_matmul_buffer_type_name = lib.butter_layer_matmul_buffer_type_name

    def butter_layer_matmul_mirror(self, out: Any, size: int) -> int:
        status = int(self._lib.butter_layer_matmul_mirror(out, size))
        out[0] = self._tensor_bytes
        return status


def test_a_ggml_the_library_does_not_mirror_is_refused() -> None:
    kernel = _kernel_or_skip()
    lib = kernel._lib
    base, cpu = layer_matmul._ggml_libraries()
    layer_matmul._check_mirror(lib, base, cpu)  # this ggml: the mirror matches
    real = (ctypes.c_int64 * 4)()
    lib.butter_layer_matmul_mirror(real, ctypes.sizeof(real))
    with pytest.raises(Unavailable, match="tensor size"):
        layer_matmul._check_mirror(_MirrorOf(lib, int(real[0]) + 8), base, cpu)
