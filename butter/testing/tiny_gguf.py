"""A tiny random-weight Qwen3 GGUF for fast llama.cpp engine tests.

The model is meaningless but structurally real: llama.cpp loads it with its
normal ``qwen3`` code path, tokenizes with a real byte-level BPE vocabulary
(``gpt2`` model, ``qwen2`` pre-tokenizer), knows the ChatML control tokens and
carries a ChatML chat template with tool support.  Everything is small enough
that writing and loading the file takes milliseconds.

``build_tiny_tokenizer()`` returns the equivalent Hugging Face tokenizer so
tests can check that llama.cpp and ``tokenizers`` agree on token ids.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
from collections.abc import Sequence
from typing import Any, Final

import gguf
import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from butter.testing.gguf_writer import (
    F32Array,
    GgmlType,
    Shape,
    Tensor,
    Vocabulary,
    add_vocabulary,
    write_gguf,
)

# --- model shape -------------------------------------------------------------

N_EMBD: Final = 64
N_LAYER: Final = 2
N_HEAD: Final = 4
N_HEAD_KV: Final = 2
HEAD_DIM: Final = 32  # llama.cpp quantized KV caches need 32-element blocks
N_FF: Final = 128
ROPE_THETA: Final = 1_000_000.0
# The tiny Qwen3-VL's M-RoPE sections: rotary pairs for time, height, width (HEAD_DIM / 2 in
# all, Qwen3-VL's proportions [24, 20, 20] of 64)
MROPE_SECTIONS: Final = (6, 5, 5, 0)
RMS_EPS: Final = 1e-6

# Merges requested from the BPE trainer; the corpus below is large enough to
# yield all of them, so the vocabulary is 256 bytes + 300 merges + specials.
N_MERGES: Final = 300

# --- tokenizer ---------------------------------------------------------------

# Qwen2's split regex, verbatim from its tokenizer.json.  llama.cpp's "qwen2"
# pre-tokenizer hard-codes an equivalent regex, so the HF side must split the
# same way or the two would produce different ids for the same text.
QWEN2_SPLIT_REGEX: Final = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

ENDOFTEXT: Final = "<|endoftext|>"
IM_START: Final = "<|im_start|>"
IM_END: Final = "<|im_end|>"

# Appended after the BPE vocabulary, in this order.  Control tokens are only
# recognised in text when the caller asks for special-token parsing;
# user-defined ones are always matched, like in the real Qwen3 GGUFs.
CONTROL_TOKENS: Final = (ENDOFTEXT, IM_START, IM_END)
USER_DEFINED_TOKENS: Final = ("<tool_call>", "</tool_call>", "<think>", "</think>")
# Fill-in-the-middle control tokens (Qwen2.5-Coder's names), appended only to a model
# written with fim=True.
FIM_TOKENS: Final = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")

# Small English text with digits, punctuation, contractions, JSON and some
# multi-byte characters, so that merges cover the kinds of text tests use.
CORPUS: Final = """\
The quick brown fox jumps over the lazy dog. The dog did not mind; it was
asleep in the sun, dreaming of the 3 bones it had buried in 2019 and the 12
it would bury next year. "Why is the sky blue?" asked the child. "Because
light is scattered by the air," said her mother, "and blue light is scattered
the most." It's a simple answer, but it's not the whole story.

Hello! How are you today? I'm fine, thank you. We'll meet at 10:30 at the
café on Main Street; they've got the best croissants in town. Don't be late:
the naïve waiter forgets orders after 11 o'clock, and the coffee costs $4.50.
The user asked the assistant a question, and the assistant gave an answer.
The system said: you are a helpful assistant. Please answer the question.

Numbers: 0 1 2 3 4 5 6 7 8 9, 42, 100, 3.14159, -7, 1e6, 50% and 1,000,000.
Lists work too: first, second, third; (a) apples, (b) bananas, [c] cherries.
Code looks like this: def add(a, b): return a + b  # adds two numbers
A tool call looks like {"name": "get_weather", "arguments": {"city": "Paris",
"unit": "celsius"}} and the result is {"temperature": 21, "sky": "sunny"}.

Multilingual text: 日本語のテキスト, 中文字符, Ελληνικά, Русский язык, español
with ñ, Übergröße in German, and emoji like 🙂 🎉 🚀 ❤️ that need four bytes.
Tabs\tand  double  spaces,\nnew lines, and trailing spaces   are text too.
Once upon a time there was a little model that could only say random things.
It tried and tried, and every time it spoke, the words came out in a new order.
"""

# --- chat template -----------------------------------------------------------

# ChatML in the Qwen2.5/Qwen3 shape, written for these tests.  Tools go into
# the system turn; assistant tool calls render as <tool_call> JSON; results of
# consecutive `tool` messages share one user turn of <tool_response> blocks.
# `enable_thinking=false` pre-fills an empty think block, as Qwen3 does.
CHAT_TEMPLATE: Final = """\
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable -%}
        {%- for part in content -%}
            {%- if part is mapping and part.type == 'text' -%}{{- part.text -}}{%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages and messages[0].role == 'system' %}
        {{- render_content(messages[0].content) + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou may call one or more of the functions below to help with ' }}
    {{- 'the request.\\n\\n' }}
    {{- 'Their signatures are listed inside <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nTo call a function, reply with a JSON object holding its name and ' }}
    {{- 'arguments inside <tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages and messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if message.reasoning_content %}
            {{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}
        {%- endif %}
        {%- set text = render_content(message.content) %}
        {{- text }}
        {%- for tool_call in message.tool_calls or [] %}
            {%- set call = tool_call.function if tool_call.function else tool_call %}
            {%- if text or not loop.first %}
                {{- '\\n' }}
            {%- endif %}
            {{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
            {%- if call.arguments is string %}
                {{- call.arguments }}
            {%- else %}
                {{- call.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + render_content(message.content) + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {{- render_content(message.content) + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""



# --- tokenizer construction --------------------------------------------------


def _split_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """Qwen2 regex split followed by the byte-to-unicode mapping.

    ``use_regex=False`` matters: ByteLevel's own GPT-2 regex would split the
    text a second time, differently from llama.cpp.
    """
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


@functools.cache
def _trained_vocab() -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """Train BPE on CORPUS once; return (tokens by id, merges in rank order).

    The trainer's own id order is alphabetical, so ids are re-assigned: id b
    is the byte-level symbol for byte b, then one id per new merged token in
    merge order.  That keeps the layout obvious when debugging token ids.
    """
    trainee = Tokenizer(models.BPE())
    trainee.pre_tokenizer = _split_pre_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=256 + N_MERGES,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    trainee.train_from_iterator([CORPUS], trainer=trainer)
    merges = [_as_pair(merge) for merge in json.loads(trainee.to_str())["model"]["merges"]]
    tokens = list(_byte_symbols())
    known = set(tokens)
    for a, b in merges:
        if a + b not in known:  # two merges can spell the same token
            known.add(a + b)
            tokens.append(a + b)
    return tuple(tokens), tuple(merges)


def _as_pair(merge: str | list[str]) -> tuple[str, str]:
    """tokenizers >= 0.20 serialises a merge as [a, b], older versions as "a b"."""
    first, second = merge.split(" ") if isinstance(merge, str) else merge
    return first, second


def _byte_symbols() -> list[str]:
    """The GPT-2 byte-to-unicode symbol of each byte value 0..255, in order.

    Printable Latin-1 bytes stand for themselves; the others (controls,
    space, ...) are shifted to U+0100 and up in byte order, e.g. " " -> "Ġ".
    """
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    symbols: list[str] = []
    shifted = 0
    for value in range(256):
        if value in printable:
            symbols.append(chr(value))
        else:
            symbols.append(chr(0x100 + shifted))
            shifted += 1
    return symbols


def build_tiny_tokenizer() -> Tokenizer:
    """The Hugging Face tokenizer that matches the tiny GGUF's vocabulary.

    A fresh object each call, because ``Tokenizer`` is mutable (padding,
    truncation, ``encode_special_tokens``) and tests may change it.
    """
    tokens, merges = _trained_vocab()
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    tokenizer.pre_tokenizer = _split_pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(text, special=True, normalized=False) for text in CONTROL_TOKENS]
    )
    tokenizer.add_tokens(
        [AddedToken(text, special=False, normalized=False) for text in USER_DEFINED_TOKENS]
    )
    return tokenizer


def tiny_bpe() -> tuple[list[str], list[tuple[str, str]]]:
    """The tiny model's byte-level BPE alone: its tokens by id (the 256 byte symbols
    first) and its merges in rank order, without the control and user-defined tokens."""
    tokens, merges = _trained_vocab()
    return list(tokens), list(merges)


def tiny_vocab() -> list[str]:
    """All token texts of the tiny model, indexed by token id."""
    tokens, _ = _trained_vocab()
    return [*tokens, *CONTROL_TOKENS, *USER_DEFINED_TOKENS]


def special_token_ids() -> dict[str, int]:
    """Token id of every control and user-defined token, by text."""
    vocab = tiny_vocab()
    return {text: vocab.index(text) for text in (*CONTROL_TOKENS, *USER_DEFINED_TOKENS)}


# --- weights -----------------------------------------------------------------


def random_normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> F32Array:
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)


def norm_weight(rng: np.random.Generator, size: int) -> F32Array:
    """RMSNorm gains near 1, jittered so the norms are not all identical."""
    return (1.0 + random_normal(rng, (size,), 0.1)).astype(np.float32)


def _layer_tensors(rng: np.random.Generator, layer: int, n_embd: int) -> dict[str, F32Array]:
    """One transformer block; numpy shapes are (out, in), i.e. GGUF ne reversed.

    Projections use std 1/sqrt(fan_in) so every block changes the residual
    stream by about as much as the embedding itself: the next token then
    depends on the whole context, not only on the last token.
    """
    q_dim, kv_dim, n_ff = N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM, N_FF * n_embd // N_EMBD
    in_std, ff_std, out_std = n_embd**-0.5, n_ff**-0.5, q_dim**-0.5
    shapes: dict[str, tuple[tuple[int, ...], float]] = {
        "attn_q": ((q_dim, n_embd), in_std),
        "attn_k": ((kv_dim, n_embd), in_std),
        "attn_v": ((kv_dim, n_embd), in_std),
        "attn_output": ((n_embd, q_dim), out_std),
        "ffn_gate": ((n_ff, n_embd), in_std),
        "ffn_up": ((n_ff, n_embd), in_std),
        "ffn_down": ((n_embd, n_ff), ff_std),
    }
    tensors = {
        f"blk.{layer}.{key}.weight": random_normal(rng, shape, std)
        for key, (shape, std) in shapes.items()
    }
    for key, size in (
        ("attn_norm", n_embd),
        ("ffn_norm", n_embd),
        ("attn_q_norm", HEAD_DIM),
        ("attn_k_norm", HEAD_DIM),
    ):
        tensors[f"blk.{layer}.{key}.weight"] = norm_weight(rng, size)
    return tensors


def output_weight(rng: np.random.Generator, n_vocab: int, n_embd: int) -> F32Array:
    """A separate random LM head (tying it to the embeddings makes greedy
    decoding repeat the last token).

    Rows of the control tokens are zero, so their logit is always 0 while the
    best of ~560 random logits is comfortably positive: greedy decoding never
    stops on its own, and tests control length with max_tokens/stop strings.
    """
    weight = random_normal(rng, (n_vocab, n_embd), n_embd**-0.5)
    for token_id in (special_token_ids()[text] for text in CONTROL_TOKENS):
        weight[token_id] = 0.0
    return weight


def _all_tensors(seed: int, n_vocab: int, n_embd: int = N_EMBD) -> dict[str, F32Array]:
    rng = np.random.default_rng(seed)
    tensors = {"token_embd.weight": random_normal(rng, (n_vocab, n_embd), 1.0)}
    for layer in range(N_LAYER):
        tensors.update(_layer_tensors(rng, layer, n_embd))
    tensors["output_norm.weight"] = norm_weight(rng, n_embd)
    tensors["output.weight"] = output_weight(rng, n_vocab, n_embd)
    return tensors


# --- the tiny model ---------------------------------------------------------------


def tiny_shape(*, width: int = N_EMBD, n_ctx_train: int = 4096, fim: bool = False,
               added_tokens: Sequence[str] = ()) -> Shape:
    """The tiny Qwen3's shape at hidden size ``width`` (the FFN scales with it)."""
    n_vocab = len(tiny_vocab()) + (len(FIM_TOKENS) if fim else 0) + len(added_tokens)
    return Shape("qwen3", N_LAYER, width, N_HEAD, N_HEAD_KV, HEAD_DIM, N_FF * width // N_EMBD,
                 n_vocab, n_ctx_train, ROPE_THETA, RMS_EPS, qk_norm=True)


def tiny_vocabulary(chat_template: str = CHAT_TEMPLATE, *, fim: bool = False,
                    added_tokens: Sequence[str] = ()) -> Vocabulary:
    """The tiny model's tokenizer, in the layout of Qwen's GGUFs: <|im_end|> ends a chat
    turn (eos and eot); <|endoftext|> is bos/pad and llama.cpp also treats it as
    end-of-generation by name. With ``fim``, the FIM tokens follow, named in the metadata;
    then ``added_tokens``, as user-defined tokens (matched in any text, like <think>)."""
    _, merges = _trained_vocab()
    vocab = tiny_vocab()
    ids = special_token_ids()
    n_base = len(vocab) - len(CONTROL_TOKENS) - len(USER_DEFINED_TOKENS)
    token_types = (
        [gguf.TokenType.NORMAL] * n_base
        + [gguf.TokenType.CONTROL] * len(CONTROL_TOKENS)
        + [gguf.TokenType.USER_DEFINED] * len(USER_DEFINED_TOKENS)
    )
    fim_ids: dict[str, int] = {}
    if fim:
        keys = (gguf.Keys.Tokenizer.FIM_PRE_ID, gguf.Keys.Tokenizer.FIM_SUF_ID,
                gguf.Keys.Tokenizer.FIM_MID_ID)
        fim_ids = dict(zip(keys, range(len(vocab), len(vocab) + len(FIM_TOKENS)), strict=True))
        vocab = [*vocab, *FIM_TOKENS]
        token_types += [gguf.TokenType.CONTROL] * len(FIM_TOKENS)
    vocab = [*vocab, *added_tokens]
    token_types += [gguf.TokenType.USER_DEFINED] * len(added_tokens)
    return Vocabulary(vocab, token_types, merges, "qwen2", bos=ids[ENDOFTEXT], eos=ids[IM_END],
                      eot=ids[IM_END], pad=ids[ENDOFTEXT], add_bos=False,
                      chat_template=chat_template, fim=fim_ids)


def finish_file(writer: gguf.GGUFWriter, partial: pathlib.Path,
                 target: pathlib.Path) -> pathlib.Path:
    """Write what `writer` holds to `partial`, then rename it into place (a reader never
    sees a half-written model)."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(partial, target)
    return target


def write_tiny_qwen3_gguf(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    n_ctx_train: int = 4096,
    name: str = "tiny-qwen3",
    chat_template: str | None = None,
    quantize: bool = True,
    fim: bool = False,
    f16_output: bool = False,
    q4_0: bool = False,
    width: int = N_EMBD,
    m_rope: bool = False,
    added_tokens: Sequence[str] = (),
) -> pathlib.Path:
    """Write the tiny Qwen3 model to ``path`` and return it as a Path.

    Same seed, same bytes.  The file is written next to its destination and
    renamed into place, so a reader never sees a half-written model.

    With ``fim``, the vocabulary ends with fill-in-the-middle tokens (FIM_TOKENS), named
    in the metadata as llama.cpp reads them.

    With ``quantize`` (the default) the matrices are stored as Q8_0, like the
    quantized GGUFs people run: llama.cpp then takes the same (batch-invariant)
    matmul paths as for real models. Norms stay F32. With ``f16_output`` the output
    matrix is stored as F16 whatever ``quantize`` says (like GGUFs that keep it unquantized).
    With ``q4_0`` the layer matrices are Q4_0 instead of Q8_0: a type llama.cpp repacks for
    its interleaved x86 kernels when weight repacking is on. ``width`` sets the hidden
    size (the FFN scales with it): 256 or more lets llama.cpp's quantizer use K-quants.
    With ``m_rope`` it is a Qwen3-VL text model instead (llama.cpp's ``qwen3vl``: the same
    tensors, M-RoPE positions in MROPE_SECTIONS), whose images take fewer positions than
    embeddings. ``added_tokens`` end the vocabulary as user-defined tokens (a slicing
    projector's markers, say: tiny_mmproj.IDEFICS3_MARKERS).
    """
    shape = tiny_shape(width=width, n_ctx_train=n_ctx_train, fim=fim,
                       added_tokens=added_tokens)
    if m_rope:
        shape = dataclasses.replace(shape, arch="qwen3vl", rope_sections=MROPE_SECTIONS)
    vocab = tiny_vocabulary(CHAT_TEMPLATE if chat_template is None else chat_template, fim=fim,
                            added_tokens=added_tokens)
    file_type = gguf.LlamaFileType.MOSTLY_Q8_0 if quantize else gguf.LlamaFileType.ALL_F32
    layer_type = GgmlType.Q4_0 if q4_0 else GgmlType.Q8_0

    def stored_as(tensor_name: str, tensor: F32Array) -> Any:
        if f16_output and tensor_name == "output.weight":
            return GgmlType.F16
        if quantize and tensor.ndim == 2:
            return layer_type if tensor_name.startswith("blk.") else GgmlType.Q8_0
        return GgmlType.F32

    tensors = [Tensor(tensor_name, tensor.shape, stored_as(tensor_name, tensor),
                      functools.partial(np.asarray, tensor))
               for tensor_name, tensor in _all_tensors(seed, shape.n_vocab, width).items()]
    return write_gguf(path, shape, vocab, tensors, name=name, file_type=file_type,
                      full_header=False)


# --- a recurrent model -------------------------------------------------------

MAMBA_D_INNER: Final = 2 * N_EMBD
MAMBA_D_STATE: Final = 16
MAMBA_D_CONV: Final = 4
MAMBA_DT_RANK: Final = 8


def _mamba_layer_tensors(rng: np.random.Generator, layer: int) -> dict[str, F32Array]:
    """One Mamba block in llama.cpp's layout; numpy shapes are GGUF ne reversed."""
    d_inner, d_state, dt_rank = MAMBA_D_INNER, MAMBA_D_STATE, MAMBA_DT_RANK
    prefix = f"blk.{layer}."
    a = -np.tile(np.arange(1, d_state + 1, dtype=np.float32), (d_inner, 1))  # S4D-real init
    return {
        prefix + "attn_norm.weight": norm_weight(rng, N_EMBD),
        prefix + "ssm_in.weight": random_normal(rng, (2 * d_inner, N_EMBD), N_EMBD**-0.5),
        prefix + "ssm_conv1d.weight": random_normal(rng, (d_inner, MAMBA_D_CONV),
                                                    MAMBA_D_CONV**-0.5),
        prefix + "ssm_conv1d.bias": random_normal(rng, (d_inner,), 0.1),
        prefix + "ssm_x.weight": random_normal(rng, (dt_rank + 2 * d_state, d_inner),
                                               d_inner**-0.5),
        prefix + "ssm_dt.weight": random_normal(rng, (d_inner, dt_rank), dt_rank**-0.5),
        prefix + "ssm_dt.bias": random_normal(rng, (d_inner,), 0.1) - np.float32(2.0),
        prefix + "ssm_a": a.astype(np.float32),
        prefix + "ssm_d": np.ones(d_inner, dtype=np.float32),
        prefix + "ssm_out.weight": random_normal(rng, (N_EMBD, d_inner), d_inner**-0.5),
    }


def write_tiny_mamba_gguf(path: str | os.PathLike[str], *, seed: int = 0,
                          n_ctx_train: int = 4096) -> pathlib.Path:
    """A random-weight Mamba (a recurrent model: its state cannot be cut back) with the
    tiny tokenizer and chat template; Q8_0 matrices, like write_tiny_qwen3_gguf."""
    target = pathlib.Path(path)
    partial = target.with_name(target.name + ".partial")
    writer = gguf.GGUFWriter(partial, arch="mamba")
    writer.add_name("tiny-mamba")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(0)
    writer.add_head_count(0)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_ssm_conv_kernel(MAMBA_D_CONV)
    writer.add_ssm_inner_size(MAMBA_D_INNER)
    writer.add_ssm_state_size(MAMBA_D_STATE)
    writer.add_ssm_time_step_rank(MAMBA_DT_RANK)
    add_vocabulary(writer, tiny_vocabulary())
    rng = np.random.default_rng(seed)
    n_vocab = len(tiny_vocab())
    tensors = {"token_embd.weight": random_normal(rng, (n_vocab, N_EMBD), 1.0)}
    for layer in range(N_LAYER):
        tensors.update(_mamba_layer_tensors(rng, layer))
    tensors["output_norm.weight"] = norm_weight(rng, N_EMBD)
    tensors["output.weight"] = output_weight(rng, n_vocab, N_EMBD)
    quantized = ("ssm_in.weight", "ssm_out.weight", "token_embd.weight", "output.weight")
    for name, tensor in tensors.items():
        if name.endswith(quantized):
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(tensor, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, tensor)
    return finish_file(writer, partial, target)


