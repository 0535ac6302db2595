"""Tiny random-weight hybrid GGUFs: Qwen3.5 (llama.cpp's ``qwen35`` architecture) and LFM2
(``lfm2``), two hybrid families whose recurrent layers differ, so that rules about hybrid
models are tested on more than one of them.

Qwen3.5: gated delta-net (linear attention, recurrent) layers with a full-attention layer
every ``FULL_ATTENTION_INTERVAL``-th. LFM2: gated short-convolution layers (a conv state of
``l_cache - 1`` tokens, no ssm state) with full-attention layers where the per-layer
``head_count_kv`` array is non-zero. Both use the tiny tokenizer and ChatML template of
tiny_gguf.py. Hyperparameter keys and tensor names follow llama.cpp's loaders at the
pinned commit (src/models/qwen35.cpp and src/models/lfm2.cpp ``load_arch_hparams``/
``load_arch_tensors``, names from src/llama-arch.cpp); docs/design/hybrid-checkpoints-plan.md
§4 lists Qwen3.5's.
"""

from __future__ import annotations

import os
import pathlib
from typing import Final

import gguf
import numpy as np

from butter.testing.gguf_writer import F32Array, GgmlType, add_vocabulary
from butter.testing.tiny_gguf import (
    finish_file,
    norm_weight,
    output_weight,
    random_normal,
    tiny_vocab,
    tiny_vocabulary,
)

# --- model shape -------------------------------------------------------------

N_EMBD: Final = 64
N_LAYER: Final = 4
FULL_ATTENTION_INTERVAL: Final = 4  # layer i is full attention iff (i + 1) % 4 == 0
N_HEAD: Final = 4
N_HEAD_KV: Final = 2
HEAD_DIM: Final = 32
N_ROT: Final = 8  # a quarter of the head, as Qwen3.5 rotates
ROPE_SECTIONS: Final = (2, 1, 1, 0)  # sums to N_ROT / 2 (real: [11, 11, 10, 0] of 64)
N_FF: Final = 128
ROPE_THETA: Final = 10_000_000.0
RMS_EPS: Final = 1e-6
# Gated delta net: head_k_dim = head_v_dim = d_state; n_k heads = group count;
# n_v heads = time_step_rank (a multiple of n_k); d_inner = d_state * n_v.
SSM_D_STATE: Final = 32
SSM_N_GROUP: Final = 2
SSM_N_V_HEADS: Final = 4
SSM_D_INNER: Final = SSM_D_STATE * SSM_N_V_HEADS
SSM_D_CONV: Final = 4


def is_recurrent_layer(layer: int) -> bool:
    """llama.cpp's rule for ``full_attention_interval``."""
    return (layer + 1) % FULL_ATTENTION_INTERVAL != 0


def _attention_tensors(rng: np.random.Generator, prefix: str) -> dict[str, F32Array]:
    """A full-attention layer: q carries the query and its output gate (2 x n_head heads)."""
    q_dim, kv_dim = N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM
    return {
        prefix + "attn_q.weight": random_normal(rng, (2 * q_dim, N_EMBD), N_EMBD**-0.5),
        prefix + "attn_k.weight": random_normal(rng, (kv_dim, N_EMBD), N_EMBD**-0.5),
        prefix + "attn_v.weight": random_normal(rng, (kv_dim, N_EMBD), N_EMBD**-0.5),
        prefix + "attn_output.weight": random_normal(rng, (N_EMBD, q_dim), q_dim**-0.5),
        prefix + "attn_q_norm.weight": norm_weight(rng, HEAD_DIM),
        prefix + "attn_k_norm.weight": norm_weight(rng, HEAD_DIM),
    }


def _delta_net_tensors(rng: np.random.Generator, prefix: str) -> dict[str, F32Array]:
    """A gated delta-net layer; numpy shapes are GGUF ne reversed."""
    key_dim, value_dim = SSM_D_STATE * SSM_N_GROUP, SSM_D_INNER
    conv_dim = 2 * key_dim + value_dim
    a_log = np.log(rng.uniform(1.0, 16.0, SSM_N_V_HEADS)).astype(np.float32)
    return {
        prefix + "attn_qkv.weight": random_normal(rng, (conv_dim, N_EMBD), N_EMBD**-0.5),
        prefix + "attn_gate.weight": random_normal(rng, (value_dim, N_EMBD), N_EMBD**-0.5),
        prefix + "ssm_conv1d.weight": random_normal(rng, (conv_dim, SSM_D_CONV), SSM_D_CONV**-0.5),
        prefix + "ssm_dt.bias": random_normal(rng, (SSM_N_V_HEADS,), 0.5),
        prefix + "ssm_a": (-np.exp(a_log)).astype(np.float32),  # -exp(A_log), as converted
        prefix + "ssm_beta.weight": random_normal(rng, (SSM_N_V_HEADS, N_EMBD), N_EMBD**-0.5),
        prefix + "ssm_alpha.weight": random_normal(rng, (SSM_N_V_HEADS, N_EMBD), N_EMBD**-0.5),
        prefix + "ssm_norm.weight": norm_weight(rng, SSM_D_STATE),
        prefix + "ssm_out.weight": random_normal(rng, (N_EMBD, value_dim), value_dim**-0.5),
    }


def _all_tensors(seed: int, n_vocab: int) -> dict[str, F32Array]:
    rng = np.random.default_rng(seed)
    tensors = {"token_embd.weight": random_normal(rng, (n_vocab, N_EMBD), 1.0)}
    for layer in range(N_LAYER):
        prefix = f"blk.{layer}."
        tensors[prefix + "attn_norm.weight"] = norm_weight(rng, N_EMBD)
        tensors.update(_delta_net_tensors(rng, prefix) if is_recurrent_layer(layer)
                       else _attention_tensors(rng, prefix))
        tensors[prefix + "post_attention_norm.weight"] = norm_weight(rng, N_EMBD)
        tensors[prefix + "ffn_gate.weight"] = random_normal(rng, (N_FF, N_EMBD), N_EMBD**-0.5)
        tensors[prefix + "ffn_up.weight"] = random_normal(rng, (N_FF, N_EMBD), N_EMBD**-0.5)
        tensors[prefix + "ffn_down.weight"] = random_normal(rng, (N_EMBD, N_FF), N_FF**-0.5)
    tensors["output_norm.weight"] = norm_weight(rng, N_EMBD)
    tensors["output.weight"] = output_weight(rng, n_vocab, N_EMBD)
    return tensors


# Matrices stored as Q8_0 (as quantized GGUFs store them); norms, conv, a, dt, beta and
# alpha stay F32.
_QUANTIZED: Final = ("token_embd.weight", "output.weight", "attn_q.weight", "attn_k.weight",
                     "attn_v.weight", "attn_output.weight", "attn_qkv.weight",
                     "attn_gate.weight", "ssm_out.weight", "ffn_gate.weight",
                     "ffn_up.weight", "ffn_down.weight")


def recurrent_state_floats() -> int:
    """Floats of one sequence's recurrent state (llama-hparams.cpp n_embd_r + n_embd_s, per
    delta-net layer): what a PARTIAL_ONLY checkpoint holds, whatever the sequence length."""
    n_embd_r = (SSM_D_CONV - 1) * (SSM_D_INNER + 2 * SSM_N_GROUP * SSM_D_STATE)
    n_embd_s = SSM_D_STATE * SSM_D_INNER
    return sum(is_recurrent_layer(layer) for layer in range(N_LAYER)) * (n_embd_r + n_embd_s)


def write_tiny_qwen35_gguf(path: str | os.PathLike[str], *, seed: int = 0,
                           n_ctx_train: int = 4096) -> pathlib.Path:
    """Write the tiny hybrid Qwen3.5 to ``path`` (same seed, same bytes) and return it;
    written under a ``.partial`` name and renamed into place."""
    target = pathlib.Path(path)
    partial = target.with_name(target.name + ".partial")
    writer = gguf.GGUFWriter(partial, arch="qwen35")
    writer.add_name("tiny-qwen35")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_dimension_count(N_ROT)
    writer.add_rope_dimension_sections(list(ROPE_SECTIONS))
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_full_attention_interval(FULL_ATTENTION_INTERVAL)
    writer.add_ssm_conv_kernel(SSM_D_CONV)
    writer.add_ssm_inner_size(SSM_D_INNER)
    writer.add_ssm_state_size(SSM_D_STATE)
    writer.add_ssm_group_count(SSM_N_GROUP)
    writer.add_ssm_time_step_rank(SSM_N_V_HEADS)
    add_vocabulary(writer, tiny_vocabulary())
    for name, values in _all_tensors(seed, len(tiny_vocab())).items():
        if name.endswith(_QUANTIZED):
            qtype = GgmlType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, values)
    return finish_file(writer, partial, target)


# --- LFM2 ----------------------------------------------------------------------

# Layer types as LFM2's config.json spells them; llama.cpp knows a conv layer by its
# head_count_kv of 0 (conversion/lfm2.py writes the array, src/models/lfm2.cpp reads it).
# The real LFM2-350M interleaves them the same way: conv, conv, attention, conv, ...
LFM2_LAYER_TYPES: Final = ("conv", "conv", "full_attention", "conv")
LFM2_N_EMBD: Final = 64
LFM2_N_HEAD: Final = 4  # head size n_embd / n_head = 16 (LFM2 has no key_length key)
LFM2_N_HEAD_KV: Final = 2
LFM2_L_CACHE: Final = 3  # shortconv.l_cache: the conv kernel's width, as the real LFM2s
LFM2_N_FF: Final = 128
LFM2_ROPE_THETA: Final = 1_000_000.0
LFM2_RMS_EPS: Final = 1e-5


def lfm2_is_conv_layer(layer: int) -> bool:
    return LFM2_LAYER_TYPES[layer] == "conv"


def _lfm2_attention_tensors(rng: np.random.Generator, prefix: str) -> dict[str, F32Array]:
    head_dim = LFM2_N_EMBD // LFM2_N_HEAD
    kv_dim = LFM2_N_HEAD_KV * head_dim
    std = LFM2_N_EMBD**-0.5
    return {
        prefix + "attn_q.weight": random_normal(rng, (LFM2_N_EMBD, LFM2_N_EMBD), std),
        prefix + "attn_k.weight": random_normal(rng, (kv_dim, LFM2_N_EMBD), std),
        prefix + "attn_v.weight": random_normal(rng, (kv_dim, LFM2_N_EMBD), std),
        prefix + "attn_output.weight": random_normal(rng, (LFM2_N_EMBD, LFM2_N_EMBD), std),
        prefix + "attn_q_norm.weight": norm_weight(rng, head_dim),
        prefix + "attn_k_norm.weight": norm_weight(rng, head_dim),
    }


def _lfm2_conv_tensors(rng: np.random.Generator, prefix: str) -> dict[str, F32Array]:
    """A gated short-conv layer: in_proj makes the gates b and c and the input x (3 x n_embd),
    the depthwise conv runs over b * x, and out_proj maps c * conv back."""
    std = LFM2_N_EMBD**-0.5
    return {
        prefix + "shortconv.conv.weight": random_normal(rng, (LFM2_N_EMBD, LFM2_L_CACHE),
                                                        LFM2_L_CACHE**-0.5),
        prefix + "shortconv.in_proj.weight": random_normal(rng, (3 * LFM2_N_EMBD, LFM2_N_EMBD),
                                                           std),
        prefix + "shortconv.out_proj.weight": random_normal(rng, (LFM2_N_EMBD, LFM2_N_EMBD),
                                                            std),
    }


def _lfm2_tensors(seed: int, n_vocab: int) -> dict[str, F32Array]:
    rng = np.random.default_rng(seed)
    tensors = {"token_embd.weight": random_normal(rng, (n_vocab, LFM2_N_EMBD), 1.0)}
    for layer in range(len(LFM2_LAYER_TYPES)):
        prefix = f"blk.{layer}."
        tensors[prefix + "attn_norm.weight"] = norm_weight(rng, LFM2_N_EMBD)
        tensors.update(_lfm2_conv_tensors(rng, prefix) if lfm2_is_conv_layer(layer)
                       else _lfm2_attention_tensors(rng, prefix))
        tensors[prefix + "ffn_norm.weight"] = norm_weight(rng, LFM2_N_EMBD)
        tensors[prefix + "ffn_gate.weight"] = random_normal(rng, (LFM2_N_FF, LFM2_N_EMBD),
                                                            LFM2_N_EMBD**-0.5)
        tensors[prefix + "ffn_up.weight"] = random_normal(rng, (LFM2_N_FF, LFM2_N_EMBD),
                                                          LFM2_N_EMBD**-0.5)
        tensors[prefix + "ffn_down.weight"] = random_normal(rng, (LFM2_N_EMBD, LFM2_N_FF),
                                                            LFM2_N_FF**-0.5)
    # LFM2's final norm is stored as token_embd_norm (llama-arch.cpp LLM_TENSOR_OUTPUT_NORM_LFM2).
    tensors["token_embd_norm.weight"] = norm_weight(rng, LFM2_N_EMBD)
    # The real LFM2s tie the head to the embeddings; a separate one keeps greedy decoding
    # from repeating the last token (see output_weight).
    tensors["output.weight"] = output_weight(rng, n_vocab, LFM2_N_EMBD)
    return tensors


# Matrices stored as Q8_0; norms and the conv kernel (ggml_ssm_conv wants F32) stay F32.
_LFM2_QUANTIZED: Final = ("token_embd.weight", "output.weight", "attn_q.weight",
                          "attn_k.weight", "attn_v.weight", "attn_output.weight",
                          "shortconv.in_proj.weight", "shortconv.out_proj.weight",
                          "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")


def lfm2_recurrent_state_floats() -> int:
    """Floats of one sequence's recurrent state: llama-hparams.cpp's n_embd_r for LFM2,
    n_embd * (l_cache - 1), per conv layer; n_embd_s is 0 (no ssm keys, so ssm_d_state *
    ssm_d_inner). What a PARTIAL_ONLY checkpoint holds, whatever the sequence length."""
    n_embd_r = LFM2_N_EMBD * (LFM2_L_CACHE - 1)
    n_embd_s = 0
    conv_layers = sum(lfm2_is_conv_layer(layer) for layer in range(len(LFM2_LAYER_TYPES)))
    return conv_layers * (n_embd_r + n_embd_s)


def write_tiny_lfm2_gguf(path: str | os.PathLike[str], *, seed: int = 0,
                         n_ctx_train: int = 4096) -> pathlib.Path:
    """Write the tiny hybrid LFM2 to ``path`` (same seed, same bytes) and return it;
    written under a ``.partial`` name and renamed into place."""
    target = pathlib.Path(path)
    partial = target.with_name(target.name + ".partial")
    writer = gguf.GGUFWriter(partial, arch="lfm2")
    writer.add_name("tiny-lfm2")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(LFM2_N_EMBD)
    writer.add_block_count(len(LFM2_LAYER_TYPES))
    writer.add_feed_forward_length(LFM2_N_FF)
    writer.add_head_count(LFM2_N_HEAD)
    writer.add_head_count_kv([0 if kind == "conv" else LFM2_N_HEAD_KV
                              for kind in LFM2_LAYER_TYPES])
    writer.add_rope_freq_base(LFM2_ROPE_THETA)
    writer.add_layer_norm_rms_eps(LFM2_RMS_EPS)
    writer.add_shortconv_l_cache(LFM2_L_CACHE)
    writer.add_vocab_size(len(tiny_vocab()))
    add_vocabulary(writer, tiny_vocabulary())
    for name, values in _lfm2_tensors(seed, len(tiny_vocab())).items():
        if name.endswith(_LFM2_QUANTIZED):
            qtype = GgmlType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, values)
    return finish_file(writer, partial, target)
