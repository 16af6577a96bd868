#!/usr/bin/env bash
# Regenerate the committed protobuf/gRPC code from proto/. Never edit the output by hand.
#
#   agent/_proto/<group>/<package path>/   betterproto + grpclib (what the agent runs)
#   tests/_grpcio/<flat name>_pb2*.py      grpcio stubs (the independent peer tests and
#                                          benchmarks use, like a Go kubelet would)
#
# Each proto gets its own output group (agent) and flat file name (tests), so two protos
# that share a package name (deviceplugin "v1beta1" and a DRA "v1beta1") never collide.
# Usage: scripts/gen-proto.sh          (from anywhere; uses the repo's .venv when present)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
# protoc finds protoc-gen-python_betterproto on PATH
export PATH="$(dirname "$PY"):$PATH"

mkdir -p agent/_proto tests/_grpcio
[ -f agent/_proto/__init__.py ] || echo '"""Generated protobuf code (scripts/gen-proto.sh). Do not edit."""' > agent/_proto/__init__.py
[ -f tests/_grpcio/__init__.py ] || echo '"""Generated grpcio stubs for tests (scripts/gen-proto.sh). Do not edit."""' > tests/_grpcio/__init__.py

# gen PROTO GROUP FLAT
#   PROTO  path under proto/
#   GROUP  agent/_proto/GROUP receives the betterproto package tree
#   FLAT   tests/_grpcio/FLAT_pb2.py, FLAT_pb2_grpc.py, FLAT_pb2.pyi
gen() {
    local proto="$1" group="$2" flat="$3"
    rm -rf "agent/_proto/$group"
    mkdir -p "agent/_proto/$group"
    "$PY" -m grpc_tools.protoc -I proto --python_betterproto_out="agent/_proto/$group" "proto/$proto"

    rm -f "tests/_grpcio/${flat}_pb2.py" "tests/_grpcio/${flat}_pb2.pyi" "tests/_grpcio/${flat}_pb2_grpc.py"
    # map the file to a flat virtual name so the modules land side by side in tests/_grpcio
    "$PY" -m grpc_tools.protoc -I"${flat}.proto=proto/$proto" \
        --python_out=tests/_grpcio --pyi_out=tests/_grpcio --grpc_python_out=tests/_grpcio "${flat}.proto"
    # grpcio-tools only emits absolute imports; make the stub import its sibling package-relative
    sed -i "s/^import ${flat}_pb2 as /from . import ${flat}_pb2 as /" "tests/_grpcio/${flat}_pb2_grpc.py"
}

gen deviceplugin/v1beta1/deviceplugin.proto deviceplugin deviceplugin_v1beta1
