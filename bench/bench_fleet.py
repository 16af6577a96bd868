"""Fleet simulation: N agents against one real kube-apiserver, in steady state and through a restart.

Each agent is a real ``gpu-agent run`` process on the simulated 8-GPU preset with its own node
name, a Node object of that name, a temporary kubelet root without a kubelet, and its own state
and CDI directories. GPUs 0-3 are DRA's (the agent publishes a ResourceSlice), 4-7 the device
plugin's, and ``--holders`` pods bound to the node (``spec.nodeName``; no kubelet ever runs them)
hold device-plugin GPUs through a fake PodResources API, so the orphan check has holders to
follow. The agents use the project's RBAC (``config/base``), bound to the harness's agent user.

What it measures, and prints as Markdown (``--json`` also writes the figures):

* steady state, over ``--steady-s`` after ``--settle-s``: requests per node per minute by verb and
  resource, from the agents' own ``gpu_agent_kube_request_duration_seconds_count`` (and, as a
  cross-check, the API server's ``apiserver_request_total``); the API server's and etcd's CPU per
  node (less what they use with no agent, measured first for ``--baseline-s``);
* an API server restart (``ctl.sh restart kube-apiserver``): every list the agents make afterwards,
  per second, from the restarted server's own counters sampled every second for ``--after-s``:
  the peak relist rate, relists per node, and how long until the last one.

The harness (etcd and kube-apiserver are all it needs) comes from the environment, as its scripts
take it: ``PEERS`` (the run directory: ``etc/tokens.csv``, ``etc/pki/ca.crt``,
``etc/agent.kubeconfig``, ``run/pids``), ``PEERS_SCRIPTS`` (the directory with ``ctl.sh`` and
``bind_project_rbac.py``), ``APISERVER`` (default ``https://127.0.0.1:36443``). With
``--start`` it starts etcd and the API server through ``ctl.sh`` when they are not running.

    PEERS=... PEERS_SCRIPTS=... python bench/bench_fleet.py --agents 40 [--steady-s 600] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import ssl
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_compare import cpu_seconds, rss_mib
from tests.fake_podresources import FakePodResources

REPO = Path(__file__).resolve().parents[1]
NAMESPACE = "fleet-bench"
LABEL = "bench.gpu-node-agent.nvidia.com/fleet"
#: the fleet the figures are extrapolated to
FLEET = 5000
#: resources the agents list and watch
WATCHED = ("nodes", "pods", "resourceslices")


def env(name: str, default: str | None = None) -> str:
    value = os.environ.get(name, default)
    if not value:
        sys.exit(f"set {name} (see the module docstring)")
    return value


class Harness:
    """The harness's files, its control script, and admin access to its API server."""

    def __init__(self) -> None:
        self.peers = Path(env("PEERS"))
        self.scripts = Path(env("PEERS_SCRIPTS"))
        self.server = env("APISERVER", "https://127.0.0.1:36443")
        tokens = (self.peers / "etc" / "tokens.csv").read_text().splitlines()
        self.token = next(line.split(",")[0] for line in tokens if ",peers-admin," in line)
        self.ssl = ssl.create_default_context(cafile=str(self.peers / "etc" / "pki" / "ca.crt"))
        self.kubeconfig = self.peers / "etc" / "agent.kubeconfig"
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def api(self, method: str, path: str, body: Any = None, *, ok: tuple[int, ...] = (200, 201)) -> Any:
        headers = {"Authorization": f"Bearer {self.token}"}
        timeout = aiohttp.ClientTimeout(total=60)
        async with self._http().request(
            method, self.server + path, json=body, headers=headers, ssl=self.ssl, timeout=timeout
        ) as resp:
            data = await resp.read()
            if resp.status not in ok:
                raise RuntimeError(f"{method} {path}: {resp.status} {data[:300]!r}")
            return json.loads(data) if data[:1] in (b"{", b"[") else data.decode()

    async def text(self, url: str, *, token: bool = False) -> str:
        """GET a page of another component (its /metrics), with the admin token when it asks for one."""
        headers = {"Authorization": f"Bearer {self.token}"} if token else {}
        async with self._http().get(url, headers=headers, ssl=False, timeout=aiohttp.ClientTimeout(total=30)) as r:
            return await r.text()

    async def up(self) -> bool:
        try:
            return bool(await self.api("GET", "/readyz") == "ok")
        except (aiohttp.ClientError, OSError, RuntimeError, TimeoutError):
            return False

    async def ctl(self, *args: str) -> None:
        proc = await asyncio.create_subprocess_exec(
            "bash", str(self.scripts / "ctl.sh"), *args, env={**os.environ, "PEERS": str(self.peers)}
        )
        if await proc.wait() != 0:
            raise RuntimeError(f"ctl.sh {' '.join(args)} failed")

    def pid(self, name: str) -> int:
        return int((self.peers / "run" / "pids" / f"{name}.pid").read_text())

    def cpu(self, name: str) -> float:
        return cpu_seconds(self.pid(name))

    async def bind_rbac(self) -> None:
        python = self.peers / "tools" / "bin" / "python"
        proc = await asyncio.create_subprocess_exec(
            str(python), str(self.scripts / "bind_project_rbac.py"), str(REPO), stdout=asyncio.subprocess.DEVNULL
        )
        if await proc.wait() != 0:
            raise RuntimeError("bind_project_rbac.py failed")

    async def requests(self) -> Counter[tuple[str, str]]:
        """The API server's ``apiserver_request_total`` by (verb, resource), resource requests only."""
        text = await self.api("GET", "/metrics")
        out: Counter[tuple[str, str]] = Counter()
        for family in text_string_to_metric_families(text):
            if family.name != "apiserver_request":
                continue
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.labels.get("resource"):
                    out[(sample.labels["verb"], sample.labels["resource"])] += int(sample.value)
        return out


@dataclass
class Agent:
    index: int
    root: Path
    port: int
    proc: asyncio.subprocess.Process | None = None
    pod_resources: FakePodResources | None = None
    uuids: list[str] = field(default_factory=list)

    @property
    def node(self) -> str:
        return f"fleet-{self.index:04d}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def get(self, session: aiohttp.ClientSession, path: str) -> Any:
        async with session.get(f"http://127.0.0.1:{self.port}{path}", timeout=aiohttp.ClientTimeout(total=30)) as r:
            data = await r.read()
            return json.loads(data) if path.startswith("/debug") else data.decode()

    async def requests(self, session: aiohttp.ClientSession) -> Counter[tuple[str, str]]:
        """The agent's own count of its API requests by (verb, resource)."""
        out: Counter[tuple[str, str]] = Counter()
        for family in text_string_to_metric_families(await self.get(session, "/metrics")):
            if family.name != "gpu_agent_kube_request_duration_seconds":
                continue
            for sample in family.samples:
                if sample.name.endswith("_count"):
                    out[(sample.labels["verb"], sample.labels["resource"])] += int(sample.value)
        return out


def config_text(node: str) -> str:
    gpus = ", ".join(f'"{i}": device-plugin' for i in range(4, 8))
    return f"ownership:\n  default: dra\n  nodes:\n    - match: {{names: [{node}]}}\n      gpus: {{{gpus}}}\n"


class Fleet:
    def __init__(self, harness: Harness, args: argparse.Namespace, root: Path) -> None:
        self.h = harness
        self.args = args
        self.root = root
        self.agents = [Agent(i, root / f"n{i:04d}", args.first_port + i) for i in range(args.agents)]
        self.session = aiohttp.ClientSession()

    # --- objects in the API server -----------------------------------------------------------

    async def clean(self) -> None:
        """Remove what an earlier run left: its pods (at once: no kubelet runs them), slices and nodes."""
        await self.h.api("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods?gracePeriodSeconds=0", ok=(200, 404))
        await self.h.api("DELETE", f"/api/v1/nodes?labelSelector={LABEL}", ok=(200, 404))
        for item in (await self.h.api("GET", "/apis/resource.k8s.io/v1/resourceslices"))["items"]:
            if str(item["spec"].get("nodeName", "")).startswith("fleet-"):
                await self.h.api("DELETE", f"/apis/resource.k8s.io/v1/resourceslices/{item['metadata']['name']}")

    async def create_objects(self) -> None:
        # kept between runs: without the controller manager nothing would finish deleting a namespace
        await self.h.api("POST", "/api/v1/namespaces", {"metadata": {"name": NAMESPACE}}, ok=(201, 409))
        account = {"metadata": {"name": "default"}}
        await self.h.api("POST", f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts", account, ok=(201, 409))
        for agent in self.agents:
            await self.h.api("POST", "/api/v1/nodes", {"metadata": {"name": agent.node, "labels": {LABEL: "true"}}})
            for j in range(self.args.holders):
                pod = {
                    "metadata": {"name": f"{agent.node}-p{j}"},
                    "spec": {
                        "nodeName": agent.node,
                        "automountServiceAccountToken": False,
                        "containers": [{"name": "main", "image": "localhost/peers/busybox:1"}],
                    },
                }
                await self.h.api("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", pod)

    # --- the agents ----------------------------------------------------------------------------

    async def start(self, agent: Agent) -> None:
        for sub in ("kubelet/device-plugins", "kubelet/plugins_registry", "kubelet/plugins", "cdi", "state"):
            (agent.root / sub).mkdir(parents=True, exist_ok=True)
        config = agent.root / "config.yaml"
        config.write_text(config_text(agent.node))
        agent.pod_resources = FakePodResources(agent.root / "kubelet" / "pod-resources")
        await agent.pod_resources.start()
        log = (agent.root / "agent.log").open("wb")
        agent.proc = await asyncio.create_subprocess_exec(
            self.args.agent,
            "run",
            "--simulated",
            "--preset",
            "h100-8x-nvlink",
            "--node-name",
            agent.node,
            "--kubeconfig",
            str(self.h.kubeconfig),
            "--kubelet-root",
            str(agent.root / "kubelet"),
            "--cdi-root",
            str(agent.root / "cdi"),
            "--state-dir",
            str(agent.root / "state"),
            "--config",
            str(config),
            "--debug-addr",
            f"127.0.0.1:{agent.port}",
            stdout=log,
            stderr=log,
            stdin=asyncio.subprocess.DEVNULL,
        )

    async def settled(self, agent: Agent, within_s: float = 300.0) -> None:
        """Until the agent serves, has its Node and pods watched, and its slice published."""
        deadline = time.monotonic() + within_s
        while True:
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError):
                state = await agent.get(self.session, "/debug/state")
                agent.uuids = [d["uuid"] for d in sorted(state["devices"], key=lambda d: d["index"])]
                # an agent from before the watches (--agent of an older checkout) shows neither
                pods = state["orphans"].get("pods", {"synced": True})
                node = state["node"]["label_source"].get("watch", {"synced": state["node"]["label_source"]["synced"]})
                if pods["synced"] and node["synced"] and len(agent.uuids) == 8:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{agent.node} did not settle; see {agent.root / 'agent.log'}")
            await asyncio.sleep(1.0)

    def hold(self, agent: Agent) -> None:
        """The pods bound to the node hold device-plugin GPUs, as the kubelet's PodResources says."""
        assert agent.pod_resources is not None
        for j in range(self.args.holders):
            gpu = agent.uuids[4 + j]
            agent.pod_resources.allocate(NAMESPACE, f"{agent.node}-p{j}", "main", "nvidia.com/gpu", [gpu])

    async def stop(self) -> None:
        for agent in self.agents:
            if agent.proc is not None and agent.proc.returncode is None:
                agent.proc.send_signal(signal.SIGTERM)
        for agent in self.agents:
            if agent.proc is not None:
                try:
                    await asyncio.wait_for(agent.proc.wait(), 30)
                except TimeoutError:
                    agent.proc.kill()
            if agent.pod_resources is not None:
                await agent.pod_resources.stop()
        await self.session.close()

    async def agent_requests(self) -> Counter[tuple[str, str]]:
        total: Counter[tuple[str, str]] = Counter()
        for counts in await asyncio.gather(*(a.requests(self.session) for a in self.agents)):
            total.update(counts)
        return total

    def agents_cpu(self) -> float:
        return sum(cpu_seconds(a.pid) for a in self.agents)


# --- the run --------------------------------------------------------------------------------------


async def control_plane_cpu(h: Harness) -> dict[str, float]:
    return {name: h.cpu(name) for name in ("kube-apiserver", "etcd")}


async def steady(fleet: Fleet, seconds: float) -> dict[str, Any]:
    h = fleet.h
    agents0, server0 = await fleet.agent_requests(), await h.requests()
    cpu0, agents_cpu0, t0 = await control_plane_cpu(h), fleet.agents_cpu(), time.monotonic()
    await asyncio.sleep(seconds)
    agents1, server1 = await fleet.agent_requests(), await h.requests()
    cpu1, agents_cpu1, t1 = await control_plane_cpu(h), fleet.agents_cpu(), time.monotonic()
    minutes, n = (t1 - t0) / 60, len(fleet.agents)
    per_node = {f"{verb} {resource}": (agents1[(verb, resource)] - agents0[(verb, resource)]) / n / minutes
                for verb, resource in agents1}  # fmt: skip
    # the bench's own metric scrapes are not resource requests, and it sends nothing else meanwhile
    server = {f"{v} {r}": (server1[(v, r)] - server0[(v, r)]) / n / minutes for v, r in server1}
    return {
        "window_s": round(t1 - t0, 1),
        "per_node_per_min": {k: round(v, 3) for k, v in sorted(per_node.items()) if v},
        "total_per_node_per_min": round(sum(per_node.values()), 3),
        "server_per_node_per_min": {k: round(v, 3) for k, v in sorted(server.items()) if v},
        "server_total_per_node_per_min": round(sum(server.values()), 3),
        "cpu_s_per_s": {k: (cpu1[k] - cpu0[k]) / (t1 - t0) for k in cpu1},
        "agents_cpu_s_per_s": (agents_cpu1 - agents_cpu0) / (t1 - t0),
    }


async def restart(fleet: Fleet, after_s: float) -> dict[str, Any]:
    """Restart the API server; the agents' lists afterwards, per second, from its own counters."""
    h = fleet.h
    before = await fleet.agent_requests()
    await h.ctl("stop", "kube-apiserver")
    stopped = time.monotonic()
    await h.ctl("start", "kube-apiserver")
    ready = time.monotonic()
    samples: list[tuple[float, Counter[tuple[str, str]]]] = [(ready, Counter())]
    while time.monotonic() - ready < after_s:
        with contextlib.suppress(aiohttp.ClientError, OSError, RuntimeError, TimeoutError):
            counts = await h.requests()
            samples.append((time.monotonic(), counts))
        await asyncio.sleep(0.25)
    after = await fleet.agent_requests()
    lists = [sum(c[("LIST", r)] for r in WATCHED) for _, c in samples]
    # the first sample holds every list since the server began serving, before /readyz said so
    rates = [(lists[i] - lists[i - 1]) / (samples[i][0] - samples[i - 1][0]) for i in range(2, len(samples))]
    last = max((samples[i][0] for i in range(1, len(samples)) if lists[i] > lists[i - 1]), default=ready)
    n = len(fleet.agents)
    relists = {r: (after[("list", r)] - before[("list", r)]) / n for r in WATCHED}
    return {
        "down_s": round(ready - stopped, 1),
        "lists_seen_by_server": lists[-1],
        "lists_by_first_sample": lists[1] if len(lists) > 1 else 0,
        "peak_lists_per_s": round(max(rates, default=0.0), 2),
        "lists_per_node": {r: round(v, 2) for r, v in relists.items()},
        "last_list_after_ready_s": round(last - ready, 1),
        "samples": [[round(t - ready, 2), lists[i]] for i, (t, _) in enumerate(samples)],
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    h = Harness()
    if not await h.up():
        if not args.start:
            sys.exit(f"no API server answers at {h.server} (start etcd and kube-apiserver, or pass --start)")
        await h.ctl("start", "etcd")
        await h.ctl("start", "kube-apiserver")
    await h.bind_rbac()
    root = Path(tempfile.mkdtemp(prefix="fl-", dir="/tmp"))
    fleet = Fleet(h, args, root)
    report: dict[str, Any] = {"agents": args.agents, "holders_per_node": args.holders, "date": time.strftime("%F")}
    try:
        await fleet.clean()
        cpu0, t0 = await control_plane_cpu(h), time.monotonic()
        await asyncio.sleep(args.baseline_s)
        cpu1, t1 = await control_plane_cpu(h), time.monotonic()
        report["baseline_cpu_s_per_s"] = {k: (cpu1[k] - cpu0[k]) / (t1 - t0) for k in cpu1}
        await fleet.create_objects()
        started = time.monotonic()
        for agent in fleet.agents:
            await fleet.start(agent)
            await asyncio.sleep(args.stagger_s)
        await asyncio.gather(*(fleet.settled(a) for a in fleet.agents))
        report["start_s"] = round(time.monotonic() - started, 1)
        for agent in fleet.agents:
            fleet.hold(agent)
        print(f"{args.agents} agents up in {report['start_s']} s; settling {args.settle_s} s", flush=True)
        await asyncio.sleep(args.settle_s)
        report["rss_mib_mean"] = round(statistics.mean(rss_mib(a.pid) for a in fleet.agents), 1)
        print(f"steady state for {args.steady_s} s", flush=True)
        report["steady"] = await steady(fleet, args.steady_s)
        print("restarting the API server", flush=True)
        report["restart"] = await restart(fleet, args.after_s)
        states = await asyncio.gather(*(a.get(fleet.session, "/debug/state") for a in fleet.agents))
        report["orphans_after"] = sum(s["orphans"]["count"] for s in states)
        report["pods_fresh_after"] = sum(1 for s in states if s["orphans"].get("pods", {}).get("fresh"))
    finally:
        await fleet.stop()
        with contextlib.suppress(Exception):
            await fleet.clean()
        await h.close()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return report


def markdown(report: dict[str, Any]) -> str:
    n, s, r = report["agents"], report["steady"], report["restart"]
    base = report["baseline_cpu_s_per_s"]
    api_cpu = (s["cpu_s_per_s"]["kube-apiserver"] - base["kube-apiserver"]) / n
    etcd_cpu = (s["cpu_s_per_s"]["etcd"] - base["etcd"]) / n
    per_min = s["total_per_node_per_min"]
    lines = [
        f"{n} agents, {report['holders_per_node']} holder pods each, steady window {s['window_s']} s "
        f"({report['date']}); agents up in {report['start_s']} s, mean RSS {report['rss_mib_mean']} MiB",
        "",
        "| request (agents' own count) | per node per minute |",
        "| --- | --- |",
        *(f"| {k} | {v} |" for k, v in s["per_node_per_min"].items()),
        f"| **total** | **{per_min}** |",
        f"| total as the API server counted it | {s['server_total_per_node_per_min']} |",
        "",
        "| steady state | per node | 5,000 nodes |",
        "| --- | --- | --- |",
        f"| requests | {per_min:.2f}/min | {per_min * FLEET / 60:.0f}/s |",
        f"| kube-apiserver CPU | {api_cpu * 1000:.2f} mCPU | {api_cpu * FLEET:.2f} cores |",
        f"| etcd CPU | {etcd_cpu * 1000:.2f} mCPU | {etcd_cpu * FLEET:.2f} cores |",
        f"| agent CPU (its own node) | {s['agents_cpu_s_per_s'] / n * 1000:.1f} mCPU | |",
        "",
        f"API server restart: down {r['down_s']} s; afterwards the agents listed "
        f"{', '.join(f'{k} {v}' for k, v in r['lists_per_node'].items())} times per node, the last "
        f"{r['last_list_after_ready_s']} s after it was ready; peak {r['peak_lists_per_s']} lists/s "
        f"({r['peak_lists_per_s'] / n:.3f}/s per node, {r['peak_lists_per_s'] / n * FLEET:.0f}/s for 5,000 nodes "
        f"at the same spread). Orphans reported afterwards: {report['orphans_after']}; pod watches current: "
        f"{report['pods_fresh_after']}/{n}.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=40)
    parser.add_argument("--holders", type=int, default=4, help="pods holding a device-plugin GPU per node (≤ 4)")
    parser.add_argument("--baseline-s", type=float, default=60.0)
    parser.add_argument("--settle-s", type=float, default=60.0)
    parser.add_argument("--steady-s", type=float, default=600.0)
    parser.add_argument("--after-s", type=float, default=90.0)
    parser.add_argument("--stagger-s", type=float, default=0.5, help="between agent starts")
    parser.add_argument("--first-port", type=int, default=19600)
    parser.add_argument("--agent", default=str(REPO / ".venv" / "bin" / "gpu-agent"))
    parser.add_argument("--start", action="store_true", help="start etcd and kube-apiserver if none answers")
    parser.add_argument("--keep", action="store_true", help="keep the agents' directories and logs")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.holders = max(0, min(4, args.holders))
    report = asyncio.run(run(args))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    print(markdown(report))


if __name__ == "__main__":
    main()
