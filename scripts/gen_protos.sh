#!/usr/bin/env bash
# Regenerates protos/pdserve/v1/*_pb2.py, *_pb2_grpc.py and *.pyi from the .proto files.
# Usage: scripts/gen_protos.sh [OUT_DIR]   (default: the repository root, i.e. in place)
# The include root is the repository root, so generated modules import each other as
# `protos.pdserve.v1.x_pb2` (see protos/README.md). Needs grpcio-tools (pip install grpcio-tools).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$root}"
cd "$root"
mkdir -p "$out"
"${PYTHON:-python3}" -m grpc_tools.protoc -I . \
  --python_out="$out" --grpc_python_out="$out" --pyi_out="$out" \
  protos/pdserve/v1/*.proto
