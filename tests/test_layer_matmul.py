"""butter's Q8_0 layer matmuls inside llama.cpp (butter/native/layer_matmul.cpp,
butter/backends/llama_cpp/layer_matmul.py).

Checked on the real engine: which matrices the kernels take (a file's plain 2-D layer
matrices of butter's types, nothing else), that llama.cpp's graph multiplies them there, that each
product is llama.cpp's own to float rounding, that greedy tokens on the demo model's real
weights stay llama.cpp's, and that where it does not apply the reason is said and nothing
is taken.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import gguf
import llama_cpp as ll
import numpy as np
import pytest

import butter.backends.llama_cpp.loading as llama_loading
from butter.backends.base import RemoveTokens, SeqWork, SetSampler
from butter.backends.kernels import (
    TYPE_BITS,
    Isa,
    Kernel,
    butter_layer_types,
    layer_kernel,
    llama_cpp_kernel,
    requested_isa,
)
from butter.backends.llama_cpp import LlamaCppBackend, ggml_boundary, layer_matmul
from butter.backends.llama_cpp.layer_matmul import Counters, LayerMatmul
from butter.backends.native import Unavailable
from butter.cli import build_parser, settings_from_args
from butter.pipeline.resident import ResidentModel
from butter.sampling import SamplingParams
from butter.testing.tiny_gguf import N_LAYER, write_tiny_qwen3_gguf
from tests.backend_steps import generate_greedy, last_prompt_logits
from tests.conftest import quantized_tiny_gguf

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def tiny_256_q8_0_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model 256 wide (products of 8 blocks, several tiles per matrix)."""
    return write_tiny_qwen3_gguf(tmp_path_factory.mktemp("q8_0") / "tiny-256-q8_0.gguf",
                                 width=256)


@pytest.fixture(scope="module")
def tiny_q5_k_m_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Q5_K_M: Q5_K layer matrices, some Q6_K."""
    return quantized_tiny_gguf(tmp_path_factory.mktemp("q5_k_m"), ll.LLAMA_FTYPE_MOSTLY_Q5_K_M,
                               "tiny-256-q5_k_m.gguf")


@pytest.fixture(scope="module")
def tiny_q4_1_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model 256 wide in Q4_1 (llama.cpp's quantizer), as SmolLM2's GGUFs."""
    return quantized_tiny_gguf(tmp_path_factory.mktemp("q4_1"), ll.LLAMA_FTYPE_MOSTLY_Q4_1,
                           "tiny-256-q4_1.gguf")


@pytest.fixture(scope="module")
def tiny_q6_k_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model 256 wide in Q6_K (llama.cpp's quantizer)."""
    return quantized_tiny_gguf(tmp_path_factory.mktemp("q6_k"), ll.LLAMA_FTYPE_MOSTLY_Q6_K,
                           "tiny-256-q6_k.gguf")


@pytest.fixture(scope="module")
def tiny_q5_0_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model 256 wide in Q5_0, the type Gemma 3 270M's Q4_K_M file has most of."""
    return quantized_tiny_gguf(tmp_path_factory.mktemp("q5_0"), ll.LLAMA_FTYPE_MOSTLY_Q5_0,
                           "tiny-256-q5_0.gguf")


def _kernel_or_skip() -> LayerMatmul:
    llama_loading.init_llama_backend()
    try:
        return layer_matmul.registered()
    except Unavailable as exc:
        pytest.skip(f"butter's layer matmuls do not apply here: {exc}")


def _backend(path: Path, *, fast_layers: bool, repack: bool = True) -> LlamaCppBackend:
    return LlamaCppBackend(path, n_cells=1024, n_seq=4, n_batch=256, threads=2,
                           fast_layers=fast_layers, repack=repack)


MATMULS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
TILED = {"Q8_0": gguf.GGMLQuantizationType.Q8_0, "Q6_K": gguf.GGMLQuantizationType.Q6_K,
         "Q5_K": gguf.GGMLQuantizationType.Q5_K, "Q4_1": gguf.GGMLQuantizationType.Q4_1,
         "Q5_0": gguf.GGMLQuantizationType.Q5_0, "Q4_K": gguf.GGMLQuantizationType.Q4_K}


def _tiled_layer_matrices(path: Path) -> dict[str, int]:
    """What the kernels should take from a file, by type, counted by the gguf package."""
    reader = gguf.GGUFReader(path)
    return {name: sum(1 for t in reader.tensors
                      if t.name.startswith("blk.") and len(t.shape) == 2 and t.tensor_type == qtype)
            for name, qtype in TILED.items()}


def _weight_type(path: Path, name: str) -> str:
    reader = gguf.GGUFReader(path)
    return next(t.tensor_type.name for t in reader.tensors if t.name == name)


def _since(before: Counters, after: Counters) -> Counters:
    pairs = zip(attrs.astuple(after), attrs.astuple(before), strict=True)
    return Counters(*(a - b for a, b in pairs))


@pytest.mark.parametrize("fixture", ["tiny_gguf", "tiny_q4_k_m_gguf", "tiny_q5_k_m_gguf",
                                     "tiny_q4_1_gguf", "tiny_q5_0_gguf", "demo_gguf"])
def test_a_files_q8_0_layer_matrices_and_nothing_else_are_taken(
    fixture: str, request: pytest.FixtureRequest,
) -> None:
    kernel = _kernel_or_skip()
    path: Path = request.getfixturevalue(fixture)
    expected = _tiled_layer_matrices(path)
    assert any(expected.values())
    before = kernel.counters()
    backend = _backend(path, fast_layers=True)
    try:
        taken = _since(before, kernel.counters())
        # (Q4_K_M's Q4_K matrices too: butter's buffer type comes before llama.cpp's
        # repacking in its list)
        assert {name.upper(): n for name, n in taken.by_type().items()} == expected
        counts = " + ".join(f"{n} {name}" for name, n in expected.items() if n)
        assert backend.model.layers_by == f"butter ({kernel.isa.value}; {counts} matrices)"
        # /v1/server's table: each type's count and who multiplies it
        shown = backend.diagnostics()["kernels"]["layers"]
        for name, n in expected.items():
            if n:
                assert shown[name.replace("Q", "q", 1)] == f"{n} x butter ({kernel.isa.value})"
    finally:
        backend.close()


def test_the_graph_multiplies_those_matrices_with_the_kernel(tiny_gguf: Path) -> None:
    kernel = _kernel_or_skip()
    matrices = sum(_tiled_layer_matrices(tiny_gguf).values())
    backend = _backend(tiny_gguf, fast_layers=True)
    try:
        before = kernel.counters()
        generate_greedy(backend, PROMPTS[:3], steps=4)
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


@pytest.fixture(scope="module")
def demo_pair(demo_gguf: Path) -> Iterator[tuple[LlamaCppBackend, LlamaCppBackend]]:
    """The demo model with butter's layer matmuls and with llama.cpp's, each with the
    same output projection, so that only the layers differ."""
    _kernel_or_skip()
    ours, theirs = _backend(demo_gguf, fast_layers=True), _backend(demo_gguf, fast_layers=False)
    yield ours, theirs
    ours.close()
    theirs.close()


def _teacher_forced_logits(backend: LlamaCppBackend, prompt: str, tokens: list[int] | None,
                           steps: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens after `prompt` and every step's logits; with `tokens`, those are fed
    instead of the greedy ones (so two backends see the same sequence)."""
    prompt_tokens = backend.tokenize(prompt, add_bos=True)
    ops = [RemoveTokens(0, 0), SetSampler(0, SamplingParams(temperature=0))]
    backend.step(ops, [SeqWork(0, tuple(prompt_tokens), 0, sample=True, prompt=True)])
    batch = backend.model.batch
    row = next(r for r in range(batch.n_tokens) if batch.logits[r])
    logits = [np.array(backend.step_logits(row))]
    for i in range(steps):
        fed = tokens[i] if tokens is not None else int(np.argmax(logits[-1]))
        backend.step([], [SeqWork(0, (fed,), len(prompt_tokens) + i, sample=True)])
        logits.append(np.array(backend.step_logits(0)))
    return [int(np.argmax(step)) for step in logits], np.stack(logits)


def test_the_demo_models_logits_stay_llama_cpps(
    demo_pair: tuple[LlamaCppBackend, LlamaCppBackend],
) -> None:
    """On real weights, fed the same tokens, the logits stay llama.cpp's within what its own
    repacking moves them (measured on these prompts: llama.cpp's repacked Q4_K kernels
    against its plain ones differ by 2.9-5.8% RMS and pick another top token at 4 of 175
    steps; butter's layer kernels against llama.cpp's, 1.3-4.9% and 1 of 175). A wrong
    kernel is off by ~100%."""
    ours, theirs = demo_pair
    assert ours.model.layers_by.startswith("butter") and theirs.model.layers_by.startswith(
        "llama.cpp")
    agree = steps = 0
    for prompt in PROMPTS:
        their_tokens, their_logits = _teacher_forced_logits(theirs, prompt, None, steps=24)
        our_tokens, our_logits = _teacher_forced_logits(ours, prompt, their_tokens, steps=24)
        assert llama_loading.relative_rms_error(our_logits, their_logits) < 0.1
        agree += sum(a == b for a, b in zip(our_tokens, their_tokens, strict=True))
        steps += len(their_tokens)
    assert agree >= 0.95 * steps


def _matmul_outputs(path: Path, nodes: tuple[str, ...], *, fast_layers: bool, tokens: int
                    ) -> dict[str, Any]:
    """The named graph nodes' outputs for one prompt, read with llama.cpp's eval callback."""
    base = ggml_boundary.ggml_libraries()[0]
    base.ggml_get_name.argtypes, base.ggml_get_name.restype = [ctypes.c_void_p], ctypes.c_char_p
    base.ggml_get_data.argtypes, base.ggml_get_data.restype = [ctypes.c_void_p], ctypes.c_void_p
    base.ggml_nbytes.argtypes, base.ggml_nbytes.restype = [ctypes.c_void_p], ctypes.c_size_t
    seen: dict[str, Any] = {}

    def look(tensor: int, ask: bool, user_data: int) -> bool:
        name = base.ggml_get_name(tensor).decode()
        if ask:
            return name in nodes
        raw = ctypes.string_at(base.ggml_get_data(tensor), base.ggml_nbytes(tensor))
        seen[name] = np.frombuffer(raw, dtype=np.float32).copy()
        return True

    hook = ll.ggml_backend_sched_eval_callback(look)
    model, _, _ = llama_loading._load_model(path, repack=True, fast_layers=fast_layers)
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


# Products whose input is the same bits either way, by what llama.cpp names their outputs,
# with the weight each multiplies: layer 0's first ones (their input is the normed
# embeddings).
PRODUCTS = {
    "tiny_256_q8_0_gguf": {"Qcur-0": "blk.0.attn_q.weight", "Kcur-0": "blk.0.attn_k.weight",
                           "Vcur-0": "blk.0.attn_v.weight"},
    "tiny_q4_k_m_gguf": {"Qcur-0": "blk.0.attn_q.weight", "Kcur-0": "blk.0.attn_k.weight"},
    "tiny_q6_k_gguf": {"Qcur-0": "blk.0.attn_q.weight", "Kcur-0": "blk.0.attn_k.weight"},
    "tiny_q5_k_m_gguf": {"Qcur-0": "blk.0.attn_q.weight", "Kcur-0": "blk.0.attn_k.weight"},
    "tiny_q4_1_gguf": {"Qcur-0": "blk.0.attn_q.weight", "Kcur-0": "blk.0.attn_k.weight"},
    "tiny_q5_0_gguf": {"Qcur-0": "blk.0.attn_q.weight", "Kcur-0": "blk.0.attn_k.weight"},
}


@pytest.mark.parametrize("tokens", [1, 3, 8, 21])
@pytest.mark.parametrize(("fixture", "qtype"), [("tiny_256_q8_0_gguf", "Q8_0"),
                                                 ("tiny_q4_k_m_gguf", "Q4_K"),
                                                 ("tiny_q6_k_gguf", "Q6_K"),
                                                 ("tiny_q5_k_m_gguf", "Q5_K"),
                                                 ("tiny_q4_1_gguf", "Q4_1"),
                                                 ("tiny_q5_0_gguf", "Q5_0")])
def test_each_product_is_llama_cpps_to_float_rounding(
    fixture: str, qtype: str, tokens: int, request: pytest.FixtureRequest,
) -> None:
    """The same inputs give llama.cpp's outputs but for the float sums' order (a model of
    random weights then carries such last-bit differences into visible ones, through the
    next layers' activation rounding: hence a check at the matmul itself)."""
    kernel = _kernel_or_skip()
    path: Path = request.getfixturevalue(fixture)
    products = PRODUCTS[fixture]
    assert {_weight_type(path, weight) for weight in products.values()} == {qtype}
    before = kernel.counters()
    ours = _matmul_outputs(path, tuple(products), fast_layers=True, tokens=tokens)
    ran = _since(before, kernel.counters())
    theirs = _matmul_outputs(path, tuple(products), fast_layers=False, tokens=tokens)
    assert ran.matmuls > 0 and _since(before, kernel.counters()).matmuls == ran.matmuls
    assert sorted(ours) == sorted(theirs) == sorted(products)
    for name in products:
        scale = np.abs(theirs[name]).max()
        np.testing.assert_allclose(ours[name], theirs[name], rtol=0, atol=1e-6 * scale)


@pytest.mark.parametrize("fixture", ["tiny_gguf", "tiny_q4_k_m_gguf"])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(
    fixture: str, request: pytest.FixtureRequest,
) -> None:
    _kernel_or_skip()
    backend = _backend(request.getfixturevalue(fixture), fast_layers=True)
    try:
        assert backend.model.layers_by.startswith("butter")
        prompt = backend.tokenize(PROMPTS[0], add_bos=False)
        other = backend.tokenize(PROMPTS[1], add_bos=False)
        alone = last_prompt_logits(backend, None, prompt)
        beside = last_prompt_logits(backend, other, prompt)
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
            assert shown.startswith("butter (")
            assert taken == sum(_tiled_layer_matrices(tiny_gguf).values())
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
    base, cpu = ggml_boundary.ggml_libraries()
    ggml_boundary.check_mirror(lib, base, cpu)  # this ggml: the mirror matches
    real = (ctypes.c_int64 * ggml_boundary.MIRRORED)()
    lib.butter_layer_matmul_mirror(real, ctypes.sizeof(real))
    with pytest.raises(Unavailable, match="tensor size"):
        ggml_boundary.check_mirror(_MirrorOf(lib, int(real[0]) + 8), base, cpu)


def test_no_buffer_type_that_crashes_llama_cpp_is_offered_weights(demo_gguf: Path) -> None:
    # On CPUs with AMX-INT8 a native llama.cpp build lists its AMX buffer type, whose
    # decodes crash this llama.cpp (SIGSEGV): butter takes it out at registration, and the
    # demo model then decodes on the repacked kernels. Elsewhere there is none to take out.
    listed = ggml_boundary.listed_buffer_type_names()
    assert not set(listed) & {name.decode() for name in layer_matmul.CRASHING_BUFFER_TYPES}
    system = ll.llama_print_system_info().decode()
    if "AMX_INT8 = 1" in system:
        assert layer_matmul.dropped_buffer_types == ["AMX"]
    backend = LlamaCppBackend(demo_gguf, n_cells=256, n_seq=1, n_batch=64, threads=2,
                              repack=True)
    try:
        assert backend.model.repack and backend.diagnostics()["dropped_buffer_types"] == (
            layer_matmul.dropped_buffer_types)
        tokens = tuple(backend.tokenize("The capital of France is", add_bos=True))
        (sampled,) = backend.step([SetSampler(0, SamplingParams(temperature=0))],
                                  [SeqWork(0, tokens, 0, sample=True, prompt=True)])
        assert sampled.seq == 0
    finally:
        backend.close()


# ---------------------------------------------------------------- dispatch and self-check


def test_every_kernel_of_this_isa_passed_its_self_check() -> None:
    kernel = _kernel_or_skip()
    assert kernel.types == {name: "butter" for name in butter_layer_types(kernel.isa)}
    assert set(kernel.types) == {"q8_0", "q6_K", "q5_K", "q4_1", "q5_0", "q4_K"}


@pytest.mark.parametrize("qtype", ["q8_0", "q6_K", "q5_K", "q4_1", "q5_0", "q4_K"])
def test_a_wrong_kernel_result_fails_the_self_check(qtype: str) -> None:
    """One value of butter's product off by 1% of the largest: the check must see it (and
    the true kernel passes the same probes)."""
    kernel = _kernel_or_skip()
    number = {"q8_0": 8, "q6_K": 14, "q5_K": 13, "q4_1": 3, "q5_0": 6, "q4_K": 12}[qtype]
    assert ggml_boundary.ggml_type_name(number) == qtype
    assert layer_matmul.self_check(kernel._lib, number, perturbation=0.0) == ""
    why = layer_matmul.self_check(kernel._lib, number, perturbation=0.01)
    assert why.startswith("self-check failed: 1 x 512 by 40 differs from llama.cpp's by")


_FAILED_SELF_CHECK = """
import json, sys
from pathlib import Path
import butter.backends.llama_cpp.layer_matmul as layer_matmul
layer_matmul.SELF_CHECK_PERTURBATION = 0.01  # every kernel of this ISA computes wrongly
from butter.backends.llama_cpp import LlamaCppBackend
from tests.backend_steps import generate_greedy
backend = LlamaCppBackend(Path(sys.argv[1]), n_cells=1024, n_seq=4, n_batch=256, threads=2,
                          fast_layers=True, repack=True)
try:
    tokens, _ = generate_greedy(backend, ["Session 1 talks about boats"], steps=8)
    print(json.dumps({"diagnostics": backend.diagnostics(), "tokens": tokens,
                      "types": layer_matmul.registered().types}), flush=True)
finally:
    backend.close()
"""


def test_a_type_that_fails_its_self_check_stays_with_llama_cpp(tiny_gguf: Path) -> None:
    """Registration is once per process: a fresh one whose kernels all compute wrongly
    stores nothing in butter's layout, says why, and decodes as llama.cpp alone does."""
    _kernel_or_skip()
    run = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _FAILED_SELF_CHECK,
                          str(tiny_gguf)], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parent.parent)
    assert run.returncode == 0, f"exit {run.returncode}; stdout {run.stdout[-2000:]!r}; " \
        f"stderr {run.stderr[-6000:]}"
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert all(why.startswith("llama.cpp (self-check failed:") for why in found["types"].values())
    assert found["diagnostics"]["layer_matmuls"] == (
        "llama.cpp (butter's q8_0, q6_K, q5_K, q4_1, q5_0, q4_K kernels failed their self-check)")
    assert all("self-check failed" in who
               for who in found["diagnostics"]["kernels"]["layers"].values()
               if "x llama.cpp (repacked)" not in who)
    theirs = _backend(tiny_gguf, fast_layers=False)
    try:
        reference, _ = generate_greedy(theirs, ["Session 1 talks about boats"], steps=8)
    finally:
        theirs.close()
    assert found["tokens"] == {str(seq): tokens for seq, tokens in reference.items()}


_FORCED_AVX2 = """
import json
import butter.backends.llama_cpp.loading as loading
import butter.backends.llama_cpp.layer_matmul as layer_matmul
loading.init_llama_backend()
kernel = layer_matmul.registered()
print(json.dumps({"isa": kernel.isa.value, "types": kernel.types}))
"""


def test_the_avx2_kernels_pass_their_self_checks_where_avx512_vnni_is_best() -> None:
    """BUTTER_KERNEL_ISA=avx2 runs the AVX2 kernels on any CPU that has AVX2: on an
    AVX512-VNNI CPU they must give llama.cpp's products too (on an AVX2 CPU the tests above
    already run them)."""
    kernel = _kernel_or_skip()
    if kernel.isa is not Isa.AVX512_VNNI:
        pytest.skip(f"the best kernels here are {kernel.isa.value}: the tests above ran them")
    run = subprocess.run([sys.executable, "-c", _FORCED_AVX2], capture_output=True, text=True,
                         timeout=300, check=True, env={**os.environ, "BUTTER_KERNEL_ISA": "avx2"})
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found == {"isa": "AVX2", "types": {name: "butter" for name in TYPE_BITS}}


class _Mismatched:
    """The real library, but its mirror check reporting the given fields as different."""

    def __init__(self, wrong: int) -> None:
        self._wrong = wrong

    def butter_layer_matmul_check_mirror(self, out: Any) -> int:
        ctypes.cast(out, ctypes.POINTER(ctypes.c_int32))[0] = self._wrong
        return layer_matmul.OK


def test_the_mirror_check_reads_this_ggml_and_names_what_differs() -> None:
    kernel = _kernel_or_skip()
    ggml_boundary.check_mirror_fields(kernel._lib)  # this ggml, read through the mirror
    with pytest.raises(Unavailable, match=r"structures differ from the mirror \(ne, buffer\)"):
        ggml_boundary.check_mirror_fields(_Mismatched(0b10000010))


@pytest.mark.parametrize(("wanted", "best", "expected"), [
    (None, Isa.AVX512_VNNI, (Isa.AVX512_VNNI, "")),
    ("auto", Isa.AVX2, (Isa.AVX2, "")),
    ("avx2", Isa.AVX512_VNNI, (Isa.AVX2, "BUTTER_KERNEL_ISA=avx2")),
    ("AVX512-VNNI", Isa.AVX2, (Isa.NONE, "BUTTER_KERNEL_ISA=AVX512-VNNI: this CPU lacks it")),
    ("none", Isa.AVX2, (Isa.NONE, "BUTTER_KERNEL_ISA=none: butter's kernels are off, as asked")),
])
def test_the_isa_asked_for_is_at_most_the_cpus(wanted: str | None, best: Isa,
                                               expected: tuple[Isa, str]) -> None:
    assert requested_isa(wanted, best) == expected


def test_an_isa_butter_has_no_kernels_for_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="BUTTER_KERNEL_ISA=sse2: expected auto"):
        requested_isa("sse2", Isa.AVX2)


def test_the_table_gives_butter_exactly_the_types_the_library_multiplies() -> None:
    for isa in (Isa.AVX512_VNNI, Isa.AVX2):
        assert set(butter_layer_types(isa)) == set(TYPE_BITS)
        # llama.cpp's own repacking keeps what it covers on x86 (Q4_0, IQ4_NL, ...) but Q4_K
        assert layer_kernel(isa, "q4_0") is Kernel.REPACKED
        assert layer_kernel(isa, "q4_K") is Kernel.BUTTER
        # and takes it back where butter's kernels are off (--no-fast-layers)
        assert llama_cpp_kernel(isa, "q4_K", repack=True) is Kernel.REPACKED
        assert llama_cpp_kernel(isa, "q4_K", repack=False) is Kernel.GENERIC
        assert layer_kernel(isa, "q3_K") is Kernel.GENERIC
    assert butter_layer_types(Isa.NEON) == [] and butter_layer_types(Isa.NONE) == []


def test_llama_cpp_threads_start_only_on_the_backends_thread_and_a_passing_one(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """libgomp keeps a team for every thread that runs a parallel region, and more OpenMP
    threads than cores make its barriers sleep: the model loads on the backend's own
    thread, and the self-check's thread has exited by the time registration returns."""
    import threading

    import butter.backends.llama_cpp.backend as backend_module

    loaded_on: list[str] = []
    real = backend_module.LlamaModel

    def recording(*args: Any, **kwargs: Any) -> Any:
        loaded_on.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(backend_module, "LlamaModel", recording)
    backend = _backend(tiny_gguf, fast_layers=True)
    try:
        assert loaded_on and loaded_on[0].startswith("butter-llama")
    finally:
        backend.close()
    ran_on: list[threading.Thread] = []
    assert layer_matmul._on_a_passing_thread(
        lambda: ran_on.append(threading.current_thread()) or 7) == 7
    assert ran_on[0] is not threading.current_thread() and not ran_on[0].is_alive()


def _q8_k_rows() -> list[np.ndarray]:
    """Rows of 3 blocks each: random, with a zero block, with ties for the largest
    magnitude (the first wins), with NaNs ggml's scan passes over (one with a payload), values
    at .5 after scaling (ties of the rounding), and a block too small for its scale (an
    infinite iscale)."""
    rng = np.random.default_rng(11)
    rows = [rng.standard_normal(768).astype(np.float32) * scale for scale in (1e-3, 1.0, 40.0)]
    zero = rng.standard_normal(768).astype(np.float32)
    zero[256:512] = 0.0
    ties = rng.uniform(-1, 1, 768).astype(np.float32)
    ties[[3, 200, 300, 301]] = [-2.0, 2.0, 2.0, -2.0]
    nan = rng.standard_normal(768).astype(np.float32)
    nan[[5, 600]] = np.nan
    nan[7:8].view(np.uint32)[0] = 0x7FC00055  # a NaN with a payload: ggml stores 85
    # each block's largest -127 (iscale exactly 1), the rest x.5: a tie at every float
    halves = np.tile((np.arange(256, dtype=np.float32) - 128.0) / 2.0, 3)
    halves[::256] = -127.0
    tiny = rng.standard_normal(768).astype(np.float32)
    tiny[256:512] = 1e-39  # -127 / 1e-39 overflows: every product an inf
    return [*rows, zero, ties, nan, halves, tiny]


@pytest.mark.parametrize("row", range(8))
def test_butters_q8_k_activations_are_ggmls_bytes(row: int) -> None:
    """butter's K-quant matmuls quantize activations with their own vectorized Q8_K (ggml's
    quantize_row_q8_K is scalar on x86): the same bytes as ggml's, d, quants and sums."""
    lib = layer_matmul._library()
    x = np.ascontiguousarray(_q8_k_rows()[row])
    ours = (ctypes.c_uint8 * (3 * 292))()
    status = lib.butter_layer_matmul_quantize_q8_k(
        x.ctypes.data_as(ctypes.c_void_p), x.size, ours, ctypes.sizeof(ours))
    if status == layer_matmul.DECLINED:
        pytest.skip("no AVX2 here")
    assert status == layer_matmul.OK
    _, cpu = ggml_boundary.ggml_libraries()
    ggml_quantize = cpu.quantize_row_q8_K
    ggml_quantize.argtypes, ggml_quantize.restype = [ctypes.c_void_p, ctypes.c_void_p,
                                                     ctypes.c_int64], None
    theirs = (ctypes.c_uint8 * (3 * 292))()
    ggml_quantize(x.ctypes.data_as(ctypes.c_void_p), theirs, x.size)
    if row == 3:  # ggml leaves a zero block's sums as they were: compare d and quants there
        zero_sums = slice(292 + 4 + 256, 2 * 292)
        assert bytes(ours)[zero_sums] == bytes(32)
        assert bytes(ours)[:292] + bytes(ours)[292:292 + 260] + bytes(ours)[584:] == \
            bytes(theirs)[:292] + bytes(theirs)[292:292 + 260] + bytes(theirs)[584:]
    else:
        assert bytes(ours) == bytes(theirs)
    assert any(bytes(ours)[4:260])  # (not a block of zeros)
