"""butter's recurrent-layer ops (butter/native/delta_net.cpp: the Gated DeltaNet recurrence
and the short convolution) through real ggml graphs: llama.cpp's bits exactly, for each op
alone and for hybrid models' logits and greedy text, and the registration check that keeps
an op off where its sums would come out otherwise."""

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


def conv_lanes() -> tuple[LayerMatmul, int]:
    """The registered library and the vectors its short convolution runs on here: the
    widest this CPU has (each output is one chain of FMAs whatever the width, so every width
    gives llama.cpp's bits and the registration check keeps the widest)."""
    k = registered()
    if not k.delta_net_widths():
        pytest.skip("this CPU has neither AVX2 with FMA nor AVX-512")
    lanes = k.delta_net_widths()[0]
    assert k.short_conv == f"butter ({'AVX-512' if lanes == 16 else 'AVX2'})"
    return k, lanes


@pytest.mark.parametrize("lanes", [16, 8])
@pytest.mark.parametrize("probe", [
    {"tokens": 1, "channels": 96},  # a decode step
    {"tokens": 16, "channels": 16, "threads": 1},  # one whole tile (two at 8 lanes)
    {"tokens": 47, "channels": 64, "seqs": 2, "threads": 3},  # tiles and a tail
    {"tokens": 33, "channels": 32, "width": 3},  # LFM2's width
    {"tokens": 20, "channels": 48, "width": 2},
    {"tokens": 21, "channels": 32, "width": 5},  # 4 weights and a leftover
])
def test_butters_short_convolution_gives_llama_cpps_bits(probe: dict[str, int],
                                                         lanes: int) -> None:
    k, _ = conv_lanes()
    if lanes not in k.delta_net_widths():
        pytest.skip(f"this CPU has no vectors of {lanes} floats")
    ours = np.array(k.conv_probe(lanes=lanes, rounding=k.conv_rounding, **probe),
                    dtype=np.float32)
    theirs = np.array(k.conv_probe(lanes=0, **probe), dtype=np.float32)
    assert np.isfinite(theirs).all() and np.abs(theirs).max() > 0.1
    assert ours.view(np.uint32).tolist() == theirs.view(np.uint32).tolist()


def test_a_convolution_rounded_another_way_is_told_apart() -> None:
    """The registration check sees how llama.cpp's build sums a convolution: the other
    rounding differs from llama.cpp's on a width of 6 (4 weights and 2 leftovers), the
    registered one does not."""
    k, lanes = conv_lanes()
    probe = {"tokens": 19, "channels": 16, "width": 6}
    theirs = k.conv_probe(lanes=0, **probe)
    other = next(r for r in layer_matmul.CONV_ROUNDINGS if r != k.conv_rounding)
    assert k.conv_probe(lanes=lanes, rounding=other, **probe) != theirs
    assert k.conv_probe(lanes=lanes, rounding=k.conv_rounding, **probe) == theirs


def test_short_convolution_lanes_this_cpu_lacks_are_refused() -> None:
    k = registered()
    with pytest.raises(ValueError, match="no short convolution of 4 lanes"):
        k.use_short_conv(4)
    with pytest.raises(ValueError, match="could not run"):
        k.conv_probe(lanes=4, tokens=1, channels=16)


@pytest.fixture(scope="module", params=["tiny_qwen35_gguf", "tiny_lfm2_gguf"])
def backend(request: pytest.FixtureRequest) -> Iterator[tuple[str, LlamaCppBackend]]:
    path: Path = request.getfixturevalue(request.param)
    model = LlamaCppBackend(path, n_cells=512, n_seq=2, n_batch=256, threads=2)
    yield request.param, model
    model.close()


def test_a_hybrid_model_gives_the_same_logits_and_text_either_way(
        backend: tuple[str, LlamaCppBackend]) -> None:
    """The tiny Qwen3.5 (three delta-net layers of 4 heads of 32, each after a short
    convolution) and the tiny LFM2 (short convolutions alone): two prompts prefilled side by
    side in one step (two sequences of each op), then 12 greedy tokens each: butter's ops
    ran, and the logits and tokens are llama.cpp's, bit for bit."""
    k, lanes = conv_lanes()
    rounding = k.conv_rounding
    width = ggml_width() if ggml_width() in k.delta_net_widths() else 0
    name, model = backend
    prompts = [PROMPT * 2, PROMPT[::-1]]
    before = k.counters()
    ours, ours_first = generate_greedy(model, prompts, 12)
    after = k.counters()
    assert after.short_convs > before.short_convs
    if width and "qwen35" in name:
        assert after.delta_nets > before.delta_nets
    try:
        k.use_delta_net(0)
        k.use_short_conv(0)
        theirs, theirs_first = generate_greedy(model, prompts, 12)
        again = k.counters()  # llama.cpp computed them this time:
        assert (again.delta_nets, again.short_convs) == (after.delta_nets, after.short_convs)
    finally:
        k.use_delta_net(width)
        k.use_short_conv(lanes, rounding)
    assert ours == theirs
    assert ours_first.view(np.uint32).tolist() == theirs_first.view(np.uint32).tolist()
