"""The agent as a real process: a pod that holds a GPU shows up as its holder on /metrics and in
``gpu-agent status``, and once the API server forgets the pod while the kubelet still lists it, as
an orphaned allocation with an Event on the Node."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.agentproc import AgentProcess, run_cli, wait_for
from tests.fake_apiserver import NODE, FakeApiServer, serving, write_kubeconfig
from tests.fake_podresources import FakePodResources
from tests.test_plugin_fakes import short_tmpdir

pytestmark = pytest.mark.integration

CONFIG = """
cdi: {enabled: false}
metrics: {utilization_interval_s: 0.1}
orphans: {interval_s: 0.1}
watchdog: {interval_s: 0.1}
"""


async def eventually(check: Callable[[], object], what: str, within_s: float = 15.0) -> None:
    """Wait for a condition that HTTP answers, off the loop (the fakes serve on it)."""
    await asyncio.to_thread(wait_for, check, within_s, what)


def samples(agent: AgentProcess, name: str) -> list[dict[str, str]]:
    status, text = agent.get("/metrics")
    assert status == 200
    return [
        {**s.labels, "value": str(s.value)}
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    ]


async def test_holders_orphans_and_status_of_a_running_agent() -> None:
    with short_tmpdir() as root:
        async with serving() as api:
            api.add_pod("ml", "train-0", uid="uid-train-0")
            config = root / "config.yaml"
            config.write_text(CONFIG)
            kubeconfig = write_kubeconfig(root, api.url)
            agent = AgentProcess(
                root, ["--simulated", "--config", str(config), "--kubeconfig", str(kubeconfig), "--node-name", NODE]
            )
            pods = FakePodResources(agent.kubelet_root / "pod-resources")
            await pods.start()
            try:
                await asyncio.to_thread(agent.wait_ready)
                await _scenario(agent, pods, api)
            finally:
                agent.kill()
                await pods.stop()


async def _scenario(agent: AgentProcess, pods: FakePodResources, api: FakeApiServer) -> None:
    state = await asyncio.to_thread(agent.state)
    gpu0 = state["devices"][0]["uuid"]
    pods.allocate("ml", "train-0", "main", "nvidia.com/gpu", [gpu0])

    def held() -> bool:
        return any(
            s["pod"] == "train-0" and s["pod_uid"] == "uid-train-0" and s["uuid"] == gpu0
            for s in samples(agent, "gpu_agent_gpu_holder_info")
        )

    await eventually(held, "the holder series with the pod's UID")
    (holder,) = (await asyncio.to_thread(agent.state))["devices"][0]["holders"]["device-plugin"]
    assert (holder["namespace"], holder["name"], holder["uid"], holder["detail"]) == (
        "ml",
        "train-0",
        "uid-train-0",
        "main",
    )
    result = await asyncio.to_thread(run_cli, "status", "--json", "--debug-addr", f"127.0.0.1:{agent.port}")
    assert result.returncode == 0, result.stderr
    rows = {g["uuid"]: g for g in json.loads(result.stdout)["gpus"]}
    assert rows[gpu0]["holders"] == ["ml/train-0"]
    assert rows[gpu0]["utilization_known"] is True and rows[gpu0]["gpu_utilization_percent"] >= 40  # held: busy
    assert all(r["holders"] == [] for u, r in rows.items() if u != gpu0)

    api.delete_pod("ml", "train-0")  # gone from the API server, still listed by the kubelet

    def orphaned() -> bool:
        return agent.state()["orphans"]["by_kind"]["device-plugin-pod"] == 1

    await eventually(orphaned, "the orphan")
    (orphan,) = agent.state()["orphans"]["orphans"]
    assert (orphan["namespace"], orphan["name"], orphan["gpus"]) == ("ml", "train-0", [gpu0])
    assert (
        samples(agent, "gpu_agent_orphans")
        and {s["kind"]: s["value"] for s in samples(agent, "gpu_agent_orphans")}["device-plugin-pod"] == "1.0"
    )
    await eventually(
        lambda: any(e["reason"] == "OrphanedAllocation" for e in api.events.values()), "the Event on the Node"
    )
    table = await asyncio.to_thread(run_cli, "status", "--debug-addr", f"127.0.0.1:{agent.port}")
    assert "orphaned allocations: 1" in table.stdout and "device-plugin-pod ml/train-0" in table.stdout
    assert all(len(line) <= 80 for line in table.stdout.splitlines())

    pods.release("ml", "train-0")  # the kubelet lets go at last
    await eventually(lambda: agent.state()["orphans"]["count"] == 0, "the orphan to resolve")
    await eventually(lambda: not samples(agent, "gpu_agent_gpu_holder_info"), "the holder series to go")
