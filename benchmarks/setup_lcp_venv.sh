#!/usr/bin/env bash
# Create benchmarks/.build/lcp-venv with llama-cpp-python's own OpenAI server
# (llama-cpp-python[server]), for the side-by-side benchmark. pip's wheel cache
# makes the llama-cpp-python build a cache hit when the same version was already
# built for the main venv. Idempotent.
#
# Env overrides: PYTHON (base interpreter; default: the one /work/venv was made
# from, else python3.11), LCP_VERSION (default 0.3.36).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$HERE/.build/lcp-venv"
LCP_VERSION="${LCP_VERSION:-0.3.36}"
if [[ -z "${PYTHON:-}" ]]; then
    PYTHON="$(/work/venv/bin/python -c 'import sys; print(sys._base_executable)' 2>/dev/null \
        || command -v python3.11)"
fi

if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c \
    "import llama_cpp, llama_cpp.server.app, sys; sys.exit(llama_cpp.__version__ != '$LCP_VERSION')" 2>/dev/null; then
    echo "lcp-venv already set up, skipping" >&2
    echo "$VENV/bin/python"
    exit 0
fi

start=$(date +%s)
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install "llama-cpp-python[server]==$LCP_VERSION" >&2
echo "set up lcp-venv in $(( $(date +%s) - start )) s" >&2
echo "$VENV/bin/python"
