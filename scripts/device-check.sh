#!/usr/bin/env bash
# A short check on a machine with a real NVIDIA GPU (the project's lent device machine):
# the NVML inventory, a few seconds of the agent with NVML health monitoring, and the CDI spec
# generated against the real driver. Results land under $OUT (default ./device-check-out).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-device-check-out}"
mkdir -p "$out"
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
if ! "$py" -c "import agent" 2>/dev/null; then
  "$py" -m venv .venv && .venv/bin/pip install -q -e . && py=.venv/bin/python
fi
run() { echo "== $*"; "$@"; echo "rc=$?"; }
{
  run nvidia-smi -L
  run "$py" -m agent inventory --backend nvml
  run "$py" -m agent inventory --backend nvml --json
} > "$out/inventory.txt" 2>&1

root=$(mktemp -d /tmp/gpu-agent-check.XXXX)
mkdir -p "$root/kubelet/device-plugins" "$root/cdi"
"$py" -m agent run --backend nvml --kubelet-root "$root/kubelet" --cdi-root "$root/cdi" \
  --state-dir "$root/state" --debug-addr 127.0.0.1:9499 > "$out/run.log" 2>&1 &
pid=$!
for _ in $(seq 1 50); do curl -sf 127.0.0.1:9499/readyz >/dev/null && break; sleep 0.2; done
sleep 8  # let a couple of health-check rounds and the NVML event loop run
curl -s 127.0.0.1:9499/readyz > "$out/readyz.json"
curl -s 127.0.0.1:9499/debug/state > "$out/state.json"
curl -s 127.0.0.1:9499/metrics > "$out/metrics.txt"
ls -l "$root/cdi" > "$out/cdi-dir.txt" 2>&1
start=$(date +%s.%N); kill -TERM "$pid"; wait "$pid"; echo "exit=$? after $(echo "$(date +%s.%N) - $start" | bc) s" >> "$out/run.log"

{
  run "$py" -m agent cdi generate --backend nvml --output -
  run "$py" -m agent cdi check "$root/cdi"
} > "$out/cdi.txt" 2>&1
rm -rf "$root"
echo "device check written to $out"
