"""butter's compiled parts: the output-projection kernel (butter/native/lmhead.c), the
layer matmuls and attention it plugs into llama.cpp (butter/native/layer_matmul.cpp and the
parts layer_matmul.h lists), and where a step's threads run (butter/native/team.c).

Everything else is in pyproject.toml. The extensions are optional: where one cannot be
built, butter installs without it and llama.cpp computes that part itself.

Build settings, from the environment:
- BUTTER_GGML_SOURCE=<llama.cpp>/ggml (e.g. vendor/llama.cpp/ggml of the pinned
  llama-cpp-python's sdist): compile the layer library against ggml's own headers, so that
  static_asserts check its mirror of ggml's structures (butter/native/ggml_mirror_check.cpp).
- BUTTER_NATIVE_WERROR=1 (CI): -Wall -Wextra -Werror, and an extension that fails to build
  fails the install instead of being left out.
- BUTTER_NATIVE_SANITIZE=1 (.ci/sanitize): AddressSanitizer and UndefinedBehaviorSanitizer,
  every report fatal; the library then needs libasan preloaded.
"""

import os
import sys
from pathlib import Path

from setuptools import Extension, setup

NATIVE = Path("butter/native")
# Both the output projection and the layer library include these: editing one must rebuild
# them.
TILE_HEADERS = [str(NATIVE / name) for name in (
    "q8_0_tiles.h", "q6_k_tiles.h", "q4_k_q5_k_tiles.h", "q4_1_q5_0_tiles.h")]
LAYER_SOURCES = [str(NATIVE / name) for name in (
    "layer_matmul.cpp", "mirror.cpp", "ggml_mirror_check.cpp", "matmul.cpp", "attention.cpp",
    "buffer_type.cpp", "self_check.cpp", "delta_net.cpp")]
LAYER_HEADERS = [str(NATIVE / name) for name in (
    "layer_matmul.h", "ggml_abi.h", "ggml_mirror.h", "decode_attention.h",
    "prompt_attention.h", "prompt_attention_avx512.h", "delta_net_rows.h")]
# The folders of ggml's headers the mirror check includes, under BUTTER_GGML_SOURCE.
GGML_HEADER_FOLDERS = ("include", "src", "src/ggml-cpu")

STRICT = os.environ.get("BUTTER_NATIVE_WERROR") == "1"
SANITIZE = os.environ.get("BUTTER_NATIVE_SANITIZE") == "1"

# OpenMP shares llama.cpp's worker threads (the same libgomp) instead of adding more.
openmp = ["-fopenmp"] if sys.platform.startswith("linux") else []
warnings = ["-Wall", "-Wextra", "-Werror"] if STRICT else []
sanitizers = (["-fsanitize=address,undefined", "-fno-sanitize-recover=all",
               "-fno-omit-frame-pointer", "-g"] if SANITIZE else [])


def optimized(level: str) -> list[str]:
    """The optimization flags: `level`, or what keeps a sanitizer's reports readable."""
    return ["-O1"] if SANITIZE else [level]


def ggml_headers() -> tuple[list[str], list[tuple[str, str | None]]]:
    """Compile flags and macros for ggml's own headers, where BUTTER_GGML_SOURCE names them
    (included as system headers: their own warnings are not butter's to fix)."""
    source = os.environ.get("BUTTER_GGML_SOURCE")
    if not source:
        return [], []
    folders = [Path(source) / folder for folder in GGML_HEADER_FOLDERS]
    if not (folders[0] / "ggml.h").is_file() or not (folders[2] / "traits.h").is_file():
        raise SystemExit(f"BUTTER_GGML_SOURCE={source}: no ggml headers there (expected "
                         "<llama.cpp>/ggml, with include/ggml.h and src/ggml-cpu/traits.h)")
    print(f"butter: checking the ggml mirror against the headers in {source}")
    flags = [flag for folder in folders for flag in ("-isystem", str(folder.resolve()))]
    return flags, [("BUTTER_HAVE_GGML_HEADERS", None)]


ggml_flags, ggml_macros = ggml_headers()

setup(
    ext_modules=[
        Extension(
            "butter.backends._lmhead",
            sources=[str(NATIVE / "lmhead.c")],
            depends=TILE_HEADERS,
            extra_compile_args=[*optimized("-O3"), *openmp, *warnings, *sanitizers],
            extra_link_args=[*openmp, *sanitizers],
            optional=not STRICT,
        ),
        Extension(
            "butter.backends._layer_matmul",
            sources=LAYER_SOURCES,
            depends=[*TILE_HEADERS, *LAYER_HEADERS],
            define_macros=ggml_macros,
            # Only the C API is exported (layer_matmul.h).
            extra_compile_args=[*optimized("-O3"), "-std=c++17", "-fvisibility=hidden",
                                *ggml_flags, *warnings, *sanitizers],
            extra_link_args=sanitizers,
            language="c++",
            optional=not STRICT,
        ),
        Extension(
            "butter.backends._team",
            sources=[str(NATIVE / "team.c")],
            extra_compile_args=[*optimized("-O2"), *openmp, *warnings, *sanitizers],
            extra_link_args=[*openmp, *sanitizers],
            optional=not STRICT,
        ),
    ]
)
