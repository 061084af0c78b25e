#!/usr/bin/env bash
# Build the llama.cpp reference tools (llama-quantize, llama-perplexity, llama-imatrix,
# llama-mtmd-cli: the multimodal CLI that runs a VLM .gguf with its mmproj; llama-server: the
# OpenAI-compatible server `quantkit serve-check` runs; llama-tokenize: a GGUF's tokenizer, for
# tests/gguf/test_vocab_llamacpp.py) from the llama.cpp that the llama-cpp-python source
# distribution vendors.
#
# Output (all under $LLAMACPP_DIR, default third_party/llama.cpp/, which is gitignored):
#   src/      the vendored llama.cpp source tree (vendor/llama.cpp of the sdist)
#   build/    the cmake build tree
#   bin/      -> build/bin: llama-quantize, llama-perplexity, llama-imatrix, llama-mtmd-cli, llama-server,
#             llama-tokenize and the shared libraries (libggml-base.so holds ggml_quantize_chunk, used by
#             scripts/make_gguf_golden.py and tests/gguf/test_quants.py via ctypes)
#   VERSION   llama-cpp-python version, vendored llama.cpp commit, build flags
#
# Build flags and why:
#   -DCMAKE_BUILD_TYPE=Release
#   -DGGML_NATIVE=OFF        no -march=native: the binaries do not depend on the build
#                            host's CPU. (With GGML_NATIVE=OFF ggml enables the fixed
#                            x86-64 set AVX/AVX2/FMA/F16C for the CPU backend only.)
#   -DCMAKE_C_FLAGS/CXX_FLAGS=-ffp-contract=off
#                            no fused multiply-add contraction of a*b+c in scalar code, so
#                            the reference quantizers compute in plain IEEE float32.
#                            The quantizers (ggml/src/ggml-quants.c) live in ggml-base, which
#                            never gets the ARCH_FLAGS; on x86-64 its baseline ISA has no FMA,
#                            so this flag changes nothing there versus the default build that
#                            llama-cpp-python users get. On aarch64 (FMA in the baseline ISA,
#                            GCC contracts by default) default builds may differ in rare
#                            rounding cases; this build does not.
#   -DBUILD_SHARED_LIBS=ON   libggml-base.so can be loaded with ctypes.
#   -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF, no tests/examples/app; the server without SSL
#                            (it binds to 127.0.0.1 for quantkit).
#
# Idempotent: does nothing when the tools and VERSION exist (FORCE=1 rebuilds; a missing tool is built).
# Usage: scripts/build_llamacpp.sh [-j N]      (run it under `nice` on shared machines)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${LLAMACPP_DIR:-$ROOT/third_party/llama.cpp}"
JOBS="${JOBS:-2}"
if [[ "${1:-}" == "-j" ]]; then JOBS="$2"; fi
TOOLS=(llama-quantize llama-perplexity llama-imatrix llama-mtmd-cli llama-server llama-tokenize)

built() {
    [[ -f "$DEST/VERSION" ]] || return 1
    for t in "${TOOLS[@]}"; do [[ -x "$DEST/bin/$t" ]] || return 1; done
}

if [[ "${FORCE:-0}" != 1 ]] && built; then
    echo "llama.cpp already built in $DEST (FORCE=1 to rebuild):"
    cat "$DEST/VERSION"
    exit 0
fi

fetch_source() {
    local tmp="$1"
    python -m pip download --no-deps --no-binary llama-cpp-python llama-cpp-python -d "$tmp" >&2
    local tarball
    tarball="$(ls "$tmp"/llama_cpp_python-*.tar.gz | head -n1)"
    tar -xzf "$tarball" -C "$tmp"
    ls -d "$tmp"/llama_cpp_python-*/ | head -n1
}

vendored_commit() {
    # The sdist ships the submodule's git dir (.git/modules/vendor/llama.cpp); read HEAD.
    local sdist="$1"
    local head="$sdist/.git/modules/vendor/llama.cpp/HEAD"
    if [[ -f "$head" ]]; then cat "$head"; else echo unknown; fi
}

mkdir -p "$DEST"
if [[ ! -f "$DEST/src/CMakeLists.txt" ]]; then
    TMP="$(mktemp -d)"
    trap 'rm -rf "$TMP"' EXIT
    SDIST="$(fetch_source "$TMP")"
    PKG_VERSION="$(sed -n 's/^__version__ = "\(.*\)"/\1/p' "$SDIST/llama_cpp/__init__.py")"
    COMMIT="$(vendored_commit "$SDIST")"
    rm -rf "$DEST/src"
    cp -r "$SDIST/vendor/llama.cpp" "$DEST/src"
    rm -f "$DEST/src/.git"   # gitlink into the (deleted) sdist; build-info falls back to "unknown"
    printf 'llama-cpp-python %s\nllama.cpp commit %s\n' "$PKG_VERSION" "$COMMIT" > "$DEST/SOURCE"
fi

FLAGS=(
    -DCMAKE_BUILD_TYPE=Release
    -DGGML_NATIVE=OFF
    "-DCMAKE_C_FLAGS=-ffp-contract=off"
    "-DCMAKE_CXX_FLAGS=-ffp-contract=off"
    -DBUILD_SHARED_LIBS=ON
    -DLLAMA_CURL=OFF
    -DLLAMA_OPENSSL=OFF
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_SERVER=ON
    -DLLAMA_BUILD_APP=OFF
    -DLLAMA_BUILD_TOOLS=ON
)
GEN=()
if command -v ninja >/dev/null; then GEN=(-G Ninja); fi

cmake -S "$DEST/src" -B "$DEST/build" "${GEN[@]}" "${FLAGS[@]}" >&2
cmake --build "$DEST/build" -j "$JOBS" --target "${TOOLS[@]}" >&2
ln -sfn build/bin "$DEST/bin"

{
    cat "$DEST/SOURCE"
    echo "compiler $(${CC:-cc} --version | head -n1)"
    echo "flags ${FLAGS[*]}"
} > "$DEST/VERSION"
echo "built llama.cpp into $DEST:"
cat "$DEST/VERSION"
