"""butter's benchmarks: long runs and side-by-side comparisons that are not part of the test
suite (benchmarks/RESULTS.md has what they measured).

Run them from the repository root, in the project's virtual environment, as modules or as
files::

    python -m benchmarks.compare --help
    python benchmarks/compare.py --help

What the scripts share (servers started and stopped, ports, readiness, llama-server's
command line, the quiet-machine gate, run facts) is in ``benchmarks.harness``; the
side-by-side throughput comparison in ``benchmarks.compare``; random-weight GGUFs of real
models' shapes in ``benchmarks.model_matrix``.
"""
