"""The one compiled part of butter: the output-projection kernel (butter/native/lmhead.c).

Everything else is in pyproject.toml. The extension is optional: where it cannot be
built, butter installs without it and llama.cpp computes the logits itself.
"""

import sys

from setuptools import Extension, setup

# OpenMP shares llama.cpp's worker threads (the same libgomp) instead of adding more.
openmp = ["-fopenmp"] if sys.platform.startswith("linux") else []

setup(
    ext_modules=[
        Extension(
            "butter.backends._lmhead",
            sources=["butter/native/lmhead.c"],
            extra_compile_args=["-O3", *openmp],
            extra_link_args=openmp,
            optional=True,
        )
    ]
)
