#!/bin/bash
# Every GPU figure in one run (bench/gpu_check.py; docs/kernels.md "GPU check"): kernels, training
# throughput and MFU, decoding speed. Under 8 minutes on one H100/H200. --dry checks it on a CPU in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
exec "$PY" bench/gpu_check.py "$@"
