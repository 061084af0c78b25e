#!/usr/bin/env bash
# On an offline GPU machine: install the wheels scripts/gpu_wheels.sh fetched (no network, no dependency
# resolution) into /tmp/site, then run scripts/bench_gpu.py (quantkit against bare llm-compressor, the gate
# against plain forwards) with the arguments given, its table on stdout and its JSON under $OUT (the device
# tool's folder that comes back) or /tmp.
#
# Usage (from the repository root on the device):
#   scripts/device_bench.sh [WHEELS_DIR] -- [bench_gpu.py arguments, e.g. --shape 3b --time-limit 420]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="$ROOT/third_party/gpu-wheels"
if [[ $# -gt 0 && "$1" != "--" ]]; then WHEELS="$1"; shift; fi
[[ "${1:-}" == "--" ]] && shift
python3 -m pip install --no-index --no-deps --target /tmp/site "$WHEELS"/*.whl >/dev/null
export PYTHONPATH=/tmp/site PATH="/tmp/site/bin:$PATH"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, llmcompressor; print('torch', torch.__version__, 'transformers', transformers.__version__, 'llmcompressor', llmcompressor.__version__)"
RESULTS="${OUT:-/tmp}"
python3 "$ROOT/scripts/bench_gpu.py" --device cuda --work /tmp/bench-gpu --json "$RESULTS/bench_gpu.json" "$@"
