#!/usr/bin/env bash
# Regenerate the committed protobuf/gRPC code from proto/. Never edit the output by hand.
#
#   agent/_proto/<group>/<package path>/   betterproto + grpclib (what the agent runs)
#   tests/_grpcio/<flat name>_pb2*.py      grpcio stubs (the independent peer tests and
#                                          benchmarks use, like a Go kubelet would)
#
# Each proto gets its own output group (agent) and flat file name (tests), so protos that
# share a package name (deviceplugin "v1beta1" and DRA "...dra.v1beta1"; podresources "v1"
# and DRA "...dra.v1") never collide.
#
# Usage: scripts/gen-proto.sh [OUT_ROOT]
#   OUT_ROOT (default: the repository) receives agent/_proto and tests/_grpcio; the test
#   that checks the committed code regenerates into a temporary OUT_ROOT and compares.
# Uses the repo's .venv when present (PYTHON overrides).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$(mkdir -p "${1:-$ROOT}" && cd "${1:-$ROOT}" && pwd)"
cd "$ROOT"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
# protoc finds protoc-gen-python_betterproto on PATH
export PATH="$(dirname "$PY"):$PATH"

AGENT="$OUT/agent/_proto"
TESTS="$OUT/tests/_grpcio"
mkdir -p "$AGENT" "$TESTS"
[ -f "$AGENT/__init__.py" ] || echo '"""Generated protobuf code (scripts/gen-proto.sh). Do not edit."""' > "$AGENT/__init__.py"
[ -f "$TESTS/__init__.py" ] || echo '"""Generated grpcio stubs for tests (scripts/gen-proto.sh). Do not edit."""' > "$TESTS/__init__.py"

# gen PROTO GROUP FLAT
#   PROTO  path under proto/
#   GROUP  agent/_proto/GROUP receives the betterproto package tree
#   FLAT   tests/_grpcio/FLAT_pb2.py, FLAT_pb2_grpc.py, FLAT_pb2.pyi
gen() {
    local proto="$1" group="$2" flat="$3"
    rm -rf "${AGENT:?}/$group"
    mkdir -p "$AGENT/$group"
    "$PY" -m grpc_tools.protoc -I proto --python_betterproto_out="$AGENT/$group" "proto/$proto"

    rm -f "$TESTS/${flat}_pb2.py" "$TESTS/${flat}_pb2.pyi" "$TESTS/${flat}_pb2_grpc.py"
    # map the file to a flat virtual name so the modules land side by side in tests/_grpcio
    "$PY" -m grpc_tools.protoc -I"${flat}.proto=proto/$proto" \
        --python_out="$TESTS" --pyi_out="$TESTS" --grpc_python_out="$TESTS" "${flat}.proto"
    # grpcio-tools only emits absolute imports; make the stub import its sibling package-relative
    sed -i "s/^import ${flat}_pb2 as /from . import ${flat}_pb2 as /" "$TESTS/${flat}_pb2_grpc.py"
}

gen deviceplugin/v1beta1/deviceplugin.proto deviceplugin deviceplugin_v1beta1
gen dra/v1/dra.proto dra_v1 dra_v1
gen dra/v1beta1/dra.proto dra_v1beta1 dra_v1beta1
gen drahealth/v1alpha1/health.proto drahealth_v1alpha1 drahealth_v1alpha1
gen pluginregistration/v1/registration.proto pluginregistration pluginregistration_v1
gen podresources/v1/podresources.proto podresources_v1 podresources_v1
