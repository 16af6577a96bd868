"""The agent side by side with the Go reference drivers on a real kubelet; prints figures, asserts nothing.

Needs the real-peers harness running (a one-node v1.36 cluster on loopback: ``CDI_RUNTIME=1 up.sh``;
see the harness's README) and takes its locations from the environment::

    PEERS=<harness state dir> PEERS_HARNESS=<harness scripts dir> .venv/bin/python bench/bench_peers.py

It (re)starts, through the harness's ``ctl.sh``, the agent of this checkout (``AGENT_DIR``, default
this repository, as ``run --simulated`` on the 8-GPU preset, default log level), the Go e2e DRA test
driver (``test-driver.cdi.k8s.io``, 8 devices, CDI specs without a checkpoint) and the Go sample device
plugin (``example.com/resource``), and then, alternating agent and Go round by round:

1. **DRA** (the agent owns all 8 GPUs): a pod with 1 claim, and one with 8 claims, from a
   ResourceClaimTemplate of each driver's DeviceClass. Per pod: POST -> Running (API polls every
   20 ms), and NodePrepareResources as the kubelet timed it, from the kubelet's own
   ``dra_grpc_operations_duration_seconds`` (sum and count deltas on its ``/metrics``, so exactly
   that pod's call). Each pod is deleted and gone (its claims unprepared) before the next.
2. **Allocate** (the agent gives GPUs 4-7 to the device plugin, keeping 0-3 for DRA): grpcio
   straight on each plugin's socket, one caller (p50, p99) and 32 callers on one channel
   (calls/s), in alternating chunks.
3. **RSS** of each process afterwards (VmRSS), both of the agent's mechanisms serving.
4. With ``--other-paths N``, the paths that must not get slower, N times each: agent process start
   -> its ListAndWatch lists the device plugin's GPUs; a health change (``/debug/simulated/health``)
   -> the ListAndWatch update; a kubelet restart -> the agent's ResourceSlices published again.

With ``--trace`` the agent runs through ``bench/prepare_trace.py`` and the per-phase time of its
NodePrepareResources calls is printed too (the wrappers cost a little; compare without it).

Everything it creates carries the label ``app.kubernetes.io/created-by=gpu-node-agent-bench`` and is
deleted at the end; the agent's config file is put back as it was. The three processes are left
running.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import re
import shutil
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from bench import compare_client as client  # noqa: E402
from tests._grpcio import deviceplugin_v1beta1_pb2 as pb  # noqa: E402
from tests._grpcio import deviceplugin_v1beta1_pb2_grpc as pb_grpc  # noqa: E402

PEERS = Path(os.environ.get("PEERS", "/tmp/peers"))
HARNESS = Path(os.environ.get("PEERS_HARNESS", ""))
AGENT_DIR = Path(os.environ.get("AGENT_DIR", str(REPO)))
NODE = os.environ.get("PEERS_NODE", "peers-node")
NS = "default"
LABEL_KEY, LABEL_VALUE = "app.kubernetes.io/created-by", "gpu-node-agent-bench"
AGENT_DRIVER = "gpu-node-agent.nvidia.com"
GO_DRIVER = os.environ.get("DRA_DRIVER", "test-driver.cdi.k8s.io")
AGENT_CLASS = "gpu.gpu-node-agent.nvidia.com"
GO_CLASS = "bench-test-driver"
RUN = PEERS / "run"
AGENT_CONFIG = PEERS / "etc" / "agent-config.yaml"
PLUGIN_DIR = RUN / "kubelet" / "device-plugins"
AGENT_SOCKET = PLUGIN_DIR / "gpu-node-agent-nvidia-gpu.sock"
DEBUG = "http://127.0.0.1:19500"
KUBELET = ("127.0.0.1", 20250)
VERBOSE = bool(os.environ.get("BENCH_VERBOSE"))


def log(message: str) -> None:
    print(f"{datetime.datetime.now():%H:%M:%S} {message}", flush=True)


def wait_for(what: str, fn: Callable[[], Any], timeout: float, step: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(step)


# --- the API server and the kubelet --------------------------------------------------------


class Api:
    """Keep-alive HTTPS with the harness's admin token (one connection per thread)."""

    def __init__(self) -> None:
        etc = PEERS / "etc"
        rows = [line.split(",") for line in (etc / "tokens.csv").read_text().splitlines()]
        self.token = next(r[0] for r in rows if len(r) > 1 and r[1] == "peers-admin")
        self.ctx = ssl.create_default_context(cafile=str(etc / "pki" / "ca.crt"))
        self.local = threading.local()

    def call(self, method: str, path: str, body: Any = None, ok: tuple[int, ...] = ()) -> tuple[int, Any]:
        for _ in range(5):
            conn = getattr(self.local, "conn", None)
            try:
                if conn is None:
                    conn = http.client.HTTPSConnection("127.0.0.1", 36443, context=self.ctx, timeout=30)
                    self.local.conn = conn
                headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
                data = None
                if body is not None:
                    headers["Content-Type"] = "application/json"
                    data = json.dumps(body)
                conn.request(method, path, body=data, headers=headers)
                response = conn.getresponse()
                raw = response.read()
                answer = json.loads(raw) if raw[:1] in (b"{", b"[") else raw.decode(errors="replace")
                if ok and response.status not in ok:
                    raise RuntimeError(f"{method} {path}: HTTP {response.status}: {str(answer)[:300]}")
                return response.status, answer
            except (OSError, http.client.HTTPException):
                self.local.conn = None
                time.sleep(0.2)
        raise RuntimeError(f"{method} {path}: API server unreachable")

    def get(self, path: str) -> Any:
        return self.call("GET", path, ok=(200,))[1]

    def create(self, path: str, obj: dict[str, Any]) -> Any:
        return self.call("POST", path, obj, ok=(201,))[1]

    def pod_phase(self, name: str) -> str:
        status, pod = self.call("GET", f"/api/v1/namespaces/{NS}/pods/{name}")
        return str(pod.get("status", {}).get("phase", "")) if status == 200 else ""

    def ours(self, collection: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.get(f"{collection}?labelSelector={LABEL_KEY}={LABEL_VALUE}")["items"]
        return items


def kubelet_dra_seconds() -> dict[tuple[str, str], tuple[float, float]]:
    """(driver, method) -> (sum of seconds, count) of the kubelet's DRA calls, from its /metrics."""
    conn = http.client.HTTPSConnection(*KUBELET, context=ssl._create_unverified_context(), timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    out: dict[tuple[str, str], list[float]] = {}
    pattern = re.compile(r"^dra_grpc_operations_duration_seconds_(sum|count)\{([^}]*)\} (\S+)$")
    for line in text.splitlines():
        m = pattern.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        method = labels.get("method_name", "").rpartition("/")[2]
        entry = out.setdefault((labels.get("driver_name", "?"), method), [0.0, 0.0])
        entry[0 if m.group(1) == "sum" else 1] += float(m.group(3))
    return {k: (v[0], v[1]) for k, v in out.items()}


# --- the processes ------------------------------------------------------------------------


def ctl(verb: str, name: str, env: dict[str, str] | None = None) -> None:
    result = subprocess.run(
        [str(HARNESS / "ctl.sh"), verb, name],
        env={**os.environ, "PEERS": str(PEERS), "AGENT_DIR": str(AGENT_DIR), **(env or {})},
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"ctl.sh {verb} {name}: {result.stdout.strip()} {result.stderr.strip()}")


def pid_of(name: str) -> int:
    return int((RUN / "pids" / f"{name}.pid").read_text())


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def debug_state() -> dict[str, Any]:
    import urllib.request

    with urllib.request.urlopen(f"{DEBUG}/debug/state", timeout=10) as response:
        state: dict[str, Any] = json.loads(response.read())
    return state


def agent_owners() -> dict[int, str]:
    try:
        return {d["index"]: d["owner"] for d in debug_state()["devices"]}
    except OSError:
        return {}


def dra_registered() -> bool:
    try:
        return bool(debug_state()["mechanisms"]["dra"]["registration"]["status"] == "registered")
    except (OSError, KeyError):
        return False


def write_agent_config(dp_gpus: list[int]) -> None:
    lines = ["ownership:", "  default: dra"]
    if dp_gpus:
        per_gpu = ", ".join(f'"{i}": device-plugin' for i in dp_gpus)
        lines += ["  nodes:", f"    - match: {{names: [{NODE}]}}", f"      gpus: {{{per_gpu}}}"]
    tmp = AGENT_CONFIG.with_name(AGENT_CONFIG.name + ".bench-tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, AGENT_CONFIG)


def settle(dp_gpus: list[int]) -> None:
    write_agent_config(dp_gpus)
    want = {i: ("device-plugin" if i in dp_gpus else "dra") for i in range(8)}
    wait_for(f"agent owners {want}", lambda: agent_owners() == want, 120, 0.2)


# --- DRA ------------------------------------------------------------------------------------


def device_class(name: str, driver: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name, "labels": {LABEL_KEY: LABEL_VALUE}},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{driver}"'}}]},
    }


def template(name: str, device_class_name: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "labels": {LABEL_KEY: LABEL_VALUE}},
        "spec": {
            "metadata": {"labels": {LABEL_KEY: LABEL_VALUE}},  # the claims made from it
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": device_class_name}}]}},
        },
    }


def pod(name: str, template_name: str, claims: int) -> dict[str, Any]:
    refs = [{"name": f"c{i}", "resourceClaimTemplateName": template_name} for i in range(claims)]
    container = {
        "name": "c",
        "image": "localhost/peers/busybox:1",
        "imagePullPolicy": "Never",
        "command": ["sh", "-c", "sleep 100000"],
        "resources": {"claims": [{"name": r["name"]} for r in refs]},
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {LABEL_KEY: LABEL_VALUE}},
        "spec": {
            "hostNetwork": True,
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 1,
            "nodeSelector": {"kubernetes.io/hostname": NODE},
            "containers": [container],
            "resourceClaims": refs,
        },
    }


def one_pod(api: Api, name: str, template_name: str, driver: str, claims: int) -> tuple[float, float]:
    """(POST -> Running seconds, the kubelet's NodePrepareResources seconds) for one pod; returns
    once the pod is gone and its claims are unprepared and deleted."""
    prepare, unprepare = (driver, "NodePrepareResources"), (driver, "NodeUnprepareResources")
    before = kubelet_dra_seconds()
    started = time.monotonic()
    api.create(f"/api/v1/namespaces/{NS}/pods", pod(name, template_name, claims))
    wait_for(f"pod {name} Running", lambda: api.pod_phase(name) == "Running", 120, 0.02)
    running = time.monotonic() - started
    after = wait_for(
        f"the kubelet's NodePrepareResources metric for {name}",
        lambda: (m := kubelet_dra_seconds()).get(prepare, (0, 0))[1] > before.get(prepare, (0, 0))[1] and m,
        10,
        0.05,
    )
    seconds, calls = (a - b for a, b in zip(after[prepare], before.get(prepare, (0.0, 0.0)), strict=True))
    if calls != 1:
        log(f"  {name}: {calls:.0f} NodePrepareResources calls for one pod (a retry?)")
    api.call("DELETE", f"/api/v1/namespaces/{NS}/pods/{name}", ok=(200, 404))
    wait_for(f"pod {name} gone", lambda: api.call("GET", f"/api/v1/namespaces/{NS}/pods/{name}")[0] == 404, 120, 0.1)
    wait_for(
        f"{name}'s claims unprepared",
        lambda: kubelet_dra_seconds().get(unprepare, (0, 0))[1] > before.get(unprepare, (0, 0))[1],
        60,
        0.1,
    )
    wait_for(
        f"{name}'s claims deleted",
        lambda: not api.ours(f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims"),
        60,
        0.1,
    )
    return running, seconds / calls


def dra_rounds(api: Api, rounds: int, sizes: list[int]) -> dict[tuple[str, int], dict[str, list[float]]]:
    out: dict[tuple[str, int], dict[str, list[float]]] = {}
    drivers = [("agent", AGENT_DRIVER, "bench-agent"), ("go", GO_DRIVER, "bench-go")]
    for r in range(rounds):
        for size in sizes:
            order = drivers if r % 2 == 0 else drivers[::-1]
            for who, driver, template_name in order:
                running, prepare = one_pod(api, f"bench-{who}-{size}-{r}", template_name, driver, size)
                entry = out.setdefault((who, size), {"running": [], "prepare": []})
                entry["running"].append(running)
                entry["prepare"].append(prepare)
        log(f"  DRA round {r + 1}/{rounds} done (load average {os.getloadavg()[0]:.2f})")
    return out


# --- Allocate --------------------------------------------------------------------------------


def plugin_devices(socket: Path) -> list[str]:
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        stream = pb_grpc.DevicePluginStub(channel).ListAndWatch(pb.Empty(), timeout=10)
        first = next(stream)
        stream.cancel()
    return [d.ID for d in first.devices if d.health == "Healthy"]


def go_socket() -> Path:
    sockets = sorted(PLUGIN_DIR.glob("dp.*"), key=lambda p: p.stat().st_mtime)
    if not sockets:
        raise RuntimeError(f"no dp.* socket of the Go sample plugin in {PLUGIN_DIR}")
    return sockets[-1]


def allocate_rounds(rounds: int, calls: int, callers: int) -> dict[str, dict[str, list[float]]]:
    servers = {"agent": AGENT_SOCKET, "go": go_socket()}
    devices = {who: plugin_devices(socket) for who, socket in servers.items()}
    out: dict[str, dict[str, list[float]]] = {who: {"one": [], "rate": []} for who in servers}
    chunk = max(1, calls // rounds)
    for r in range(rounds):
        order = list(servers) if r % 2 == 0 else list(servers)[::-1]
        for who in order:
            samples, _ = client.allocate_load(str(servers[who]), devices[who], 1, chunk)
            out[who]["one"] += samples
        for who in order:
            samples, wall = client.allocate_load(str(servers[who]), devices[who], callers, chunk)
            out[who]["rate"].append(len(samples) / wall)
    return out


# --- the paths that must stay where they are ----------------------------------------------


def process_start_wall(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return time.time() - uptime + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def first_list(socket: Path, want: int, deadline: float) -> float | None:
    """Wall time at which a ListAndWatch on ``socket`` first lists ``want`` healthy devices."""
    while time.time() < deadline:
        try:
            if len(plugin_devices(socket)) == want:
                return time.time()
        except (grpc.RpcError, StopIteration):
            pass
        time.sleep(0.01)
    return None


def agent_slices() -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = Api().get("/apis/resource.k8s.io/v1/resourceslices")["items"]
    return [s for s in items if s["spec"]["driver"] == AGENT_DRIVER]


def other_paths(api: Api, restarts: int) -> dict[str, list[float]]:
    """Agent start -> devices offered, health -> ListAndWatch, kubelet restart -> slices back."""
    out: dict[str, list[float]] = {"start": [], "health": [], "kubelet": []}
    for _ in range(restarts):
        ctl("restart", "gpu-agent")
        pid = pid_of("gpu-agent")
        started = process_start_wall(pid)
        offered = first_list(AGENT_SOCKET, 4, time.time() + 60)
        if offered is not None:
            out["start"].append(offered - started)
        wait_for("the kubelet to register the agent's DRA plugin", dra_registered, 60, 0.2)
    wait_for("the agent's slices", agent_slices, 60, 0.2)
    gpu_uuid = {d["index"]: d["uuid"] for d in debug_state()["devices"]}[5]
    with grpc.insecure_channel(f"unix://{AGENT_SOCKET}") as channel:
        stream = pb_grpc.DevicePluginStub(channel).ListAndWatch(pb.Empty(), timeout=120)
        next(stream)
        for healthy in [False, True] * restarts:
            started = time.monotonic()
            body = json.dumps({"device": "5", "healthy": healthy, **({} if healthy else {"xid": 79})}).encode()
            import urllib.request

            request = urllib.request.Request(f"{DEBUG}/debug/simulated/health", data=body, method="POST")
            urllib.request.urlopen(request, timeout=10).read()
            want = "Healthy" if healthy else "Unhealthy"
            for response in stream:
                if any(gpu_uuid == d.ID and d.health == want for d in response.devices):
                    out["health"].append(time.monotonic() - started)
                    break
        stream.cancel()
    for _ in range(restarts):
        before = {s["metadata"]["uid"] for s in agent_slices()}
        started = time.monotonic()
        ctl("restart", "kubelet")
        wait_for(
            "the agent's slices published again after the kubelet's restart",
            lambda before=before: (now := {s["metadata"]["uid"] for s in agent_slices()}) and not now & before,
            120,
            0.05,
        )
        out["kubelet"].append(time.monotonic() - started)
        wait_for("the node Ready", lambda: api.call("GET", f"/api/v1/nodes/{NODE}")[0] == 200, 60, 0.5)
        wait_for("the kubelet to register the agent's DRA plugin", dra_registered, 60, 0.2)
    return out


# --- main ------------------------------------------------------------------------------------


def ms(values: list[float], q: float = 0.5) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def cleanup(api: Api) -> None:
    for p in api.ours(f"/api/v1/namespaces/{NS}/pods"):
        api.call("DELETE", f"/api/v1/namespaces/{NS}/pods/{p['metadata']['name']}?gracePeriodSeconds=0")
    wait_for("bench pods gone", lambda: not api.ours(f"/api/v1/namespaces/{NS}/pods"), 120, 0.5)
    for kind in ("resourceclaimtemplates", "resourceclaims"):
        api.call("DELETE", f"/apis/resource.k8s.io/v1/namespaces/{NS}/{kind}?labelSelector={LABEL_KEY}={LABEL_VALUE}")
    api.call("DELETE", f"/apis/resource.k8s.io/v1/deviceclasses?labelSelector={LABEL_KEY}={LABEL_VALUE}")


def start_processes(trace: Path | None, work: Path) -> None:
    # byte-compiled, as in the image (see bench_compare.compile_bytecode)
    subprocess.run(
        [str(AGENT_DIR / ".venv" / "bin" / "python"), "-m", "compileall", "-q", str(AGENT_DIR / "agent")],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    env: dict[str, str] = {}
    if trace is not None:
        wrapper = work / "gpu-agent-traced"
        python = AGENT_DIR / ".venv" / "bin" / "python"
        wrapper.write_text(
            f'#!/bin/sh\nexport PYTHONPATH="{AGENT_DIR}" PREPARE_TRACE="{trace}"\n'
            f'exec "{python}" -m bench.prepare_trace "$@"\n'
        )
        wrapper.chmod(0o755)
        env["AGENT"] = str(wrapper)
    ctl("restart", "gpu-agent", env)
    ctl("start", "dra-test-driver")
    ctl("start", "goplugin")
    wait_for("the agent's debug endpoint", agent_owners, 60, 0.2)
    # a pod made before the kubelet knows the new process waits out the kubelet's retry backoff
    wait_for("the kubelet to register the agent's DRA plugin", dra_registered, 60, 0.2)


def main(args: argparse.Namespace) -> None:
    if not (HARNESS / "ctl.sh").is_file() or not (PEERS / "etc").is_dir():
        sys.exit("bench_peers: set PEERS (the harness's state directory) and PEERS_HARNESS (its scripts)")
    sizes = [int(s) for s in args.sizes.split(",") if s]
    api = Api()
    work = Path(tempfile.mkdtemp(prefix="bench-peers-"))
    trace = work / "trace.jsonl" if args.trace else None
    saved_config = AGENT_CONFIG.read_bytes() if AGENT_CONFIG.exists() else None
    load_before = os.getloadavg()
    log(f"{datetime.date.today()}: {os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in load_before)}")
    try:
        cleanup(api)
        write_agent_config([])
        start_processes(trace, work)
        settle([])
        for obj, path in (
            (device_class(GO_CLASS, GO_DRIVER), "/apis/resource.k8s.io/v1/deviceclasses"),
            (template("bench-go", GO_CLASS), f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaimtemplates"),
            (template("bench-agent", AGENT_CLASS), f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaimtemplates"),
        ):
            api.create(path, obj)
        if api.call("GET", f"/apis/resource.k8s.io/v1/deviceclasses/{AGENT_CLASS}")[0] == 404:
            import yaml

            agent_class = yaml.safe_load((REPO / "config" / "deviceclasses" / "gpu.yaml").read_text())
            agent_class["metadata"]["labels"] = {LABEL_KEY: LABEL_VALUE}
            api.create("/apis/resource.k8s.io/v1/deviceclasses", agent_class)
        wait_for(
            "both drivers' ResourceSlices",
            lambda: (
                {s["spec"]["driver"] for s in api.get("/apis/resource.k8s.io/v1/resourceslices")["items"]}
                >= {AGENT_DRIVER, GO_DRIVER}
            ),
            120,
            0.5,
        )
        log(f"DRA: {args.rounds} rounds of pods with {sizes} claims, agent and Go alternating")
        dra = dra_rounds(api, args.rounds, sizes)
        log("Allocate: GPUs 4-7 to the device plugin")
        settle([4, 5, 6, 7])
        allocate = allocate_rounds(args.allocate_rounds, args.allocate_calls, args.callers)
        rss = {
            "agent": rss_mib(pid_of("gpu-agent")),
            "go DRA test driver": rss_mib(pid_of("dra-test-driver")),
            "go sample device plugin": rss_mib(pid_of("goplugin")),
        }
        load_after = os.getloadavg()
        report(dra, allocate, rss, sizes, load_before, load_after)
        if args.other_paths:
            paths = other_paths(api, args.other_paths)
            print("\nother paths (agent only), median and range (s):")
            for key, label in (
                ("start", "agent process start -> ListAndWatch lists its 4 GPUs"),
                ("health", "health POST -> ListAndWatch update"),
                ("kubelet", "kubelet restart -> the agent's ResourceSlices published again"),
            ):
                values = paths[key]
                if values:
                    print(
                        f"  {label:64s} {statistics.median(values):6.3f}  ({min(values):.3f}-{max(values):.3f},"
                        f" n={len(values)})"
                    )
        if trace is not None:
            print_trace(trace)
    finally:
        cleanup(api)
        if saved_config is not None:
            AGENT_CONFIG.write_bytes(saved_config)
        shutil.rmtree(work, ignore_errors=True)


def report(
    dra: dict[tuple[str, int], dict[str, list[float]]],
    allocate: dict[str, dict[str, list[float]]],
    rss: dict[str, float],
    sizes: list[int],
    load_before: tuple[float, float, float],
    load_after: tuple[float, float, float],
) -> None:
    print(
        f"\nside by side on the real kubelet, {datetime.date.today()}; load average {load_before[0]:.2f} before,"
        f" {load_after[0]:.2f} after (1 min)"
    )
    print(f"  {'what':52s} {'agent':>9s} {'Go':>9s} {'ratio':>6s}")
    for size in sizes:
        a, g = dra[("agent", size)], dra[("go", size)]
        for key, label in (
            ("prepare", "NodePrepareResources (kubelet), median"),
            ("running", "POST -> Running, median"),
        ):
            av, gv = statistics.median(a[key]) * 1000, statistics.median(g[key]) * 1000
            print(f"  {f'{label}, {size} claim(s)':52s} {av:7.1f}ms {gv:7.1f}ms {av / gv:6.2f}")
        print(
            f"  {'   range (min-max) NodePrepareResources':52s} {ms(a['prepare'], 0):.1f}-{ms(a['prepare'], 1):.1f}"
            f"  {ms(g['prepare'], 0):.1f}-{ms(g['prepare'], 1):.1f}"
        )
    a, g = allocate["agent"], allocate["go"]
    p50a, p50g = ms(a["one"]), ms(g["one"])
    print(f"  {'Allocate p50, one caller':52s} {p50a:7.2f}ms {p50g:7.2f}ms {p50a / p50g:6.2f}")
    print(f"  {'Allocate p99, one caller':52s} {ms(a['one'], 0.99):7.2f}ms {ms(g['one'], 0.99):7.2f}ms")
    ar, gr = statistics.median(a["rate"]), statistics.median(g["rate"])
    print(f"  {'Allocate calls/s, 32 callers (median of rounds)':52s} {ar:9.0f} {gr:9.0f} {ar / gr:6.2f}")
    print(f"     per round: agent {[round(x) for x in a['rate']]}, Go {[round(x) for x in g['rate']]}")
    go_rss = rss["go DRA test driver"] + rss["go sample device plugin"]
    print(f"  {'RSS after the burst (MiB; Go: both processes)':52s} {rss['agent']:9.1f} {go_rss:9.1f}")
    print(
        f"     Go DRA test driver {rss['go DRA test driver']:.1f} MiB,"
        f" Go sample device plugin {rss['go sample device plugin']:.1f} MiB"
    )


def print_trace(trace: Path) -> None:
    lines = [json.loads(x) for x in trace.read_text().splitlines() if x.strip()]
    lines = [x for x in lines if "driver: whole batch" in x["phases"]]
    by_size: dict[int, list[dict[str, Any]]] = {}
    for x in lines:
        by_size.setdefault(int(x["phases"].get("claim: read (GET + decode)", {}).get("n", 0)), []).append(x)
    for size, calls in sorted(by_size.items()):
        print(f"\nagent NodePrepareResources with {size} claim(s), {len(calls)} calls, medians (ms):")
        print(f"  {'handler wall':44s} {statistics.median(x['handler_ms'] for x in calls):7.2f}")
        names = sorted({n for x in calls for n in x["phases"]})
        for name in names:
            wall = statistics.median(x["phases"].get(name, {}).get("wall_ms", 0.0) for x in calls)
            print(f"  {name:44s} {wall:7.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="DRA rounds (each: one pod per driver and size)")
    parser.add_argument("--sizes", default="1,8", help="claims per pod")
    parser.add_argument("--allocate-calls", type=int, default=4000, help="Allocate calls per plugin and caller count")
    parser.add_argument("--allocate-rounds", type=int, default=4)
    parser.add_argument("--callers", type=int, default=32)
    parser.add_argument("--trace", action="store_true", help="run the agent through bench/prepare_trace.py")
    parser.add_argument(
        "--other-paths", type=int, default=0, metavar="N", help="then N agent restarts, health flips, kubelet restarts"
    )
    main(parser.parse_args())
