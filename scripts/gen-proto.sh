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
#   OUT_ROOT (default: the repository) receives agent/_proto and tests/_grpcio, both rebuilt
#   from nothing; the test that checks the committed code (tests/test_proto_generated.py)
#   regenerates into a temporary OUT_ROOT and compares byte for byte.
# Uses the repo's .venv when present (PYTHON overrides).
#
# The bytes depend on the generators' versions: grpcio-tools (its protoc, and its own version,
# which it writes into every *_pb2_grpc.py), betterproto's compiler, and the black and isort
# that compiler formats its output with. pyproject.toml's test extra pins each of them exactly,
# and this script refuses to run with any other version installed, so the same pins always
# give the same bytes. To move to a new grpcio-tools: change its pin (and grpcio's floor),
# reinstall with `pip install -e '.[test]'`, run this script, commit the result.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$(mkdir -p "${1:-$ROOT}" && cd "${1:-$ROOT}" && pwd)"
cd "$ROOT"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
# protoc finds protoc-gen-python_betterproto on PATH
export PATH="$(dirname "$PY"):$PATH"

# the generators installed must be exactly the versions the test extra pins
"$PY" - "$ROOT/pyproject.toml" <<'PYTHON'
import re
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, version

with open(sys.argv[1], "rb") as file:
    extra = tomllib.load(file)["project"]["optional-dependencies"]["test"]
pins = {}
for requirement in extra:
    match = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^]]*\])?==([^;\s]+)", requirement.split(";")[0].strip())
    if match:
        pins[match.group(1).lower()] = match.group(2)
wrong = []
for tool in ("grpcio-tools", "betterproto", "black", "isort"):
    try:
        installed = version(tool)
    except PackageNotFoundError:
        installed = "not installed"
    if tool not in pins:
        wrong.append(f"{tool}: not pinned with == in pyproject.toml's test extra")
    elif installed != pins[tool]:
        wrong.append(f"{tool}: {installed} installed, {pins[tool]} pinned")
if wrong:
    print("gen-proto.sh: the generators are not the pinned versions, so neither would the output be:", file=sys.stderr)
    print("\n".join(f"  {line}" for line in wrong), file=sys.stderr)
    print(f"  install the pins: {sys.executable} -m pip install -e '.[test]'", file=sys.stderr)
    sys.exit(1)
PYTHON

AGENT="$OUT/agent/_proto"
TESTS="$OUT/tests/_grpcio"
# both trees hold only generated files: rebuilt from nothing, a proto dropped from the list
# below leaves no stale module behind
rm -rf "${AGENT:?}" "${TESTS:?}"
mkdir -p "$AGENT" "$TESTS"
echo '"""Generated protobuf code (scripts/gen-proto.sh). Do not edit."""' > "$AGENT/__init__.py"
echo '"""Generated grpcio stubs for tests (scripts/gen-proto.sh). Do not edit."""' > "$TESTS/__init__.py"

# gen PROTO GROUP FLAT
#   PROTO  path under proto/
#   GROUP  agent/_proto/GROUP receives the betterproto package tree
#   FLAT   tests/_grpcio/FLAT_pb2.py, FLAT_pb2_grpc.py, FLAT_pb2.pyi
gen() {
    local proto="$1" group="$2" flat="$3"
    mkdir -p "$AGENT/$group"
    "$PY" -m grpc_tools.protoc -I proto --python_betterproto_out="$AGENT/$group" "proto/$proto"

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
