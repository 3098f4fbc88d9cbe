#!/usr/bin/env bash
# Build llama-server from the llama.cpp vendored in the pinned llama-cpp-python sdist, so the
# benchmark compares against the same llama.cpp build our worker uses. Cached; prints the path.
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
CACHE=${SUPERFLUID_BENCH_CACHE:-$HOME/.cache/superfluid/llama-server-$VERSION}
BIN="$CACHE/build/bin/llama-server"
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
mkdir -p "$CACHE"
cd "$CACHE"
if [ ! -d src ]; then
  python3 -m pip download --quiet --no-deps --no-binary :all: -d dl "llama-cpp-python==$VERSION" >&2
  mkdir -p src && tar -xzf dl/llama_cpp_python-"$VERSION".tar.gz -C src --strip-components=1
fi
cmake -S src/vendor/llama.cpp -B build -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
  -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
cmake --build build --target llama-server -j"$(nproc)" >&2
echo "$BIN"
