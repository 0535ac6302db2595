"""The tiny hybrid models on the real llama.cpp, and the claims of
docs/design/hybrid-checkpoints-plan.md (#51) that butter's context checkpoints would rest
on: a PARTIAL_ONLY state save is the recurrent state alone (its size does not grow with
the sequence), and restoring it lets a partial `llama_memory_seq_rm` cut the attention
cache, after which a different continuation computes what a fresh sequence computes.

Each claim runs on two hybrid families whose recurrent layers differ: Qwen3.5 (gated
delta-net: a conv state and an ssm state per layer) and LFM2 (gated short conv: a conv
state alone), so that what holds is a rule of hybrid models, not of one architecture."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import llama_cpp as ll
import numpy as np
import pytest

from butter.backends.base import RemoveTokens, SeqWork, SetSampler
from butter.backends.llama_cpp import LlamaCppBackend
from butter.sampling import SamplingParams
from butter.testing.tiny_hybrid import (
    LFM2_LAYER_TYPES,
    N_LAYER,
    is_recurrent_layer,
    lfm2_is_conv_layer,
    lfm2_recurrent_state_floats,
    recurrent_state_floats,
    write_tiny_lfm2_gguf,
    write_tiny_qwen35_gguf,
)
from tests.backend_steps import generate_greedy

T = TypeVar("T")

PARTIAL = ll.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
PROMPT = ("The quick brown fox jumps over the lazy dog. The dog did not mind; it was "
          "asleep in the sun, dreaming of the 3 bones it had buried.")
OTHER = " Hello! How are you today? I'm fine, thank you."


@dataclass(frozen=True)
class Family:
    """One tiny hybrid model and the size of its PARTIAL_ONLY checkpoint."""

    arch: str  # general.architecture, as llama.cpp loads it
    fixture: str
    checkpoint_bytes: int  # measured, and pinned
    state_floats: int  # the formula's: n_embd_r + n_embd_s over the recurrent layers
    recurrent_layers: int
    # f16 K and V of the attention layers alone (one in each tiny file): 2 KV heads of 32
    # (qwen35) or of 16 (lfm2), K and V, 2 bytes each
    kv_bytes_per_token: int


# The PARTIAL_ONLY checkpoint is 28 B of headers (magic, seq id, cell count, the cell's pos
# and seq count, s_trans, n_layer), then per recurrent layer an r and an s tensor, each
# with 12 B of header (type, row size) before its f32 row: the plan's formula (see its
# "Verified" section).
# qwen35: 3 delta-net layers of (n_embd_r + n_embd_s) = (768 + 4096) f32.
# lfm2: 3 short-conv layers of n_embd_r = n_embd * (l_cache - 1) = 64 * 2 f32, and an s
# tensor of n_embd_s = 0 floats (its header is still written).
FAMILIES = {
    "qwen35": Family("qwen35", "tiny_qwen35_gguf", 58_468, recurrent_state_floats(),
                     sum(map(is_recurrent_layer, range(N_LAYER))), 2 * 2 * 32 * 2),
    "lfm2": Family("lfm2", "tiny_lfm2_gguf", 1_636, lfm2_recurrent_state_floats(),
                   sum(map(lfm2_is_conv_layer, range(len(LFM2_LAYER_TYPES)))), 2 * 2 * 16 * 2),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> Family:
    return FAMILIES[request.param]


@pytest.fixture(scope="module")
def backend(request: pytest.FixtureRequest, family: Family) -> Iterator[LlamaCppBackend]:
    path: Path = request.getfixturevalue(family.fixture)
    model = LlamaCppBackend(path, n_cells=256, n_seq=2, n_batch=64, threads=2)
    yield model
    model.close()


@pytest.mark.parametrize("write", [write_tiny_qwen35_gguf, write_tiny_lfm2_gguf])
def test_the_same_seed_writes_the_same_bytes(write: Callable[..., Path], tmp_path: Path) -> None:
    first = write(tmp_path / "a.gguf", seed=3).read_bytes()
    assert write(tmp_path / "b.gguf", seed=3).read_bytes() == first
    assert write(tmp_path / "c.gguf", seed=4).read_bytes() != first
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a.gguf", "b.gguf", "c.gguf"]


def _on_thread(backend: LlamaCppBackend, fn: Callable[[], T]) -> T:
    """Run a llama.cpp call on the backend's own thread, where its steps run."""
    return backend._worker.call(fn)


def _save(backend: LlamaCppBackend, seq: int, flags: int) -> bytes:
    def save() -> bytes:
        ctx = backend.model.ctx
        size = int(ll.llama_state_seq_get_size_ext(ctx, seq, flags))
        buffer = (ctypes.c_uint8 * size)()
        written = int(ll.llama_state_seq_get_data_ext(ctx, buffer, size, seq, flags))
        assert written == size
        return ctypes.string_at(buffer, written)
    return _on_thread(backend, save)


def _load(backend: LlamaCppBackend, data: bytes, seq: int, flags: int) -> int:
    def load() -> int:
        source = ctypes.cast(ctypes.c_char_p(data), ctypes.POINTER(ctypes.c_uint8))
        return int(ll.llama_state_seq_set_data_ext(backend.model.ctx, source, len(data),
                                                   seq, flags))
    return _on_thread(backend, load)


def _seq_rm(backend: LlamaCppBackend, seq: int, start: int, end: int) -> bool:
    return _on_thread(backend, lambda: bool(ll.llama_memory_seq_rm(backend.model.mem, seq,
                                                                     start, end)))


def _pos_max(backend: LlamaCppBackend, seq: int) -> int:
    return _on_thread(backend, lambda: int(ll.llama_memory_seq_pos_max(backend.model.mem, seq)))


def _evaluate(backend: LlamaCppBackend, seq: int, tokens: list[int], start: int) -> Any:
    """Evaluate `tokens` of `seq` from position `start` in one step; the last one's logits."""
    backend.step([SetSampler(seq, SamplingParams(temperature=0))],
                 [SeqWork(seq, tuple(tokens), start, sample=True, prompt=True)])
    return np.asarray(backend.step_logits(len(tokens) - 1))


def _clear(backend: LlamaCppBackend) -> None:
    backend.step([RemoveTokens(0, -1, -1), RemoveTokens(1, -1, -1)], [])


def _architecture(backend: LlamaCppBackend) -> str:
    def read() -> str:
        value = ctypes.create_string_buffer(64)
        written = ll.llama_model_meta_val_str(backend.model.model, b"general.architecture",
                                              value, len(value))
        assert written > 0
        return value.value.decode()
    return _on_thread(backend, read)


def test_the_tiny_hybrid_loads_as_a_hybrid_and_decodes_deterministically(
    backend: LlamaCppBackend, family: Family,
) -> None:
    assert _architecture(backend) == family.arch
    assert _on_thread(backend, lambda: bool(ll.llama_model_is_hybrid(backend.model.model)))
    assert not _on_thread(backend,
                          lambda: bool(ll.llama_model_is_recurrent(backend.model.model)))
    assert backend.info.is_recurrent  # butter's flag: recurrent or hybrid
    assert backend.rewind_limit == 1
    # (what /v1/server and the boot banner say a position costs: its attention layers')
    assert backend.kv_bytes_per_token == family.kv_bytes_per_token
    first, logits = generate_greedy(backend, [PROMPT], 12)
    again, logits_again = generate_greedy(backend, [PROMPT], 12)
    assert first == again
    assert np.array_equal(logits, logits_again)
    assert len(set(first[0])) > 3  # random weights, but not stuck on one token


def test_a_partial_checkpoint_is_the_recurrent_state_alone(
    backend: LlamaCppBackend, family: Family,
) -> None:
    tokens = backend.tokenize(PROMPT, add_bos=False)
    _clear(backend)
    partial: dict[int, int] = {}
    full: dict[int, int] = {}
    position = 0
    for n in (4, len(tokens) // 2, len(tokens)):
        _evaluate(backend, 0, tokens[position:n], position)
        position = n
        partial[n] = len(_save(backend, 0, PARTIAL))
        full[n] = len(_save(backend, 0, ll.LLAMA_STATE_SEQ_FLAGS_NONE))
    assert set(partial.values()) == {family.checkpoint_bytes}
    assert family.checkpoint_bytes == (4 * family.state_floats + family.recurrent_layers * 24
                                       + 28)
    sizes = [full[n] for n in sorted(full)]
    assert sizes == sorted(set(sizes))  # the whole state grows with the attention KV


def test_restoring_a_checkpoint_lets_the_hybrid_cut_back_exactly(
    backend: LlamaCppBackend,
) -> None:
    """llama-server's order: save after k tokens, go on to n; to branch at k, restore the
    checkpoint, then seq_rm(k, -1) on the whole hybrid memory."""
    tokens = backend.tokenize(PROMPT, add_bos=False)
    other = backend.tokenize(OTHER, add_bos=False)
    k, n = len(tokens) // 2, len(tokens)
    _clear(backend)
    _evaluate(backend, 0, tokens[:k], 0)
    checkpoint = _save(backend, 0, PARTIAL)
    _evaluate(backend, 0, tokens[k:], k)

    assert not _seq_rm(backend, 0, k, -1)  # the recurrent part refuses a partial cut...
    assert _pos_max(backend, 0) == n - 1  # ...and nothing was removed
    assert _load(backend, checkpoint, 0, PARTIAL) == len(checkpoint)
    assert _seq_rm(backend, 0, k, -1)
    assert _pos_max(backend, 0) == k - 1
    branched = _evaluate(backend, 0, other, k)

    _evaluate(backend, 1, tokens[:k], 0)  # a fresh sequence, in the same chunks
    fresh = _evaluate(backend, 1, other, k)
    assert branched.dtype == np.float32
    assert np.array_equal(branched.view(np.uint32), fresh.view(np.uint32))  # bitwise
    _clear(backend)
    one_step = _evaluate(backend, 1, tokens[:k] + other, 0)  # (CPU: chunking changes nothing)
    assert np.array_equal(branched.view(np.uint32), one_step.view(np.uint32))
    _clear(backend)
    _evaluate(backend, 1, tokens[1:k + 1], 0)  # control: another prefix of k tokens
    assert not np.allclose(_evaluate(backend, 1, other, k), fresh, rtol=0, atol=1e-3)
