"""The tiny Qwen3 GGUF used by engine tests must look like a real Qwen model to llama.cpp."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import gguf
import jinja2.sandbox
import llama_cpp
import pytest

from butter.testing import gguf_writer, real_shapes, tiny_gguf

# ASCII, whitespace runs, contractions, digits, multi-byte UTF-8 (2, 3 and
# 4 bytes, plus a variation selector) and ChatML/tool/think markup.
SAMPLES = [
    "Hello world!",
    "It's 3.14159, don't we'll; they've 1,000,000 apples.",
    "  leading spaces\n\n\ttabs  and trailing   ",
    "a\r\nb",
    "The café is naïve. Übergröße, español ñ",
    "日本語のテキスト 中文 Ελληνικά Русский",
    "emoji 🙂🎉 🚀 ❤️",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    '<think>\nhmm\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
    "x<|endoftext|>y",
]


@pytest.fixture
def model_path(tmp_path: pathlib.Path) -> pathlib.Path:
    return tiny_gguf.write_tiny_qwen3_gguf(tmp_path / "tiny.gguf")


@pytest.fixture
def llm(model_path: pathlib.Path) -> Iterator[llama_cpp.Llama]:
    model = llama_cpp.Llama(model_path=str(model_path), n_ctx=256, verbose=False)
    yield model
    model.close()


def test_write_returns_path_and_is_deterministic(tmp_path: pathlib.Path) -> None:
    first = tiny_gguf.write_tiny_qwen3_gguf(str(tmp_path / "a.gguf"), seed=7)
    again = tiny_gguf.write_tiny_qwen3_gguf(tmp_path / "b.gguf", seed=7)
    other = tiny_gguf.write_tiny_qwen3_gguf(tmp_path / "c.gguf", seed=8)
    assert first == tmp_path / "a.gguf"
    assert first.read_bytes() == again.read_bytes()
    assert first.read_bytes() != other.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf", "b.gguf", "c.gguf"]


def test_metadata(llm: llama_cpp.Llama) -> None:
    meta = llm.metadata
    assert meta["general.architecture"] == "qwen3"
    assert meta["general.name"] == "tiny-qwen3"
    assert meta["qwen3.context_length"] == "4096"
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.pre"] == "qwen2"
    assert meta["tokenizer.chat_template"] == tiny_gguf.CHAT_TEMPLATE
    assert llm.n_vocab() == len(tiny_gguf.tiny_vocab())


def test_overrides(tmp_path: pathlib.Path) -> None:
    path = tiny_gguf.write_tiny_qwen3_gguf(
        tmp_path / "o.gguf", n_ctx_train=512, name="other", chat_template="{{ 'x' }}"
    )
    model = llama_cpp.Llama(model_path=str(path), n_ctx=128, verbose=False)
    try:
        assert model.metadata["qwen3.context_length"] == "512"
        assert model.metadata["general.name"] == "other"
        assert model.metadata["tokenizer.chat_template"] == "{{ 'x' }}"
    finally:
        model.close()


def test_special_tokens(llm: llama_cpp.Llama) -> None:
    ids = tiny_gguf.special_token_ids()
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    assert llm.token_eos() == ids["<|im_end|>"]
    for text in ("<|im_end|>", "<|endoftext|>"):
        assert llama_cpp.llama_vocab_is_eog(vocab, ids[text])
    assert not llama_cpp.llama_vocab_is_eog(vocab, ids["<|im_start|>"])
    for text in tiny_gguf.CONTROL_TOKENS:
        assert llama_cpp.llama_vocab_is_control(vocab, ids[text])
    for text in tiny_gguf.USER_DEFINED_TOKENS:
        attr = llama_cpp.llama_vocab_get_attr(vocab, ids[text])
        assert attr & llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
    # Like Qwen, no BOS is prepended even when special tokens are requested.
    assert llm.tokenize(b"hi", add_bos=True, special=True) == llm.tokenize(b"hi", add_bos=False)


@pytest.mark.parametrize("parse_special", [True, False])
@pytest.mark.parametrize("text", SAMPLES)
def test_tokenization_matches_hf(llm: llama_cpp.Llama, text: str, parse_special: bool) -> None:
    hf = tiny_gguf.build_tiny_tokenizer()
    # HF matches special tokens in text unless told not to; llama.cpp only
    # when asked (parse_special).  User-defined tokens always match on both.
    hf.encode_special_tokens = not parse_special
    expected = hf.encode(text).ids
    assert llm.tokenize(text.encode(), add_bos=False, special=parse_special) == expected


@pytest.mark.parametrize("text", SAMPLES)
def test_detokenize_round_trips(llm: llama_cpp.Llama, text: str) -> None:
    tokens = llm.tokenize(text.encode(), add_bos=False, special=True)
    assert llm.detokenize(tokens, special=True).decode() == text
    assert tiny_gguf.build_tiny_tokenizer().decode(tokens, skip_special_tokens=False) == text


@pytest.mark.parametrize(
    "prompt", ["Hello", "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n"]
)
def test_greedy_generation_is_varied(llm: llama_cpp.Llama, prompt: str) -> None:
    tokens = llm.tokenize(prompt.encode(), add_bos=False, special=True)
    generated: list[int] = []
    for token in llm.generate(tokens, temp=0.0, top_k=1):
        generated.append(token)
        if len(generated) == 24:
            break
    assert len(set(generated)) >= 8
    # Control tokens have zero LM-head rows, so greedy decoding never stops early.
    assert set(generated).isdisjoint(
        tiny_gguf.special_token_ids()[t] for t in tiny_gguf.CONTROL_TOKENS
    )


def test_chat_template_renders_tools() -> None:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(tiny_gguf.CHAT_TEMPLATE)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
        },
        {"role": "tool", "content": "21C"},
    ]
    text = template.render(messages=messages, tools=[tool], add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert '"name": "get_weather"' in text.split("\n</tools>")[0]
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
    ) in text
    assert "<|im_start|>user\n<tool_response>\n21C\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")


# --- real shapes: the writer benchmarks/model_matrix.py uses ------------------------

# The layouts of Qwen3-0.6B and Llama-3.2-1B at a few hundredths of their size: hidden size
# 256 so that llama.cpp's quantizer can use K-quants, the tiny BPE inside each real
# tokenizer layout (Qwen3's added tokens and [PAD] up to the size, Llama 3's 256 specials).
N_BPE = len(tiny_gguf.tiny_bpe()[0])
SMALL_SHAPES = {
    "qwen3": gguf_writer.Shape(
        arch="qwen3", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=512,
        n_vocab=N_BPE + len(real_shapes.QWEN3_ADDED) + 10, n_ctx_train=40_960,
        rope_theta=1_000_000.0, rms_eps=1e-6, qk_norm=True),
    "llama": gguf_writer.Shape(
        arch="llama", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=512,
        n_vocab=N_BPE + 256, n_ctx_train=131_072, rope_theta=500_000.0, rms_eps=1e-5,
        llama3_rope=True),
}


@pytest.mark.parametrize("arch", sorted(SMALL_SHAPES))
def test_a_real_shape_written_f16_and_quantized_by_llama_cpp_loads(
    tmp_path: pathlib.Path, arch: str
) -> None:
    """write_real_shape_gguf's F16 file, turned into Q4_K_M by llama.cpp's quantizer, loads in
    llama.cpp with the shape, tokenizer layout and K-quant mix of the real model's file."""
    from butter.backends.gguf_tensors import read_header

    shape = SMALL_SHAPES[arch]
    bpe, merges = tiny_gguf.tiny_bpe()
    vocab = real_shapes.real_vocabulary(shape, bpe, merges, "qwen2" if arch == "qwen3" else
                                      "llama-bpe")
    f16 = real_shapes.write_real_shape_gguf(tmp_path / "f16.gguf", shape, vocab, name=arch)
    q4 = real_shapes.quantize_gguf(f16, tmp_path / "q4_k_m.gguf", "Q4_K_M", threads=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f16.gguf", "q4_k_m.gguf"]

    keys = ["general.architecture", "general.file_type", f"{arch}.block_count",
            f"{arch}.embedding_length", f"{arch}.vocab_size", f"{arch}.rope.dimension_count",
            "tokenizer.ggml.pre", "tokenizer.ggml.add_bos_token"]
    header = read_header(q4, keys=keys)
    assert header.metadata == {
        "general.architecture": arch, "general.file_type": 15, f"{arch}.block_count": 2,
        f"{arch}.embedding_length": 256, f"{arch}.vocab_size": shape.n_vocab,
        f"{arch}.rope.dimension_count": 64, "tokenizer.ggml.pre": vocab.pre,
        "tokenizer.ggml.add_bos_token": arch == "llama",
    }
    types = {name: gguf.GGMLQuantizationType(t.ggml_type).name
             for name, t in header.tensors.items()}
    assert "output.weight" not in types  # tied, as in both real models
    assert types["token_embd.weight"] == "Q6_K"  # llama.cpp's Q4_K_M mix for the output
    assert types["blk.0.attn_q.weight"] == "Q4_K"
    assert types["blk.0.attn_norm.weight"] == "F32"
    assert ("blk.1.attn_k_norm.weight" in types) == (arch == "qwen3")
    assert ("rope_freqs.weight" in types) == (arch == "llama")

    llm = llama_cpp.Llama(model_path=str(q4), n_ctx=128, n_threads=1, verbose=False)
    try:
        assert llm.n_vocab() == shape.n_vocab
        assert llm.n_embd() == 256
        assert llm.token_eos() == vocab.eos
        assert llm.metadata["tokenizer.chat_template"] == vocab.chat_template
        tokens = llm.tokenize(b"Hello world", add_bos=True)
        assert (tokens[0] == vocab.bos) == (arch == "llama")
        generated = []
        for token in llm.generate(tokens, temp=0.0, top_k=1):
            generated.append(token)
            if len(generated) == 4:
                break
        assert len(generated) == 4
    finally:
        llm.close()
