#!/usr/bin/env bash
# What the agent sees on a machine with a real NVIDIA GPU, captured in one short run (about a
# minute; up to three when it makes MIG instances and an MPS daemon).
#
#   scripts/device-check.sh --prepare [--with-python]   # here, with network or a pip cache:
#                                                       # build .device-check/ to carry along
#   scripts/device-check.sh                             # there: no network, no pip install
#
# The device machine gets the working tree plus .device-check/ (pass it in the device tool's
# `carry`). Everything lands under $OUT (default device-check-out/); summary.txt says what to
# look at first. See docs/device-check.md.
set -uo pipefail
cd "$(dirname "$0")/.."
here=$(pwd)
carried=.device-check
pkgs=$carried/pkgs

# --- preparing the carried packages (and optionally an interpreter) --------------------------
prepare() {
  local with_python=$1 py=python3
  [ -x .venv/bin/python ] && py=.venv/bin/python
  rm -rf "$carried" && mkdir -p "$pkgs"
  # the runtime dependencies exactly as pyproject.toml lists them, no test tools
  mapfile -t deps < <("$py" -c 'import tomllib; [print(d) for d in tomllib.load(open("pyproject.toml","rb"))["project"]["dependencies"]]')
  "$py" -m pip install -q --no-compile --target "$pkgs" "${deps[@]}" || return 1
  # interpreter-independent: pure-Python fallbacks only (the *_NO_EXTENSIONS variables below)
  find "$pkgs" \( -name '*.so' -o -name '__pycache__' \) -prune -exec rm -rf {} +
  rm -rf "$pkgs/bin"
  if [ "$with_python" = yes ]; then
    # this interpreter, trimmed (no test suite, no site-packages, no static library); it needs
    # the machine's libc, libffi 8 and libssl 3 (Debian 12, Ubuntu 22.04 and later have them)
    "$py" - "$carried/python" <<'EOF'
import shutil, sys, sysconfig
from pathlib import Path

dest, base = Path(sys.argv[1]), Path(sys.base_prefix)
version = f"python{sys.version_info.major}.{sys.version_info.minor}"
(dest / "bin").mkdir(parents=True)
(dest / "lib").mkdir()
shutil.copy2(base / "bin" / version, dest / "bin" / "python3")
libdir = Path(sysconfig.get_config_var("LIBDIR") or base / "lib")
for lib in libdir.glob(f"lib{version}.so.*"):  # the shared libpython, when the build has one
    shutil.copy2(lib, dest / "lib" / lib.name)
skip = {"test", "tests", "site-packages", "idlelib", "tkinter", "ensurepip", "lib2to3", "turtledemo", "__pycache__"}
shutil.copytree(
    base / "lib" / version,
    dest / "lib" / version,
    ignore=lambda _, names: [
        n for n in names if n in skip or n.startswith(("config-", "_test", "_tkinter", "_ctypes_test", "xxlimited"))
    ],
)
EOF
    # debug symbols are most of the size; strip them when binutils are there
    command -v strip >/dev/null && find "$carried/python" -name '*.so*' -type f -exec strip --strip-unneeded {} +
  fi
  du -sh "$carried" "$carried"/* | sed 's/^/size: /'
  echo "carry: $carried (device tool: carry=[\"$carried\"])"
}

case "${1:-}" in
  --prepare) prepare "$([ "${2:-}" = --with-python ] && echo yes || echo no)"; exit $? ;;
  "") ;;
  *) echo "usage: $0 [--prepare [--with-python]]" >&2; exit 2 ;;
esac

# --- the check ----------------------------------------------------------------------------------
out="${OUT:-device-check-out}"
mkdir -p "$out"
out=$(cd "$out" && pwd)
export AIOHTTP_NO_EXTENSIONS=1 MULTIDICT_NO_EXTENSIONS=1 YARL_NO_EXTENSIONS=1 FROZENLIST_NO_EXTENSIONS=1 \
  PROPCACHE_NO_EXTENSIONS=1 PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
[ -d "$pkgs" ] && PYTHONPATH="$here:$here/$pkgs"
export GPU_AGENT_DRIVER_ROOT="${GPU_AGENT_DRIVER_ROOT:-/}"

# a Python >= 3.11: the carried interpreter, $PYTHON, the project venv, then the machine's
usable() { "$@" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }
py=""
if [ -x "$carried/python/bin/python3" ] && \
   LD_LIBRARY_PATH="$here/$carried/python/lib" PYTHONHOME="$here/$carried/python" usable "$carried/python/bin/python3"; then
  export LD_LIBRARY_PATH="$here/$carried/python/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" PYTHONHOME="$here/$carried/python"
  py="$here/$carried/python/bin/python3"
fi
for candidate in "${PYTHON:-}" .venv/bin/python python3.13 python3.12 python3.11 python3; do
  [ -z "$py" ] && [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 && usable "$candidate" && py=$candidate
done

summary="$out/summary.txt"
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }
# step NAME SECONDS CMD...: output to NAME.txt, one line per step in the summary
step() {
  local name=$1 secs=$2 rc
  shift 2
  { echo "\$ $*"; timeout "$secs" "$@"; } > "$out/$name.txt" 2>&1
  rc=$?
  note "$(printf '%-22s rc=%-3s %s' "$name" "$rc" "$*")"
}

note "device check $(date -u +%FT%TZ) on $(uname -n), kernel $(uname -r)"
note "python: ${py:-none >= 3.11 found} $( [ -n "$py" ] && "$py" -c 'import sys; print(sys.version.split()[0])')"
step os-release 5 cat /etc/os-release
step nvidia-smi-L 10 nvidia-smi -L
step nvidia-smi-q 20 nvidia-smi -q
step nvidia-smi-topo 10 nvidia-smi topo -m
step dev-nodes 5 bash -c 'ls -l /dev/nvidia* /dev/nvidia-caps /dev/dri /dev/dri/by-path 2>&1'
step mig-minors 5 cat /proc/driver/nvidia-caps/mig-minors
step driver-gpus 5 bash -c 'for f in /proc/driver/nvidia/gpus/*/information; do echo "== $f"; cat "$f"; done'
step nvidia-ctk-version 5 bash -c 'command -v nvidia-ctk && nvidia-ctk --version; command -v nvidia-cdi-hook && nvidia-cdi-hook --version'

if [ -z "$py" ]; then
  note "no Python >= 3.11: the agent parts are skipped (carry one: scripts/device-check.sh --prepare --with-python)"
  exit 0
fi

# NUMA node and PCIe root: sysfs (what the agent uses) next to NVML (what it must not use on Grace)
step numa 20 "$py" - <<'EOF'
import os
from pathlib import Path
from agent.backends import sysfs
from agent.backends.nvml import library as nvml_library
import pynvml as nvml
choice = nvml_library.locate(Path(os.environ["GPU_AGENT_DRIVER_ROOT"]))
print("library:", choice.searched)
if choice.path is not None:
    nvml_library.bind(nvml, choice.path)
nvml.nvmlInit()
print(f"{'index':5} {'bus id':16} {'sysfs numa':10} {'nvml numa':9} {'pcie root':12} drm")
for i in range(nvml.nvmlDeviceGetCount()):
    h = nvml.nvmlDeviceGetHandleByIndex(i)
    bus = nvml.nvmlDeviceGetPciInfo(h).busId
    bus = bus.decode() if isinstance(bus, bytes) else bus
    try:
        numa = nvml.nvmlDeviceGetNumaNodeId(h)
    except nvml.NVMLError as exc:
        numa = f"({exc})"
    root = Path("/sys")
    print(f"{i:<5} {bus:16} {sysfs.numa_node(root, bus)!s:10} {numa!s:9} {sysfs.pcie_root(root, bus)!s:12} {sysfs.drm_nodes(root, bus)}")
nvml.nvmlShutdown()
EOF
step inventory 30 "$py" -m agent inventory --backend nvml
step inventory-json 30 "$py" -m agent inventory --backend nvml --json

# 20 s of NVML health monitoring through the backend: every signal, and the event thread's status
step health-watch 40 "$py" - <<'EOF'
import asyncio, collections, json, os
from pathlib import Path
from agent.core.config.schema import HealthConfig
from agent.backends.nvml.backend import NvmlBackend

async def main() -> None:
    backend = NvmlBackend(health=HealthConfig(check_interval_s=2), driver_root=Path(os.environ["GPU_AGENT_DRIVER_ROOT"]), required=True)
    await backend.open()
    inventory = await backend.load()
    print("gpus:", len(inventory.gpus), "problems:", list(inventory.problems), "reason:", inventory.reason)
    signals = []
    task = asyncio.create_task(backend.watch_health(inventory, signals.append))
    await asyncio.sleep(20)
    status = backend.status()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await backend.close()
    counts = collections.Counter((s.uuid, s.kind.value, s.xid) for s in signals)
    for (uuid, kind, xid), n in sorted(counts.items()):
        print(f"{uuid} {kind} xid={xid} x{n}")
    for s in signals:
        if s.kind.value != "check-ok":
            print("signal:", s)
    print(json.dumps(status, indent=2, default=str))

asyncio.run(main())
EOF

# the agent itself for 5 s: readiness, /debug/state, metrics, the CDI spec it writes
root=$(mktemp -d /tmp/gpu-agent-check.XXXX)
mkdir -p "$root/kubelet/device-plugins" "$root/cdi" "$root/state"
port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$py" -m agent run --backend nvml --kubelet-root "$root/kubelet" --cdi-root "$root/cdi" --state-dir "$root/state" \
  --debug-addr "127.0.0.1:$port" > "$out/run.log" 2>&1 &
pid=$!
fetch() { "$py" - "$port" "$1" <<'EOF'
import json, sys, urllib.error, urllib.request
try:
    with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}{sys.argv[2]}", timeout=5) as r:
        body = r.read().decode()
except urllib.error.HTTPError as exc:
    body = exc.read().decode()
try:
    print(json.dumps(json.loads(body), indent=2))
except ValueError:
    print(body)
EOF
}
for _ in $(seq 1 50); do fetch /healthz >/dev/null 2>&1 && break; sleep 0.2; done
fetch /readyz > "$out/readyz-start.json" 2>&1
sleep 5 # ready, the CDI spec written, a first periodic check and event wait
fetch /readyz > "$out/readyz.json" 2>&1
fetch /debug/state > "$out/state.json" 2>&1
fetch /metrics > "$out/metrics.txt" 2>&1
ls -l "$root/cdi" > "$out/cdi-dir.txt" 2>&1
cp "$root"/cdi/*.json "$out/" 2>/dev/null
start=$(date +%s%N)
kill -TERM "$pid"
wait "$pid"
rc=$?
note "$(printf '%-22s rc=%-3s stopped %s ms after SIGTERM' agent-run "$rc" $(( ($(date +%s%N) - start) / 1000000 )))"
rm -rf "$root"

# our spec next to nvidia-ctk's, when the toolkit is installed
step cdi-agent 30 "$py" -m agent cdi generate --backend nvml --output "$out/cdi-agent.json"
if command -v nvidia-ctk >/dev/null 2>&1; then
  step cdi-nvidia-ctk 30 nvidia-ctk cdi generate --format json --output "$out/cdi-nvidia-ctk.json"
  step cdi-diff 10 "$py" - "$out/cdi-agent.json" "$out/cdi-nvidia-ctk.json" <<'EOF'
import json, sys
def view(path):
    spec = json.load(open(path))
    edits = [spec.get("containerEdits", {})] + [d["containerEdits"] for d in spec["devices"]]
    return {
        "cdiVersion": {spec["cdiVersion"]},
        "device names": {d["name"] for d in spec["devices"]},
        "device nodes": {n["path"] for e in edits for n in e.get("deviceNodes", [])},
        "mounts": {m["containerPath"] for e in edits for m in e.get("mounts", [])},
        "hooks": {" ".join(h["args"][1:]) for e in edits for h in e.get("hooks", [])},
        "env": {v for e in edits for v in e.get("env", [])},
    }
ours, theirs = view(sys.argv[1]), view(sys.argv[2])
for key in ours:
    print(f"== {key}")
    for item in sorted(ours[key] & theirs[key]):
        print(f"   both   {item}")
    for item in sorted(ours[key] - theirs[key]):
        print(f"   agent  {item}")
    for item in sorted(theirs[key] - ours[key]):
        print(f"   ctk    {item}")
EOF
else
  note "nvidia-ctk not installed: no reference spec to compare with"
fi
# MIG made and destroyed at run time, on the first MIG-capable GPU that has no MIG devices (and,
# before Hopper, is in MIG mode already); NVML's profiles next to the agent's tables. Whatever is
# made is destroyed again, and MIG mode ends as it was.
step mig-dynamic 90 "$py" - <<'EOF'
import asyncio, os, time
from pathlib import Path
from agent.backends.migprofiles import MODELS, toggles_without_reset
from agent.backends.nvml.backend import NvmlBackend
from agent.core.config.schema import HealthConfig
from agent.core.inventory.model import MigPlacement
from agent.core.partitioning import PartitionError

TABLES = {"H100 80GB": "h100-80gb", "H100 PCIe": "h100-80gb", "H200": "h200-141gb", "A100-SXM4-40GB": "a100-40gb",
          "A100-PCIE-40GB": "a100-40gb", "A100-SXM4-80GB": "a100-80gb", "A100 80GB": "a100-80gb", "A30": "a30-24gb"}

def at(p):
    return f"{p.start}:{p.size}"

def show(gpu):
    print(f"GPU {gpu.index} {gpu.product_name} {gpu.architecture} mig_enabled={gpu.mig_enabled} slices={gpu.mig_memory_slices}")
    for p in gpu.mig_profiles:
        print(f"  profile {p.profile_id:2} {p.name:12} c={p.compute_slices} m={p.memory_slices} {p.memory_mib} MiB"
              f" sm={p.multiprocessors} max={p.max_instances} ce={p.copy_engines} dec={p.decoders} enc={p.encoders}"
              f" jpg={p.jpeg_engines} ofa={p.ofa_engines} at {','.join(at(x) for x in p.placements)}")
    key = next((v for k, v in TABLES.items() if k in gpu.product_name), None)
    if key and gpu.mig_profiles:
        ours = {p.profile_id: p for p in MODELS[key].profiles}
        for p in gpu.mig_profiles:
            mine = ours.pop(p.profile_id, None)
            same = mine is not None and (mine.name, mine.placements, mine.max_instances) == (p.name, p.placements, p.max_instances)
            print(f"  table {key}: profile {p.profile_id} {'matches' if same else f'DIFFERS: ours {mine}'}")
        for mine in ours.values():
            print(f"  table {key}: profile {mine.profile_id} ({mine.name}) NOT OFFERED by NVML")
    for m in gpu.mig_devices:
        print(f"  mig {m.uuid} {m.profile} gi={m.gpu_instance_id} ci={m.compute_instance_id} at {m.placement}"
              f" caps={m.gi_cap_minor},{m.ci_cap_minor}")

async def main() -> None:
    root = Path(os.environ["GPU_AGENT_DRIVER_ROOT"])
    backend = NvmlBackend(health=HealthConfig(check_interval_s=3600), driver_root=root, required=True)
    await backend.open()
    try:
        inventory = await backend.load()
        for gpu in inventory.gpus:
            show(gpu)
        gpu = next((g for g in inventory.gpus if g.mig_profiles and not g.mig_devices
                    and (g.mig_enabled or toggles_without_reset(g.architecture))), None)
        if gpu is None:
            print("no MIG-capable GPU free to try (or only Ampere GPUs out of MIG mode): skipped")
            return
        small = min(gpu.mig_profiles, key=lambda p: (p.memory_slices, p.compute_slices, "+" in p.name))
        made = []
        try:
            for placement in small.placements[-2:]:
                started = time.monotonic()
                mig = await backend.mig.create(gpu.uuid, small.profile_id, placement)
                made.append(mig)
                print(f"created in {time.monotonic() - started:.2f} s: {mig}")
            off_the_end = MigPlacement(start=gpu.mig_memory_slices, size=small.memory_slices)
            for placement in (small.placements[-1], off_the_end):
                try:
                    await backend.mig.create(gpu.uuid, small.profile_id, placement)
                    print(f"UNEXPECTED: created another instance at {at(placement)}")
                except PartitionError as exc:
                    print(f"refused as expected: {exc.kind.value}: {exc}")
            print("instances:", await backend.mig.instances(gpu.uuid))
            seen = (await backend.load()).find(gpu.uuid)
            if seen is not None:
                show(seen)
        finally:
            for mig in reversed(made):
                started = time.monotonic()
                await backend.mig.destroy(gpu.uuid, mig.gpu_instance_id, mig.compute_instance_id)
                print(f"destroyed in {time.monotonic() - started:.2f} s: {mig.uuid}")
            after = (await backend.load()).find(gpu.uuid)
            print("after: mig_enabled", after.mig_enabled if after else None, "devices", after.mig_devices if after else None)
            print("mig status:", backend.status()["mig"])
    finally:
        await backend.close()

asyncio.run(main())
EOF

# one MPS control daemon for the first GPU outside MIG mode, supervised for a few seconds, then
# released; its control.log is printed
step mps 40 "$py" - <<'EOF'
import asyncio, os, shutil, tempfile
from pathlib import Path
from agent.backends.mps import MpsSupervisor
from agent.backends.mpscontrol import MpsProgram
from agent.backends.nvml.backend import NvmlBackend
from agent.core.config.schema import HealthConfig

async def main() -> None:
    root = Path(os.environ["GPU_AGENT_DRIVER_ROOT"])
    program = MpsProgram.find(root)
    print("program:", program.path if program else None)
    if program is None:
        print("nvidia-cuda-mps-control not found under the driver root: skipped")
        return
    backend = NvmlBackend(health=HealthConfig(check_interval_s=3600), driver_root=root, required=True)
    await backend.open()
    inventory = await backend.load()
    await backend.close()
    gpu = next((g for g in inventory.gpus if not g.mig_enabled), None)
    if gpu is None:
        print("every GPU is in MIG mode: skipped")
        return
    base = Path(tempfile.mkdtemp(prefix="mps-", dir="/tmp"))
    supervisor = MpsSupervisor(driver_root=root, base_dir=base, check_interval_s=1.0)
    try:
        daemon = await supervisor.ensure(gpu.uuid)
        print("daemon:", daemon)
        await supervisor.set_limits(gpu.uuid, active_thread_percentage=50, pinned_memory_mib=1024)
        print("asked:", await program.ask(daemon, "get_default_active_thread_percentage"))
        await asyncio.sleep(3)  # a few supervision rounds
        print("status:", supervisor.status())
    finally:
        await supervisor.release(gpu.uuid)
        await supervisor.close()
        for log in sorted(base.glob("*/log/*")):
            print(f"== {log}\n{log.read_text(errors='replace')[-4000:]}")
        shutil.rmtree(base, ignore_errors=True)

asyncio.run(main())
EOF

note "written to $out"
