#!/usr/bin/env bash
# Regenerates the Python gRPC stubs in service/proto/ from protos/pagedinfer/v1/*.proto.
#
# usage: scripts/gen_protos.sh [OUT_DIR]   (default: service/proto)
#
# protoc names generated modules after the proto's path (pagedinfer.v1.inference_pb2);
# they are installed as pagedinfer.service.proto, so the module names in the generated
# code are rewritten to that package. tests/service/test_protos.py checks that the
# committed stubs are exactly what this script produces.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-service/proto}
PY=${PYTHON:-python}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$OUT"
for proto in protos/pagedinfer/v1/*.proto; do
  rel=${proto#protos/}
  "$PY" -m grpc_tools.protoc -I protos \
    --python_out="$TMP" --grpc_python_out="$TMP" "$rel"
  name=$(basename "$rel" .proto)
  for f in "$TMP/pagedinfer/v1/${name}"_pb2*; do
    sed -e "s/^from pagedinfer\.v1 import /from pagedinfer.service.proto import /" \
        -e "s/'pagedinfer\.v1\.${name}_pb2'/'pagedinfer.service.proto.${name}_pb2'/" \
        "$f" >"$OUT/$(basename "$f")"
  done
done
