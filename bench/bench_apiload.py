"""One real node's load on the API server: the agent with 8 GPUs held through claims, and the kubelet.

Runs against the real one-node cluster of the harness (API server, scheduler, controller manager,
kubelet, the agent with ``ownership: dra``, the project's DeviceClasses): creates ``--pods`` pods,
each holding one GPU through a claim made from a ResourceClaimTemplate, waits until they run,
lets ``--settle-s`` pass, then counts for ``--window-s``:

* the agent's requests by verb and resource, from its own
  ``gpu_agent_kube_request_duration_seconds_count`` (``--agent-url``);
* the kubelet's requests by method, from its ``rest_client_requests_total`` (``--kubelet-url``),
  the load every node puts on the API server anyway.

Then, with ``--orphan``, how long the agent takes to report an orphaned allocation: the kubelet is
stopped (so nothing unprepares), one pod is deleted at once, and the time until the agent's
``/debug/state`` lists the orphan is measured; the kubelet is started again and the orphan
resolves. Finally the pods and the template are deleted.

The harness comes from the environment, as its scripts take it: ``PEERS`` (``etc/tokens.csv``,
``etc/pki/ca.crt``), ``PEERS_SCRIPTS`` (``ctl.sh``), ``APISERVER`` (default
``https://127.0.0.1:36443``).

    PEERS=... PEERS_SCRIPTS=... python bench/bench_apiload.py [--pods 8] [--orphan] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_fleet import Harness

NAMESPACE = "default"
TEMPLATE = "bench-one-gpu"
CLASS = "gpu.gpu-node-agent.nvidia.com"


def counts(text: str, family_name: str, labels: tuple[str, ...], suffix: str) -> Counter[str]:
    out: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        if family.name != family_name:
            continue
        for sample in family.samples:
            if sample.name.endswith(suffix):
                out[" ".join(sample.labels.get(label, "") for label in labels)] += int(sample.value)
    return out


async def agent_counts(h: Harness, url: str) -> Counter[str]:
    text = await h.text(url + "/metrics")
    return counts(text, "gpu_agent_kube_request_duration_seconds", ("verb", "resource"), "_count")


async def kubelet_counts(h: Harness, url: str) -> Counter[str]:
    text = await h.text(url + "/metrics", token=True)
    return counts(text, "rest_client_requests", ("method",), "_total")


def pod(name: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {
            "hostNetwork": True,
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 1,
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": TEMPLATE}],
            "containers": [
                {
                    "name": "main",
                    "image": "localhost/peers/busybox:1",
                    "imagePullPolicy": "Never",
                    "command": ["sleep", "100000"],
                    "resources": {"claims": [{"name": "gpu"}]},
                }
            ],
        },
    }


async def until(check: Any, within_s: float, what: str) -> float:
    start = time.monotonic()
    while not await check():
        if time.monotonic() - start > within_s:
            raise RuntimeError(f"timed out waiting for {what}")
        await asyncio.sleep(0.2)
    return time.monotonic() - start


async def run(args: argparse.Namespace) -> dict[str, Any]:
    h = Harness()
    names = [f"bench-gpu-{i}" for i in range(args.pods)]
    report: dict[str, Any] = {"date": time.strftime("%F"), "pods": args.pods}
    try:
        template = {
            "metadata": {"name": TEMPLATE},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": CLASS}}]}}},
        }
        await h.api(
            "POST", f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaimtemplates", template, ok=(201, 409)
        )
        for name in names:
            await h.api("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", pod(name))

        async def running() -> bool:
            items = (await h.api("GET", f"/api/v1/namespaces/{NAMESPACE}/pods"))["items"]
            phases = {p["metadata"]["name"]: p.get("status", {}).get("phase") for p in items}
            return all(phases.get(n) == "Running" for n in names)

        report["running_after_s"] = round(await until(running, 300, "the pods to run"), 1)
        await asyncio.sleep(args.settle_s)
        agent0, kubelet0, t0 = (
            await agent_counts(h, args.agent_url),
            await kubelet_counts(h, args.kubelet_url),
            time.monotonic(),
        )
        await asyncio.sleep(args.window_s)
        agent1, kubelet1, t1 = (
            await agent_counts(h, args.agent_url),
            await kubelet_counts(h, args.kubelet_url),
            time.monotonic(),
        )
        minutes = (t1 - t0) / 60
        report["window_s"] = round(t1 - t0, 1)
        agent, kubelet = agent1 - agent0, kubelet1 - kubelet0
        report["agent_per_min"] = {k: round(v / minutes, 2) for k, v in agent.items()}
        report["agent_total_per_min"] = round(sum(agent.values()) / minutes, 2)
        report["kubelet_per_min"] = {k: round(v / minutes, 2) for k, v in kubelet.items()}
        report["kubelet_total_per_min"] = round(sum(kubelet.values()) / minutes, 2)
        if args.orphan:
            report["orphan"] = await orphan(h, args, names[0])
    finally:
        pods = f"/api/v1/namespaces/{NAMESPACE}/pods"
        for name in names:
            await h.api("DELETE", f"{pods}/{name}?gracePeriodSeconds=0", ok=(200, 404))
        templates = f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaimtemplates"
        await h.api("DELETE", f"{templates}/{TEMPLATE}", ok=(200, 404))
        await h.close()
    return report


async def orphan(h: Harness, args: argparse.Namespace, name: str) -> dict[str, Any]:
    """The kubelet stops (nothing unprepares), a pod is deleted: how long until the agent says so."""

    async def orphans() -> list[dict[str, Any]]:
        state = json.loads(await h.text(args.agent_url + "/debug/state"))
        return list(state["orphans"]["orphans"])

    await h.ctl("stop", "kubelet")
    try:
        deleted = time.monotonic()
        await h.api("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}?gracePeriodSeconds=0")

        async def reported() -> bool:
            return any(o["kind"] == "dra-claim" for o in await orphans())

        found = await until(reported, 180, "the orphan")
        found_at = time.monotonic()
        (first,) = [o for o in await orphans() if o["kind"] == "dra-claim"]
    finally:
        await h.ctl("start", "kubelet")

    async def resolved() -> bool:
        return not any(o["kind"] == "dra-claim" for o in await orphans())

    gone = await until(resolved, 180, "the orphan to resolve")
    return {
        "reported_after_s": round(found, 1),
        "reason": first["reason"],
        "resolved_after_kubelet_start_s": round(gone, 1),
        "reported_to_resolved_s": round(time.monotonic() - found_at, 1),
        "deleted_to_resolved_s": round(time.monotonic() - deleted, 1),
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"{report['pods']} pods holding a GPU each through a claim, window {report['window_s']} s ({report['date']})",
        "",
        "| agent request | per minute |",
        "| --- | --- |",
        *(f"| {k} | {v} |" for k, v in sorted(report["agent_per_min"].items())),
        f"| **total** | **{report['agent_total_per_min']}** |",
        "",
        "| kubelet request | per minute |",
        "| --- | --- |",
        *(f"| {k} | {v} |" for k, v in sorted(report["kubelet_per_min"].items())),
        f"| **total** | **{report['kubelet_total_per_min']}** |",
    ]
    if "orphan" in report:
        o = report["orphan"]
        lines += ["", f"Orphan reported {o['reported_after_s']} s after the pod was deleted: {o['reason']}"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=8)
    parser.add_argument("--settle-s", type=float, default=35.0)
    parser.add_argument("--window-s", type=float, default=120.0)
    parser.add_argument("--agent-url", default="http://127.0.0.1:19500")
    parser.add_argument("--kubelet-url", default="https://127.0.0.1:20250")
    parser.add_argument("--orphan", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report = asyncio.run(run(args))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    print(markdown(report))


if __name__ == "__main__":
    main()
