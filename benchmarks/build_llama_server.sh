#!/usr/bin/env bash
# Build llama.cpp's llama-server from the exact llama.cpp tree vendored in the
# llama-cpp-python sdist (so it matches the llama.cpp commit butter links
# against), CPU only, Release, into benchmarks/.build/.
#
# Idempotent: does nothing if the binary already exists (delete
# benchmarks/.build/llama-server to force a rebuild).
#
# Env overrides: PYTHON (interpreter whose pip downloads the sdist; default
# /work/venv/bin/python), LCP_VERSION (default 0.3.36), JOBS (default 2),
# EXTRA_CMAKE_ARGS (appended to the configure step, e.g. an instruction-set choice) and
# SERVER_DIR (the build folder under .build/, default llama-server; name one per choice).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BUILD="$HERE/.build"
LCP_VERSION="${LCP_VERSION:-0.3.36}"
PYTHON="${PYTHON:-/work/venv/bin/python}"
JOBS="${JOBS:-2}"

SDIST_DIR="$BUILD/sdist"
SRC_DIR="$BUILD/src/llama_cpp_python-$LCP_VERSION"
LLAMA_DIR="$SRC_DIR/vendor/llama.cpp"
CMAKE_DIR="$BUILD/${SERVER_DIR:-llama-server}"
BIN="$CMAKE_DIR/bin/llama-server"

if [[ -x "$BIN" ]]; then
    echo "llama-server already built, skipping" >&2
    echo "$BIN"
    exit 0
fi

mkdir -p "$SDIST_DIR" "$BUILD/src"
TARBALL="$SDIST_DIR/llama_cpp_python-$LCP_VERSION.tar.gz"
if [[ ! -f "$TARBALL" ]]; then
    "$PYTHON" -m pip download --no-binary :all: --no-deps \
        "llama-cpp-python==$LCP_VERSION" -d "$SDIST_DIR" >&2
fi
if [[ ! -f "$LLAMA_DIR/CMakeLists.txt" ]]; then
    tar -xzf "$TARBALL" -C "$BUILD/src"
fi

# LLAMA_CURL is deprecated (ignored) at this llama.cpp commit but kept for
# older trees; LLAMA_OPENSSL=OFF and LLAMA_USE_PREBUILT_UI=OFF keep the build
# off the network (the latter would otherwise try to download the web UI from a
# Hugging Face bucket at build time). GGML_NATIVE stays at its default (ON),
# which is what the llama-cpp-python wheel build uses too.
start=$(date +%s)
cmake -S "$LLAMA_DIR" -B "$CMAKE_DIR" \
    -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON \
    -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DGGML_BLAS=OFF \
    -DBUILD_SHARED_LIBS=OFF ${EXTRA_CMAKE_ARGS:-} >&2
cmake --build "$CMAKE_DIR" --config Release --target llama-server -j "$JOBS" >&2
echo "built llama-server in $(( $(date +%s) - start )) s" >&2

"$BIN" --version >&2 || true
echo "$BIN"
