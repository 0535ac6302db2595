"""Random-weight GGUFs with the exact shapes of real models, their tokenizers' layout
included (benchmarks/model_matrix.py): written in F16 by gguf_writer, then quantized by
llama.cpp's own quantizer.
"""

from __future__ import annotations

import functools
import math
import os
import pathlib
import zlib
from collections.abc import Callable, Sequence
from typing import Any, Final

import gguf
import numpy as np
import numpy.typing as npt

from butter.testing.gguf_writer import (
    FLOAT_TYPES,
    F32Array,
    GgmlType,
    Shape,
    Tensor,
    Vocabulary,
    write_gguf,
)
from butter.testing.tiny_gguf import CHAT_TEMPLATE

# --- real shapes ------------------------------------------------------------------
#
# benchmarks/model_matrix.py writes random-weight files with the exact shapes of real
# models (Qwen3-0.6B, Llama-3.2-1B), their tokenizers' layout included, through the same
# writer: F16 here, then llama.cpp's own quantizer (quantize_gguf) for the K-quant mixes.

# Qwen3's added tokens, in id order after its BPE vocabulary.
QWEN3_ADDED: Final = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
    "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
)  # fmt: skip


def llama3_specials() -> list[str]:
    """Llama 3.1/3.2's 256 special tokens, in id order from 128000."""
    named = {
        0: "<|begin_of_text|>", 1: "<|end_of_text|>", 4: "<|finetune_right_pad_id|>",
        6: "<|start_header_id|>", 7: "<|end_header_id|>", 8: "<|eom_id|>", 9: "<|eot_id|>",
        10: "<|python_tag|>",
    }  # fmt: skip
    out: list[str] = []
    reserved = 0
    for offset in range(256):
        if offset in named:
            out.append(named[offset])
        else:
            out.append(f"<|reserved_special_token_{reserved}|>")
            reserved += 1
    return out


# Llama 3.1/3.2 style, written for the benchmarks in the spirit of Meta's template: the
# system header with the knowledge and current dates, tools as JSON in the first user turn
# (or the system turn), calls as {"name", "parameters"} JSON, results in ipython turns.
LLAMA3_CHAT_TEMPLATE: Final = """\
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable -%}
        {%- for part in content -%}
            {%- if part is mapping and part.type == 'text' -%}{{- part.text -}}{%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages and messages[0].role == 'system' %}
    {%- set system_message = render_content(messages[0].content) | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{%- set tools_in_user = tools and tools_in_user_message and messages
    and messages[0].role == 'user' %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools %}
    {{- 'Environment: ipython\\n' }}
{%- endif %}
{{- 'Cutting Knowledge Date: December 2023\\n' }}
{{- 'Today Date: ' + date_string + '\\n\\n' }}
{%- if tools and not tools_in_user %}
    {{- 'You have access to the following functions. To call a function, respond with ' }}
    {{- 'JSON for a function call.\\n' }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of ' }}
    {{- 'argument name and its value}. Do not use variables.\\n\\n' }}
    {%- for tool in tools %}
        {{- tool | tojson(indent=4) + '\\n\\n' }}
    {%- endfor %}
{%- endif %}
{{- system_message + '<|eot_id|>' }}
{%- if tools_in_user %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}
    {{- 'Given the following functions, please respond with a JSON for a function call ' }}
    {{- 'with its proper arguments that best answers the given prompt.\\n\\n' }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of ' }}
    {{- 'argument name and its value}. Do not use variables.\\n\\n' }}
    {%- for tool in tools %}
        {{- tool | tojson(indent=4) + '\\n\\n' }}
    {%- endfor %}
    {{- render_content(messages[0].content) | trim + '<|eot_id|>' }}
    {%- set messages = messages[1:] %}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'assistant' and message.tool_calls %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {%- for tool_call in message.tool_calls %}
            {%- set call = tool_call.function if tool_call.function else tool_call %}
            {%- if not loop.first %}
                {{- '\\n' }}
            {%- endif %}
            {{- '{"name": "' + call.name + '", "parameters": ' }}
            {%- if call.arguments is string %}
                {{- call.arguments }}
            {%- else %}
                {{- call.arguments | tojson }}
            {%- endif %}
            {{- '}' }}
        {%- endfor %}
        {{- '<|eot_id|>' }}
    {%- elif message.role == 'tool' or message.role == 'ipython' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}
        {%- if message.content is mapping %}
            {{- message.content | tojson }}
        {%- else %}
            {{- render_content(message.content) }}
        {%- endif %}
        {{- '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' }}
        {{- render_content(message.content) | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Llama 3.2's rope scaling (rope_scaling in its config.json).
LLAMA3_ROPE_FACTOR: Final = 32.0
LLAMA3_LOW_FREQ_FACTOR: Final = 1.0
LLAMA3_HIGH_FREQ_FACTOR: Final = 4.0
LLAMA3_ORIGINAL_CTX: Final = 8192

# Random weights of real shapes: N(0, 0.02) matrices, 1 + N(0, 0.02) norms.
REAL_MATRIX_STD: Final = 0.02
REAL_NORM_STD: Final = 0.02

# llama.cpp's ftype numbers (enum llama_ftype) for quantize_gguf.
QUANT_FTYPES: Final = {"Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}


def real_vocabulary(shape: Shape, bpe: Sequence[str], merges: Sequence[tuple[str, str]],
                    pre: str) -> Vocabulary:
    """A BPE vocabulary (``bpe``: its tokens by id, bytes first) completed the way the real
    model's GGUF is: for ``qwen3``, Qwen3's added tokens (``<|...|>`` ones control tokens,
    ``<tool_call>``, ``<think>`` and the like user-defined, as llama.cpp's converter types
    them) and ``[PAD…]`` tokens up to ``shape.n_vocab``, eos ``<|im_end|>``, no BOS added,
    the tiny model's ChatML template; for ``llama``, Llama 3.1's 256 special tokens, BOS
    added, eos/eot ``<|eot_id|>``, eom ``<|eom_id|>``, a Llama-3-style template."""
    tokens = list(bpe)
    types: list[int] = [gguf.TokenType.NORMAL] * len(tokens)
    if shape.arch == "qwen3":
        for text in QWEN3_ADDED:
            tokens.append(text)
            looks_special = text.startswith("<|") and text.endswith("|>")
            types.append(gguf.TokenType.CONTROL if looks_special else gguf.TokenType.USER_DEFINED)
        while len(tokens) < shape.n_vocab:
            tokens.append(f"[PAD{len(tokens)}]")
            types.append(gguf.TokenType.UNUSED)
        ids = {text: tokens.index(text) for text in QWEN3_ADDED}
        fim = {
            gguf.Keys.Tokenizer.FIM_PRE_ID: ids["<|fim_prefix|>"],
            gguf.Keys.Tokenizer.FIM_SUF_ID: ids["<|fim_suffix|>"],
            gguf.Keys.Tokenizer.FIM_MID_ID: ids["<|fim_middle|>"],
            gguf.Keys.Tokenizer.FIM_PAD_ID: ids["<|fim_pad|>"],
            gguf.Keys.Tokenizer.FIM_REP_ID: ids["<|repo_name|>"],
            gguf.Keys.Tokenizer.FIM_SEP_ID: ids["<|file_sep|>"],
        }
        vocab = Vocabulary(tokens, types, merges, pre, bos=ids["<|endoftext|>"],
                           eos=ids["<|im_end|>"], eot=ids["<|im_end|>"],
                           pad=ids["<|endoftext|>"], add_bos=False,
                           chat_template=CHAT_TEMPLATE, fim=fim)
    elif shape.arch == "llama":
        specials = llama3_specials()
        first = len(tokens)
        tokens += specials
        types += [gguf.TokenType.CONTROL] * len(specials)
        ids = {text: first + offset for offset, text in enumerate(specials[:11])}
        vocab = Vocabulary(tokens, types, merges, pre, bos=ids["<|begin_of_text|>"],
                           eos=ids["<|eot_id|>"], eot=ids["<|eot_id|>"],
                           eom=ids["<|eom_id|>"], pad=ids["<|finetune_right_pad_id|>"],
                           add_bos=True, chat_template=LLAMA3_CHAT_TEMPLATE)
    else:
        raise ValueError(f"no real tokenizer layout for arch {shape.arch!r}")
    if len(tokens) != shape.n_vocab:
        raise ValueError(f"{len(tokens)} tokens, the shape has {shape.n_vocab}")
    return vocab


def llama3_rope_factors(shape: Shape) -> F32Array:
    """``rope_freqs.weight`` as llama.cpp's converter computes it for llama3 scaling."""
    dim = shape.head_dim
    factors: list[float] = []
    low_wavelen = LLAMA3_ORIGINAL_CTX / LLAMA3_LOW_FREQ_FACTOR
    high_wavelen = LLAMA3_ORIGINAL_CTX / LLAMA3_HIGH_FREQ_FACTOR
    for i in range(0, dim, 2):
        freq = 1.0 / (shape.rope_theta ** (i / dim))
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(LLAMA3_ROPE_FACTOR)
        else:
            smooth = (LLAMA3_ORIGINAL_CTX / wavelen - LLAMA3_LOW_FREQ_FACTOR) / (
                LLAMA3_HIGH_FREQ_FACTOR - LLAMA3_LOW_FREQ_FACTOR
            )
            factors.append(1.0 / ((1 - smooth) / LLAMA3_ROPE_FACTOR + smooth))
    return np.asarray(factors, dtype=np.float32)


def _seeded_values(name: str, dims: tuple[int, ...], dtype: type[np.floating[Any]],
                   seed: int) -> npt.NDArray[Any]:
    """Deterministic random contents, seeded by the tensor's name: N(0, 0.02) matrices
    (filled 64 MB of float32 at a time), 1 + N(0, 0.02) norms."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if len(dims) == 1:
        norm = rng.standard_normal(dims, dtype=np.float32) * np.float32(REAL_NORM_STD)
        return (norm + np.float32(1.0)).astype(dtype)
    out = np.empty(dims, dtype=dtype)
    rows = max(1, (1 << 24) // dims[1])
    for start in range(0, dims[0], rows):
        chunk = rng.standard_normal((min(rows, dims[0] - start), dims[1]), dtype=np.float32)
        chunk *= np.float32(REAL_MATRIX_STD)
        out[start : start + len(chunk)] = chunk
    return out


def real_tensors(shape: Shape, *, seed: int = 0) -> list[Tensor]:
    """Every tensor of ``shape`` in the converter's order: matrices F16, norms (and
    llama3's rope factors) F32, the output matrix tied to the token embedding (no
    output.weight), as in both real models."""
    q_dim, kv_dim = shape.n_head * shape.head_dim, shape.n_head_kv * shape.head_dim
    f16, f32 = GgmlType.F16, GgmlType.F32
    plan: list[tuple[str, tuple[int, ...], Any]] = [
        ("token_embd.weight", (shape.n_vocab, shape.n_embd), f16),
    ]
    if shape.llama3_rope:
        plan.append(("rope_freqs.weight", (shape.head_dim // 2,), f32))
    for i in range(shape.n_layer):
        blk = f"blk.{i}"
        plan += [
            (f"{blk}.attn_norm.weight", (shape.n_embd,), f32),
            (f"{blk}.attn_q.weight", (q_dim, shape.n_embd), f16),
            (f"{blk}.attn_k.weight", (kv_dim, shape.n_embd), f16),
            (f"{blk}.attn_v.weight", (kv_dim, shape.n_embd), f16),
            (f"{blk}.attn_output.weight", (shape.n_embd, q_dim), f16),
        ]
        if shape.qk_norm:
            plan += [
                (f"{blk}.attn_q_norm.weight", (shape.head_dim,), f32),
                (f"{blk}.attn_k_norm.weight", (shape.head_dim,), f32),
            ]
        plan += [
            (f"{blk}.ffn_norm.weight", (shape.n_embd,), f32),
            (f"{blk}.ffn_gate.weight", (shape.n_ff, shape.n_embd), f16),
            (f"{blk}.ffn_up.weight", (shape.n_ff, shape.n_embd), f16),
            (f"{blk}.ffn_down.weight", (shape.n_embd, shape.n_ff), f16),
        ]
    plan.append(("output_norm.weight", (shape.n_embd,), f32))

    def values(name: str, dims: tuple[int, ...], ggml_type: Any) -> Callable[[], Any]:
        if name == "rope_freqs.weight":
            return functools.partial(llama3_rope_factors, shape)
        return functools.partial(_seeded_values, name, dims, FLOAT_TYPES[ggml_type], seed)

    return [Tensor(name, dims, ggml_type, values(name, dims, ggml_type))
            for name, dims, ggml_type in plan]


def write_real_shape_gguf(path: str | os.PathLike[str], shape: Shape, vocab: Vocabulary, *,
                          name: str, seed: int = 0) -> pathlib.Path:
    """A random-weight F16 GGUF of ``shape`` with ``vocab`` (see real_vocabulary), written
    one tensor at a time: the largest tensor is the peak memory. quantize_gguf turns it
    into the quantized files people run."""
    return write_gguf(path, shape, vocab, real_tensors(shape, seed=seed), name=name,
                      file_type=gguf.LlamaFileType.MOSTLY_F16)


def quantize_gguf(source: str | os.PathLike[str], target: str | os.PathLike[str], quant: str,
                  *, threads: int = 2) -> pathlib.Path:
    """llama.cpp's own quantizer, as ``llama-quantize SOURCE TARGET QUANT THREADS`` runs
    it: ``quant`` one of QUANT_FTYPES, whose mixes (which tensor gets which type) are
    llama.cpp's. Written under a ``.partial`` name and renamed into place."""
    import ctypes

    import llama_cpp

    target_path = pathlib.Path(target)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = QUANT_FTYPES[quant]
    params.nthread = threads
    partial = target_path.with_name(target_path.name + ".partial")
    rc = llama_cpp.llama_model_quantize(
        str(source).encode(), str(partial).encode(), ctypes.byref(params))
    if rc != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize({source} -> {quant}) returned {rc}")
    os.replace(partial, target_path)
    return target_path
