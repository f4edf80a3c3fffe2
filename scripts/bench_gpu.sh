#!/usr/bin/env bash
# Paged-attention kernel benchmark on an NVIDIA GPU: decode bandwidth (% of peak HBM),
# paged vs contiguous SDPA, prefill TFLOP/s. About 2 minutes; results land in
# benchmarks/results/kernels_gpu.{json,png}. Arguments pass through, e.g. --quick or
# --peak-gbps 3350 for a card the script does not know.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=python3
[ -x .venv/bin/python ] && PYTHON=.venv/bin/python
exec "$PYTHON" benchmarks/kernels_gpu.py "$@"
