"""butter's Gated DeltaNet recurrence (butter/native/delta_net.cpp) through real ggml graphs:
llama.cpp's bits exactly, for the op alone and for a hybrid model's logits and greedy text,
and the registration check that keeps it off where its sums would come out otherwise."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import llama_cpp as ll
import numpy as np
import pytest

from butter.backends.llama_cpp import LlamaCppBackend, layer_matmul
from butter.backends.llama_cpp.layer_matmul import LayerMatmul
from butter.backends.native import Unavailable
from tests.backend_steps import generate_greedy

PROMPT = ("The quick brown fox jumps over the lazy dog. The dog did not mind; it was "
          "asleep in the sun, dreaming of the 3 bones it had buried.")


def registered() -> LayerMatmul:
    try:
        return layer_matmul.registered()
    except Unavailable as exc:
        pytest.skip(f"butter's kernels are off here: {exc}")


def ggml_width() -> int:
    """The vector width ggml's CPU backend was compiled for (GGML_F32_EPR), from its system
    info: the width whose sums butter's op must reproduce; 0 where neither."""
    system = ll.llama_print_system_info().decode()
    if "AVX512 = 1" in system:
        return 16
    return 8 if "AVX2 = 1" in system and "FMA = 1" in system else 0


def kernels() -> tuple[LayerMatmul, int]:
    """The registered library and the width butter's op runs at here."""
    k = registered()
    width = ggml_width()
    if width not in k.delta_net_widths():
        pytest.skip(f"ggml's width ({width}) is not one butter runs here ({k.delta_net_widths()})")
    return k, width


def test_the_registration_check_keeps_butters_op_where_ggml_sums_as_it_does() -> None:
    """Where this CPU runs the width ggml was compiled for, butter computes the op at it (a
    kernel whose bits stray from llama.cpp's would be seen here, not skipped)."""
    k, width = kernels()
    assert k.delta_net == f"butter ({'AVX-512' if width == 16 else 'AVX2'})"


@pytest.mark.parametrize("probe", [
    {"tokens": 1, "heads": 16, "dim": 128},  # a Qwen3.5 decode step
    {"tokens": 64, "heads": 2, "dim": 128},  # one block of tokens exactly
    {"tokens": 131, "heads": 3, "dim": 128, "seqs": 2},  # blocks and a partial one
    {"tokens": 3, "heads": 2, "dim": 128, "snapshots": 5},  # fewer tokens than snapshots
    {"tokens": 66, "heads": 2, "dim": 256, "snapshots": 4},  # a snapshot before the last block
    {"tokens": 20, "heads": 4, "dim": 64, "per_column": True, "threads": 3},
    {"tokens": 17, "heads": 1, "dim": 32, "threads": 1},
])
def test_butters_op_gives_llama_cpps_bits(probe: dict[str, int]) -> None:
    k, width = kernels()
    ours = np.array(k.delta_net_probe(width=width, **probe), dtype=np.float32)
    theirs = np.array(k.delta_net_probe(width=0, **probe), dtype=np.float32)
    assert np.isfinite(theirs).all() and np.abs(theirs).max() > 0.1  # a probe with values
    assert ours.view(np.uint32).tolist() == theirs.view(np.uint32).tolist()


def test_a_width_summing_in_another_order_is_told_apart() -> None:
    """The registration check has teeth: where this CPU runs both widths, the one ggml was
    not compiled for sums each dot product in another order, and the check sees it."""
    k, chosen = kernels()
    others = [width for width in k.delta_net_widths() if width != chosen]
    if not others:
        pytest.skip(f"this CPU runs one width only ({k.delta_net_widths()})")
    probe = layer_matmul.DELTA_NET_PROBES[1]
    theirs = k.delta_net_probe(width=0, **probe)
    assert k.delta_net_probe(width=others[0], **probe) != theirs
    assert k.delta_net_probe(width=chosen, **probe) == theirs


def test_a_width_this_cpu_lacks_is_refused() -> None:
    k = registered()
    with pytest.raises(ValueError, match="no Gated DeltaNet kernel of width 4"):
        k.use_delta_net(4)
    with pytest.raises(ValueError, match="could not run"):
        k.delta_net_probe(width=4, tokens=1, heads=1, dim=128)


@pytest.fixture(scope="module")
def backend(tiny_qwen35_gguf: Path) -> Iterator[LlamaCppBackend]:
    model = LlamaCppBackend(tiny_qwen35_gguf, n_cells=512, n_seq=2, n_batch=256, threads=2)
    yield model
    model.close()


def test_a_hybrid_model_gives_the_same_logits_and_text_either_way(
        backend: LlamaCppBackend) -> None:
    """The tiny Qwen3.5 (three delta-net layers of 4 heads of 32): two prompts prefilled side
    by side in one step (two sequences of the op), then 12 greedy tokens each: butter's
    recurrence ran, and the logits and tokens are llama.cpp's, bit for bit."""
    k, width = kernels()
    prompts = [PROMPT * 2, PROMPT[::-1]]
    before = k.counters().delta_nets
    ours, ours_first = generate_greedy(backend, prompts, 12)
    assert k.counters().delta_nets > before
    try:
        k.use_delta_net(0)
        between = k.counters().delta_nets
        theirs, theirs_first = generate_greedy(backend, prompts, 12)
        assert k.counters().delta_nets == between  # llama.cpp computed them this time
    finally:
        k.use_delta_net(width)
    assert ours == theirs
    assert ours_first.view(np.uint32).tolist() == theirs_first.view(np.uint32).tolist()
