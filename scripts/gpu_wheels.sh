#!/usr/bin/env bash
# Fetch the wheels an offline GPU machine needs to run quantkit and its benchmarks (scripts/device_bench.sh),
# into DIR (default third_party/gpu-wheels, gitignored): what the machine's image lacks (shared/reference/
# gpu-device.md: Python 3.12 with torch, transformers 5.17, accelerate, safetensors, tokenizers, numpy, numba,
# pyyaml, typer, rich, pyarrow, huggingface-hub, peft and triton already there) as cp312 manylinux x86_64
# wheels at the versions installed on this machine, no dependencies resolved (the list is the set that was
# measured to be missing), and quantkit's own.
#
# Usage: scripts/gpu_wheels.sh [DIR]      then carry DIR to the device (about 13 MiB).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$ROOT/third_party/gpu-wheels}"
mkdir -p "$DIR"
NAMES=(llmcompressor compressed-tensors gguf pydantic pydantic-core annotated-types typing-inspection
       typing-extensions datasets dill multiprocess loguru pillow auto-round py-cpuinfo nvidia-ml-py)
# each at the version installed here, where quantkit's tests ran (pydantic pins pydantic-core exactly)
mapfile -t PACKAGES < <(python -c 'import sys
from importlib.metadata import version
print("\n".join(f"{n}=={version(n)}" for n in sys.argv[1:]))' "${NAMES[@]}")
python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DIR" "${PACKAGES[@]}"
python -m pip wheel --no-deps "$ROOT" -w "$DIR"
du -sh "$DIR"
