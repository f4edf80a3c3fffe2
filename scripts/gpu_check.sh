#!/usr/bin/env bash
# The GPU path proven in one run of at most 8 minutes on an NVIDIA H200 (issue 35): the
# Triton kernels compiled for the GPU against the reference, the engine on CUDA in fp32
# and bf16 against transformers' generate, throughput against transformers' continuous
# batching, and decode attention bandwidth against the card's peak. Writes
# OUTDIR/gpu_check.json and OUTDIR/gpu_check.log (benchmarks/gpu_check.py says what is in
# them).
#
#   bash scripts/gpu_check.sh OUTDIR             # on a machine with an NVIDIA GPU
#   bash scripts/gpu_check.sh --dry-run OUTDIR   # the same steps on CPU at toy sizes (CI)
#
# Nothing is installed and nothing is downloaded: the host needs Python >= 3.11 with
# torch, triton, numpy, transformers, tokenizers, safetensors, tqdm and pytest (a PyTorch
# image has them). pagedinfer is imported from this checkout as it is, through a folder of
# links, so the checkout needs no pip install (and no embedded model, no .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] && PYTHON=.venv/bin/python
exec "$PYTHON" benchmarks/gpu_check.py "$@"
