#!/usr/bin/env bash
# Sets up the environment and runs every check: lint, unit and integration tests, artifact checks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "test: installing the test tools" >&2
.venv/bin/python -m pip install --quiet -e ".[test]"
export PATH="$PWD/.venv/bin:$PATH"
# Tests start several processes (servers, operators) side by side on few cores: one
# torch thread each avoids OpenMP oversubscription, which slows every process down.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
ruff check .
ruff format --check .
# The Triton kernels run in Triton's interpreter; it must be on before they are defined,
# so the kernel suite gets its own process.
TRITON_INTERPRET=1 python -m pytest -q -p no:cacheprovider tests/kernels
python -m pytest -q -p no:cacheprovider --ignore=tests/kernels tests "$@"
