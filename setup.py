"""butter's compiled parts: the output-projection kernel (butter/native/lmhead.c), the
layer matmuls and decode attention it plugs into llama.cpp (butter/native/layer_matmul.cpp),
and where a step's threads run (butter/native/team.c).

Everything else is in pyproject.toml. The extensions are optional: where one cannot be
built, butter installs without it and llama.cpp computes that part itself.
"""

import sys

from setuptools import Extension, setup

# Both extensions include these: editing one must rebuild them.
TILE_HEADERS = ["butter/native/q8_0_tiles.h", "butter/native/q6_k_tiles.h",
                "butter/native/q4_k_q5_k_tiles.h", "butter/native/q4_1_q5_0_tiles.h"]

# OpenMP shares llama.cpp's worker threads (the same libgomp) instead of adding more.
openmp = ["-fopenmp"] if sys.platform.startswith("linux") else []

setup(
    ext_modules=[
        Extension(
            "butter.backends._lmhead",
            sources=["butter/native/lmhead.c"],
            depends=TILE_HEADERS,
            extra_compile_args=["-O3", *openmp],
            extra_link_args=openmp,
            optional=True,
        ),
        Extension(
            "butter.backends._layer_matmul",
            sources=["butter/native/layer_matmul.cpp"],
            depends=[*TILE_HEADERS, "butter/native/decode_attention.h",
                     "butter/native/prompt_attention.h"],
            extra_compile_args=["-O3", "-std=c++17"],
            language="c++",
            optional=True,
        ),
        Extension(
            "butter.backends._team",
            sources=["butter/native/team.c"],
            extra_compile_args=["-O2", *openmp],
            extra_link_args=openmp,
            optional=True,
        ),
    ]
)
