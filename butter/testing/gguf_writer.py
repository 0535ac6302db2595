"""Writing a GGUF of any transformer shape: hyperparameters, vocabulary and tensors.

The one GGUF writer of the tests and benchmarks (gguf-py underneath): tiny_gguf.py writes
the tiny test models with it, real_shapes.py random-weight files with real models' shapes.
"""

from __future__ import annotations

import math
import os
import pathlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import gguf
import numpy as np
import numpy.typing as npt

F32Array = npt.NDArray[np.float32]

# How a tensor is stored: F32, F16, or a type gguf-py quantizes (Q8_0, Q4_0, ...).
GgmlType = gguf.GGMLQuantizationType
FLOAT_TYPES: Final[dict[Any, type[np.floating[Any]]]] = {
    GgmlType.F32: np.float32, GgmlType.F16: np.float16}


@dataclass(frozen=True)
class Shape:
    """A transformer's hyperparameters, as llama.cpp reads them for the ``qwen3`` and
    ``llama`` architectures: the tiny model's, and real models' (benchmarks/model_matrix.py
    writes random-weight files of Qwen3-0.6B's and Llama-3.2-1B's exact shapes)."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    rope_theta: float
    rms_eps: float
    qk_norm: bool = False  # per-head RMS norms of q and k (Qwen3)
    llama3_rope: bool = False  # Llama 3.1's rope scaling, stored as rope_freqs.weight
    # M-RoPE (Qwen-VL text models): the rotary pairs given to each of the 4 position
    # sections (time, height, width, unused); None: one position a token
    rope_sections: tuple[int, int, int, int] | None = None


@dataclass(frozen=True)
class Vocabulary:
    """A byte-level BPE tokenizer (llama.cpp's ``gpt2`` model) as GGUF metadata."""

    tokens: Sequence[str]  # by id
    types: Sequence[int]  # gguf.TokenType of each token
    merges: Sequence[tuple[str, str]]  # in rank order
    pre: str  # llama.cpp's pre-tokenizer name: "qwen2", "llama-bpe", ...
    bos: int
    eos: int
    eot: int
    pad: int
    add_bos: bool
    chat_template: str
    eom: int | None = None
    fim: Mapping[str, int] = field(default_factory=dict)  # a FIM_* metadata key: its token


@dataclass(frozen=True)
class Tensor:
    """One tensor of a file: its numpy shape ((out, in): GGUF's ne reversed), how it is
    stored, and a function that makes its values when it is written, so that a large
    model is never in memory all at once."""

    name: str
    shape: tuple[int, ...]
    ggml_type: Any  # a GgmlType
    values: Callable[[], npt.NDArray[Any]]


def _add_hparams(writer: gguf.GGUFWriter, shape: Shape, name: str,
                 file_type: gguf.LlamaFileType, *, full: bool) -> None:
    """The architecture's keys. ``full`` adds what llama.cpp's converter writes and the
    tiny model leaves out (its bytes stay as they were): the vocabulary size and the rope
    dimension count."""
    writer.add_name(name)
    writer.add_file_type(file_type)
    if full:
        writer.add_vocab_size(shape.n_vocab)
    writer.add_context_length(shape.n_ctx_train)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    if full:
        writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    if shape.rope_sections is not None:
        writer.add_rope_dimension_sections(list(shape.rope_sections))
    writer.add_layer_norm_rms_eps(shape.rms_eps)


def add_vocabulary(writer: gguf.GGUFWriter, vocab: Vocabulary) -> None:
    """Vocabulary, token types, merges, special ids and chat template, in the layout of
    the real models' GGUFs."""
    for key, token in vocab.fim.items():
        writer.add_uint32(key, token)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(list(vocab.tokens))
    writer.add_token_types(list(vocab.types))
    writer.add_token_merges([f"{a} {b}" for a, b in vocab.merges])  # GGUF stores "a b"
    writer.add_eos_token_id(vocab.eos)
    writer.add_eot_token_id(vocab.eot)
    if vocab.eom is not None:
        writer.add_eom_token_id(vocab.eom)
    writer.add_bos_token_id(vocab.bos)
    writer.add_pad_token_id(vocab.pad)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_chat_template(vocab.chat_template)


def _stored(tensor: Tensor) -> npt.NDArray[Any]:
    """The tensor's bytes as the file stores them."""
    values = tensor.values()
    if tensor.ggml_type in FLOAT_TYPES:
        return np.asarray(values, dtype=FLOAT_TYPES[tensor.ggml_type])
    quantized: npt.NDArray[Any] = gguf.quants.quantize(
        np.asarray(values, dtype=np.float32), tensor.ggml_type)
    return quantized


def write_gguf(
    path: str | os.PathLike[str], shape: Shape, vocab: Vocabulary, tensors: Sequence[Tensor],
    *, name: str, file_type: gguf.LlamaFileType, full_header: bool = True,
) -> pathlib.Path:
    """Write a GGUF of ``shape`` with ``vocab`` and ``tensors`` (in that order), one tensor
    at a time, under a ``.partial`` name renamed into place (a reader never sees a
    half-written model)."""
    target = pathlib.Path(path)
    partial = target.with_name(target.name + ".partial")
    writer = gguf.GGUFWriter(partial, arch=shape.arch)
    _add_hparams(writer, shape, name, file_type, full=full_header)
    add_vocabulary(writer, vocab)
    for tensor in tensors:
        if tensor.ggml_type in FLOAT_TYPES:
            dtype = np.dtype(FLOAT_TYPES[tensor.ggml_type])
            writer.add_tensor_info(tensor.name, tensor.shape, dtype,
                                   math.prod(tensor.shape) * dtype.itemsize)
        else:
            stored = gguf.quants.quant_shape_to_byte_shape(tensor.shape, tensor.ggml_type)
            writer.add_tensor_info(tensor.name, stored, np.dtype(np.uint8), math.prod(stored),
                                   raw_dtype=tensor.ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in tensors:
        writer.write_tensor_data(_stored(tensor))
    writer.close()
    os.replace(partial, target)
    return target


