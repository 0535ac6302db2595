#!/usr/bin/env python3
"""Random-weight GGUFs with the exact shapes of real models, written without a download.

A benchmark of a server's per-token cost needs the real model's shape, not its
knowledge: the layer count, widths, head layout, vocabulary size, tied output matrix
and the quantization types llama.cpp's quantizer picks decide the cost of a step. This
module writes such files from nothing but the local disk:

* ``qwen3-0.6b-shape``: arch ``qwen3``, 28 layers, n_embd 1024, 16 heads / 8 KV heads of
  128, FFN 3072, 151,936 vocab (tied), per-head q/k norms, rope theta 1e6, rms eps 1e-6,
  trained context 40960. Tokenizer ``gpt2`` / pre-tokenizer ``qwen2``: 151,643 BPE tokens,
  Qwen3's 26 added tokens (ChatML control tokens, ``<tool_call>``/``<think>`` and friends
  as user-defined tokens, FIM tokens) and ``[PAD…]`` up to 151,936; eos ``<|im_end|>``,
  no BOS added; ChatML chat template with tools (the tiny test model's, Qwen style).
* ``llama3.2-1b-shape``: arch ``llama``, 16 layers, n_embd 2048, 32 heads / 8 KV heads of
  64, FFN 8192, 128,256 vocab (tied), rope theta 500000 with llama3 rope scaling (factor
  32 over 8192, stored as ``rope_freqs.weight`` like llama.cpp's converter does), rms eps
  1e-5, trained context 131072. Tokenizer ``gpt2`` / pre-tokenizer ``llama-bpe``: 128,000
  BPE tokens and Llama 3.1's 256 special tokens at 128000..128255; BOS added, eos/eot
  ``<|eot_id|>``, eom ``<|eom_id|>``; a Llama-3-style chat template with tools.

The vocabularies are byte-level BPEs of the real size, trained with ``tokenizers`` on
local English and code text (documentation under /usr/share/doc and /usr/share/vim, the
Python sources and docs of the venv's site-packages and the standard library: 20 MB of
each, deduplicated), split by the same regex llama.cpp uses for that pre-tokenizer name.
If training runs out of pairs before the real size, the rest is filled with merges of
existing tokens. English tokenizes at ~1.3 tokens per word, like the real tokenizers.

Weights are random normal (std 0.02 for matrices, 1 + N(0, 0.02) for norms, seeded per
tensor name: same seed, same bytes), written as F16 (norms F32) one tensor at a time by
the test suite's GGUF writer (``butter.testing.real_shapes``: ``real_vocabulary``,
``write_real_shape_gguf``), then quantized by llama.cpp's own quantizer through
llama-cpp-python (``real_shapes.quantize_gguf``, 2 threads). The matrix: Qwen3 shape in
Q4_K_M, Q8_0 and Q6_K; Llama shape in Q4_K_M, Q8_0 and Q5_K_M. In Q4_K_M, Q5_K_M and
Q6_K files the tied token embedding (the output matrix) is Q6_K, in Q8_0 files Q8_0.

Everything is cached under ``~/.cache/butter-bench/models/`` (vocabularies in
``vocab/``, the F16 files kept for requantizing); a file that exists is not written
again, and every file is written under a ``.partial`` name and renamed into place.

Measured on the 2-core development machine while a llama.cpp build used both cores
(so these are upper bounds); the vocabulary times include reading the 40 MB corpus
(3,061 files, ~2 s):

========================  =======  ==========  ============================
step                      time     file size   token_embd (= output) type
========================  =======  ==========  ============================
vocab qwen2, 151,643      22.8 s
vocab llama-bpe, 128,000  11.5 s
qwen3-0.6b-shape F16      11.2 s   1,198 MB    F16
  → Q4_K_M                50.8 s     396 MB    Q6_K
  → Q8_0                   7.8 s     639 MB    Q8_0
  → Q6_K                  23.2 s     495 MB    Q6_K
llama3.2-1b-shape F16     21.3 s   2,476 MB    F16
  → Q4_K_M                67.2 s     805 MB    Q6_K
  → Q8_0                  12.9 s   1,318 MB    Q8_0
  → Q5_K_M                54.8 s     908 MB    Q6_K
========================  =======  ==========  ============================

Peak RSS 2.2 GB (the Llama shape, checks included). Training reached the real sizes (no filled
merges); the Qwen vocabulary has 151,387 merges, as many as Qwen2's. English prompts
(serve-bench's and a few paragraphs, ENGLISH below) take 1.27 tokens per word with the
Qwen vocabulary and 1.29 with the Llama one, through llama.cpp's tokenizer on the
written files, and detokenize(tokenize(text)) == text for English, code and
multilingual text (ROUND_TRIP). Every file loads in llama.cpp, generates, and
``butter serve --model FILE`` answers a chat completion with it (``--check``).

Usage (from the repository root, in the project's venv)::

    python benchmarks/model_matrix.py                 # write what is missing, print name<TAB>path
    python benchmarks/model_matrix.py --list          # names and paths, write nothing
    python benchmarks/model_matrix.py --only qwen3-0.6b-shape-Q8_0 --check
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import json
import os
import random
import sys
import time
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TextIO

if not __package__:  # run as a file: the repository root, not benchmarks/, on sys.path
    import _repo_root  # noqa: F401

import gguf

from benchmarks.harness import ServerSpec, free_port, running_server, wait_ready
from butter.backends.gguf_tensors import read_header
from butter.testing import gguf_writer, real_shapes

DEFAULT_DIR: Final = Path.home() / ".cache" / "butter-bench" / "models"
SEED: Final = 0
QUANT_THREADS: Final = 2

# --------------------------------------------------------------- tokenizers

# llama.cpp's regexes for these pre-tokenizer names (src/llama-vocab.cpp), which are
# the models' tokenizer.json regexes up to case-insensitive contractions. The only
# difference: llama3 keeps runs of up to three digits together, qwen2 splits digits.
PRE_TOKENIZER_REGEX: Final = {
    "qwen2": (
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
    "llama-bpe": (
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
        r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}

CORPUS_MB_PER_GROUP: Final = 20.0  # prose and code each; ~30 s of training on 2 cores
CORPUS_FILE_CAP: Final = 256 * 1024  # characters taken from one file at most
PROSE_ROOTS: Final = ("/usr/share/doc", "/usr/share/vim")
PROSE_SUFFIXES: Final = (".txt", ".md", ".rst")
CODE_SUFFIXES: Final = (".py", ".md", ".rst", ".txt")

# -------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class Shape:
    """One real model of the matrix: its shape (gguf_writer's), the size of its BPE vocabulary
    before the added tokens, llama.cpp's pre-tokenizer name, and the quantizations to write."""

    name: str
    model: gguf_writer.Shape
    n_bpe: int
    pre: str
    quants: tuple[str, ...]


QWEN3_0_6B: Final = Shape(
    name="qwen3-0.6b-shape",
    model=gguf_writer.Shape(
        arch="qwen3", n_layer=28, n_embd=1024, n_head=16, n_head_kv=8, head_dim=128,
        n_ff=3072, n_vocab=151_936, n_ctx_train=40_960, rope_theta=1_000_000.0,
        rms_eps=1e-6, qk_norm=True,
    ),
    n_bpe=151_643, pre="qwen2", quants=("Q4_K_M", "Q8_0", "Q6_K"),
)  # fmt: skip
LLAMA32_1B: Final = Shape(
    name="llama3.2-1b-shape",
    model=gguf_writer.Shape(
        arch="llama", n_layer=16, n_embd=2048, n_head=32, n_head_kv=8, head_dim=64,
        n_ff=8192, n_vocab=128_256, n_ctx_train=131_072, rope_theta=500_000.0,
        rms_eps=1e-5, llama3_rope=True,
    ),
    n_bpe=128_000, pre="llama-bpe", quants=("Q4_K_M", "Q8_0", "Q5_K_M"),
)  # fmt: skip
SHAPES: Final = (QWEN3_0_6B, LLAMA32_1B)


@dataclass(frozen=True)
class MatrixModel:
    """One file of the matrix; ``chat_template``: it carries tokenizer.chat_template."""

    name: str
    path: Path
    chat_template: bool
    shape: str
    quant: str


def model_name(shape: Shape, quant: str) -> str:
    return f"{shape.name}-{quant}"


def all_names() -> list[str]:
    return [model_name(s, q) for s in SHAPES for q in s.quants]


def f16_path(out_dir: Path, shape: Shape) -> Path:
    return out_dir / f"{shape.name}-F16.gguf"


def quant_path(out_dir: Path, shape: Shape, quant: str) -> Path:
    return out_dir / f"{model_name(shape, quant)}.gguf"


def selected(only: Iterable[str] | None) -> list[tuple[Shape, str]]:
    """(shape, quant) pairs named by ``only`` (a shape name selects all its quants)."""
    pairs = [(s, q) for s in SHAPES for q in s.quants]
    if not only:
        return pairs
    wanted = set(only)
    unknown = wanted - set(all_names()) - {s.name for s in SHAPES}
    if unknown:
        raise ValueError(
            f"unknown model(s) {sorted(unknown)}; choose from {', '.join(all_names())} "
            f"or a shape ({', '.join(s.name for s in SHAPES)})"
        )
    return [(s, q) for s, q in pairs if s.name in wanted or model_name(s, q) in wanted]


def log(message: str, stream: TextIO | None = None) -> None:
    print(message, file=stream or sys.stderr, flush=True)


@contextlib.contextmanager
def timed(what: str, timings: dict[str, float] | None = None) -> Iterator[None]:
    start = time.monotonic()
    yield
    elapsed = time.monotonic() - start
    if timings is not None:
        timings[what] = elapsed
    log(f"{what}: {elapsed:.1f} s")


# -------------------------------------------------------------------- corpus


def _walk(roots: Sequence[str], suffixes: tuple[str, ...]) -> list[Path]:
    """Text files under ``roots`` (gzipped ones too), in a fixed pseudo-random order
    so that a byte budget samples across packages rather than the first ones."""
    found: list[Path] = []
    for root in roots:
        for dirpath, _dirs, files in os.walk(root):
            for name in files:
                lower = name.lower()
                stem = lower.removesuffix(".gz")
                if stem.endswith(suffixes) or stem in ("copyright", "readme", "news"):
                    found.append(Path(dirpath) / name)
    found.sort()
    random.Random(SEED).shuffle(found)
    return found


def _read_text(path: Path) -> str | None:
    """The file's text (at most CORPUS_FILE_CAP characters), or None for binary,
    non-UTF-8 or data-like files (many very long lines)."""
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as fh:
            data = fh.read(CORPUS_FILE_CAP * 2)
        text = data.decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError, zlib.error):
        return None
    lines = text.splitlines()
    if b"\0" in data or not lines or sum(len(ln) > 400 for ln in lines) > len(lines) / 20:
        return None
    return text[:CORPUS_FILE_CAP]


def site_packages() -> list[str]:
    import sysconfig

    return sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})


def corpus(mb_per_group: float = CORPUS_MB_PER_GROUP) -> list[str]:
    """Local English and code text: ``mb_per_group`` MB of documentation, the same of
    Python sources and docs (site-packages, standard library), deduplicated."""
    stdlib = str(Path(os.__file__).parent)
    groups = (
        _walk(PROSE_ROOTS, PROSE_SUFFIXES),
        _walk([*site_packages(), stdlib], CODE_SUFFIXES),
    )
    seen: set[bytes] = set()
    texts: list[str] = []
    for paths in groups:
        used = 0
        for path in paths:
            if used >= mb_per_group * 1e6:
                break
            text = _read_text(path)
            if text is None:
                continue
            digest = hashlib.blake2b(text.encode(), digest_size=16).digest()
            if digest in seen:
                continue
            seen.add(digest)
            texts.append(text)
            used += len(text)
    return texts


# ---------------------------------------------------------------- BPE vocab


def byte_symbols() -> list[str]:
    """GPT-2's byte-to-unicode symbol of each byte 0..255 (" " -> "Ġ")."""
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


@dataclass(frozen=True)
class Vocab:
    """A byte-level BPE: tokens by id (bytes first, then one per merge) and merges
    in rank order."""

    tokens: list[str]
    merges: list[tuple[str, str]]
    info: dict[str, Any]


def _train(pre: str, n_tokens: int, texts: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    trainee = Tokenizer(models.BPE())
    trainee.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_REGEX[pre]), behavior="isolated"),
            # use_regex=False: the split above is the whole pre-tokenization.
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=n_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    trainee.train_from_iterator(texts, trainer=trainer)
    raw = json.loads(trainee.to_str())["model"]["merges"]
    merges = [(m.split(" ", 1)[0], m.split(" ", 1)[1]) if isinstance(m, str) else (m[0], m[1])
              for m in raw]  # fmt: skip
    tokens = byte_symbols()
    known = set(tokens)
    for a, b in merges:
        if a + b not in known:  # two merges can spell the same token
            known.add(a + b)
            tokens.append(a + b)
    return tokens, merges


def _fill(tokens: list[str], merges: list[tuple[str, str]], n_tokens: int) -> int:
    """Add merges of existing tokens until there are ``n_tokens``: the earliest (most
    frequent) merged tokens joined with the earliest space-led word tokens, in order
    of rank sum. Returns how many were added."""
    known = set(tokens)
    heads = tokens[256:] or list(tokens)
    words = [t for t in heads if t.startswith("Ġ") and t[1:].isalpha()] or heads
    added = 0
    for rank_sum in range(len(heads) + len(words) - 1):
        for i in range(max(0, rank_sum - len(words) + 1), min(rank_sum + 1, len(heads))):
            if len(tokens) >= n_tokens:
                return added
            a, b = heads[i], words[rank_sum - i]
            if a + b in known:
                continue
            known.add(a + b)
            tokens.append(a + b)
            merges.append((a, b))
            added += 1
    if len(tokens) < n_tokens:
        raise RuntimeError(f"cannot fill the vocabulary to {n_tokens} tokens")
    return added


def trained_vocab(out_dir: Path, pre: str, n_tokens: int) -> Vocab:
    """The BPE vocabulary of ``n_tokens`` for pre-tokenizer ``pre``, from the cache
    or trained now (and cached)."""
    path = out_dir / "vocab" / f"{pre}-{n_tokens}.json"
    if path.exists():
        doc = json.loads(path.read_text())
        return Vocab(doc["tokens"], [(a, b) for a, b in doc["merges"]], doc["info"])
    start = time.monotonic()
    texts = corpus()
    corpus_s = time.monotonic() - start
    tokens, merges = _train(pre, n_tokens, texts)
    trained = len(tokens)
    filled = _fill(tokens, merges, n_tokens)
    info = {
        "corpus_files": len(texts),
        "corpus_chars": sum(map(len, texts)),
        "corpus_s": round(corpus_s, 1),
        "train_s": round(time.monotonic() - start - corpus_s, 1),
        "trained_tokens": trained,
        "filled_tokens": filled,
    }
    log(f"vocab {pre}: {info}")
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({"info": info, "tokens": tokens, "merges": merges}))
    os.replace(partial, path)
    return Vocab(tokens, merges, info)


# ------------------------------------------------------------------- GGUF F16


def write_f16(out_dir: Path, shape: Shape, vocab: Vocab) -> Path:
    """The F16 GGUF of ``shape``, by butter.testing's GGUF writer: the real model's
    tokenizer layout around ``vocab``, random weights seeded per tensor name, one tensor at
    a time (the largest tensor is the peak memory: 0.5 GB for the Llama shape's
    embedding)."""
    target = f16_path(out_dir, shape)
    if target.exists():
        return target
    layout = real_shapes.real_vocabulary(shape.model, vocab.tokens, vocab.merges, shape.pre)
    return real_shapes.write_real_shape_gguf(target, shape.model, layout, name=shape.name,
                                           seed=SEED)


# ------------------------------------------------------------------ quantize


@contextlib.contextmanager
def native_output_to(path: Path) -> Iterator[None]:
    """llama.cpp's log lines (through llama-cpp-python's Python logger and fd 2)
    go to ``path`` instead of the terminal."""
    sys.stderr.flush()
    saved = os.dup(2)
    with path.open("ab") as fh:
        os.dup2(fh.fileno(), 2)
        try:
            with open(path, "a") as text, contextlib.redirect_stderr(text):
                yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def quantize(source: Path, target: Path, quant: str, threads: int = QUANT_THREADS) -> None:
    """llama.cpp's quantizer (real_shapes.quantize_gguf), its log in TARGET.quantize.log."""
    with native_output_to(target.with_name(target.name + ".quantize.log")):
        real_shapes.quantize_gguf(source, target, quant, threads=threads)


# --------------------------------------------------------------------- build


def tensor_types(path: Path) -> dict[str, str]:
    """Type names of the output projection (output.weight, or the tied token
    embedding) and of the token embedding."""
    tensors = read_header(path).tensors
    output = tensors.get("output.weight", tensors["token_embd.weight"])
    return {
        "output": gguf.GGMLQuantizationType(output.ggml_type).name,
        "token_embd": gguf.GGMLQuantizationType(tensors["token_embd.weight"].ggml_type).name,
    }


def has_chat_template(path: Path) -> bool:
    """Whether the GGUF carries ``tokenizer.chat_template``."""
    return gguf.Keys.Tokenizer.CHAT_TEMPLATE in read_header(path).keys


def build(
    out_dir: Path = DEFAULT_DIR,
    only: Iterable[str] | None = None,
    timings: dict[str, float] | None = None,
) -> list[MatrixModel]:
    """Write whatever of the (selected) matrix is missing; return its models."""
    out_dir.mkdir(parents=True, exist_ok=True)
    models: list[MatrixModel] = []
    for shape in SHAPES:
        quants = [q for s, q in selected(only) if s is shape]
        if not quants:
            continue
        missing = [q for q in quants if not quant_path(out_dir, shape, q).exists()]
        if missing:
            source = f16_path(out_dir, shape)
            if not source.exists():
                with timed(f"vocab {shape.pre} ({shape.n_bpe} BPE tokens)", timings):
                    vocab = trained_vocab(out_dir, shape.pre, shape.n_bpe)
                with timed(f"{shape.name} F16 write", timings):
                    write_f16(out_dir, shape, vocab)
            for quant in missing:
                with timed(f"{model_name(shape, quant)} quantize", timings):
                    quantize(source, quant_path(out_dir, shape, quant), quant)
        for quant in quants:
            path = quant_path(out_dir, shape, quant)
            models.append(MatrixModel(model_name(shape, quant), path, True, shape.name, quant))
    return models


def matrix_models(
    out_dir: Path = DEFAULT_DIR, only: Iterable[str] | None = None, *, write: bool = True
) -> list[MatrixModel]:
    """The matrix's models (for benchmarks/compare.py), written first when missing
    unless ``write`` is False (then the paths may not exist yet)."""
    if write:
        return build(out_dir, only)
    return [
        MatrixModel(model_name(s, q), quant_path(out_dir, s, q), True, s.name, q)
        for s, q in selected(only)
    ]


# --------------------------------------------------------------------- checks

# English prompts for the tokens-per-word check: serve-bench's own and some prose.
ENGLISH: Final = (
    "Write a short story about a lighthouse, starting with that tag.",
    "You are a careful assistant for a shipping company. Answer in plain English, be "
    "concise, and never invent facts. The fleet has twelve ships, four ports and one "
    "dispatcher. Routes change weekly; safety rules never change.",
    "The quick brown fox jumps over the lazy dog. The dog did not mind; it was asleep in "
    'the sun, dreaming of the bones it had buried last summer. "Why is the sky blue?" '
    'asked the child. "Because light is scattered by the air," said her mother, "and '
    "blue light is scattered the most.\" It's a simple answer, but it's not the whole story.",
    "Please summarize the following meeting notes in three bullet points. The team agreed "
    "to move the release to next Thursday, because the migration scripts still fail on "
    "large databases. Maria will investigate the failures, and Tom will update the "
    "documentation before Monday.",
)
ROUND_TRIP: Final = (
    *ENGLISH,
    "def add(a, b):\n    return a + b  # 2 numbers, 3.14159, 1,000,000\n\n\tindented\r\n",
    "日本語のテキスト, 中文字符, Ελληνικά, Русский язык, español ñ, Übergröße 🙂 🎉 🚀 ❤️",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}  trailing   spaces   ',
)


def check_tokenizer(path: Path) -> dict[str, Any]:
    """Tokens per word of ENGLISH and round trips, through llama.cpp's tokenizer."""
    import llama_cpp

    # A vocab-only load still makes a context, which warns that n_ctx_train is 0.
    with native_output_to(Path(os.devnull)):
        llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    try:
        n_tokens = sum(len(llm.tokenize(t.encode(), add_bos=False)) for t in ENGLISH)
        n_words = sum(len(t.split()) for t in ENGLISH)
        bad = [
            t for t in ROUND_TRIP
            if llm.detokenize(llm.tokenize(t.encode(), add_bos=False)).decode() != t
        ]  # fmt: skip
        return {"tokens_per_word": round(n_tokens / n_words, 3), "round_trip_failures": bad}
    finally:
        llm.close()


def check_generate(path: Path) -> dict[str, Any]:
    """Load with llama.cpp and generate a few tokens."""
    import llama_cpp

    start = time.monotonic()
    llm = llama_cpp.Llama(str(path), n_ctx=512, n_threads=2, verbose=False, seed=SEED)
    load_s = time.monotonic() - start
    try:
        start = time.monotonic()
        out: Any = llm.create_completion("The lighthouse keeper", max_tokens=8, temperature=0.7)
        gen_s = time.monotonic() - start
        return {
            "load_s": round(load_s, 2),
            "generate_s": round(gen_s, 2),
            "completion_tokens": out["usage"]["completion_tokens"],
            "text": out["choices"][0]["text"],
        }
    finally:
        llm.close()


def check_serve(path: Path, timeout: float = 300.0) -> dict[str, Any]:
    """``butter serve --model PATH`` on a free 127.0.0.1 port answers a chat
    completion; the server is stopped afterwards."""
    import httpx

    port = free_port("127.0.0.1")
    argv = [sys.executable, "-m", "butter.cli", "serve", "--model", str(path),
            "--host", "127.0.0.1", "--port", str(port), "--threads", "2"]  # fmt: skip
    log_path = path.with_name(path.name + ".serve.log")
    base = f"http://127.0.0.1:{port}"
    with running_server(ServerSpec("butter", argv, "/health"), log_path) as proc:
        try:
            ready_s = wait_ready(proc, base, "/health", timeout)
        except RuntimeError as exc:
            raise RuntimeError(f"butter serve: {exc}, see {log_path}") from None
        model_id = httpx.get(base + "/v1/models", timeout=10.0).json()["data"][0]["id"]
        body = {
            "model": model_id,
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "Say hello to the lighthouse."}],
        }
        response = httpx.post(base + "/v1/chat/completions", json=body, timeout=120.0)
        response.raise_for_status()
        answer = response.json()
        return {
            "ready_s": round(ready_s, 1),
            "status": response.status_code,
            "usage": answer["usage"],
            "finish_reason": answer["choices"][0]["finish_reason"],
            "content": answer["choices"][0]["message"].get("content"),
        }


def describe(model: MatrixModel) -> dict[str, Any]:
    return {
        "size_mb": round(model.path.stat().st_size / 1e6, 1),
        **tensor_types(model.path),
        "chat_template": has_chat_template(model.path),
    }


# ----------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_DIR, help=f"cache dir ({DEFAULT_DIR})")
    p.add_argument("--only", nargs="+", metavar="NAME",
                   help=f"models or shapes: {', '.join(all_names())}")  # fmt: skip
    p.add_argument("--list", action="store_true", help="print names and paths, write nothing")
    p.add_argument(
        "--check",
        action="store_true",
        help="also check each file: tokenizer, llama.cpp generation, butter serve",
    )
    p.add_argument("--no-serve-check", action="store_true", help="skip the butter serve check")
    return p.parse_args(argv)  # fmt: skip


def main(argv: Sequence[str] | None = None, stdout: TextIO = sys.stdout) -> int:
    args = parse_args(argv)
    try:
        selected(args.only)
    except ValueError as exc:
        log(str(exc))
        return 2
    if args.list:
        for model in matrix_models(args.out, args.only, write=False):
            print(f"{model.name}\t{model.path}", file=stdout)
        return 0
    timings: dict[str, float] = {}
    models = build(args.out, args.only, timings)
    failed = False
    for model in models:
        info = describe(model)
        log(f"{model.name}: {json.dumps(info)}")
        if args.check:
            checks: dict[str, Any] = {}
            try:
                checks["tokenizer"] = check_tokenizer(model.path)
                checks["generate"] = check_generate(model.path)
                if not args.no_serve_check:
                    checks["serve"] = check_serve(model.path)
            except Exception as exc:  # report and go on with the next model
                checks["error"] = f"{type(exc).__name__}: {exc}"
                failed = True
            failed = failed or bool(checks.get("tokenizer", {}).get("round_trip_failures"))
            log(f"{model.name} checks: {json.dumps(checks, ensure_ascii=False)}")
        print(f"{model.name}\t{model.path}", file=stdout, flush=True)
    if timings:
        log("timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
