"""Agent restarts as the kubelet sees them: the first ListAndWatch answer after a start carries every
GPU the device plugin owns (an empty one tells the kubelet "no GPUs here", and it fails every pod
it admits until the next answer), and a restart in the middle of a drain resumes it.

The agent runs as a real process against the grpcio "kubelet" and PodResources fakes, in a
temporary root whose state directory survives the restart, as a DaemonSet's hostPath does.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agent.core.ownership.record import RECORD_FILE
from tests.agentproc import AgentProcess
from tests.fake_apiserver import NODE, FakeApiServer, write_kubeconfig
from tests.fake_kubelet import PluginClient
from tests.fake_podresources import FakePodResources
from tests.test_plugin_fakes import FakeKubelet, short_tmpdir, wait_for

pytestmark = pytest.mark.integration

GPU = "nvidia.com/gpu"

CONFIG = """
cdi: {enabled: false}
plugin: {device_list_strategy: [envvar]}
ownership:
  default: device-plugin
  nodes:
    - match: {names: [test-node]}
      gpus: %s
"""


@dataclass
class Node:
    """A temporary node root with a kubelet; its state directory survives agent restarts."""

    root: Path
    kubelet: FakeKubelet
    agents: list[AgentProcess] = field(default_factory=list)

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    def start(self) -> AgentProcess:
        self.agents.append(AgentProcess(self.root, ["--simulated", "--config", str(self.config)]))
        return self.agents[-1]

    async def restart(self) -> tuple[AgentProcess, list[int]]:
        """Start an agent; the device counts of the first ListAndWatch messages the kubelet got from it."""
        current = self.kubelet.current
        seen = {id(c) for c in current.all_clients} if current is not None else set()
        agent = self.start()
        await wait_for(lambda: newest_client(self.kubelet, lambda c: id(c) not in seen), what="a new stream")
        client = newest_client(self.kubelet, lambda c: id(c) not in seen)
        assert client is not None
        return agent, list(client.counts)


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    with short_tmpdir() as root:
        kubelet = FakeKubelet(root / "kubelet" / "device-plugins")
        await kubelet.start()
        node = Node(root, kubelet)
        try:
            yield node
        finally:
            for agent in node.agents:
                agent.kill()
            await kubelet.stop()


def newest_client(kubelet: FakeKubelet, after: Callable[[PluginClient], bool] = lambda c: True) -> PluginClient | None:
    process = kubelet.current
    if process is None:
        return None
    with process.lock:
        clients = [c for c in process.all_clients if c.resource == GPU and c.messages and after(c)]
    return clients[-1] if clients else None


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
async def test_the_first_answer_after_a_restart_lists_every_gpu(node: Node, how: str) -> None:
    node.config.write_text(CONFIG % '{"7": dra}')
    agent = node.start()
    # a fresh node has no record, and no PodResources answer: the first answer waits for the grants
    await asyncio.to_thread(agent.wait_ready)
    first = newest_client(node.kubelet)
    assert first is not None and first.counts[0] == 7, first and first.counts
    record = agent.state_dir / RECORD_FILE
    await wait_for(lambda: record.exists() and len(json.loads(record.read_text())["device_plugin"]) == 7)
    if how == "SIGKILL":
        agent.kill()
    else:
        await asyncio.to_thread(agent.terminate)
    kubelet = node.kubelet
    await wait_for(lambda: kubelet.current is not None and kubelet.current.allocatable(GPU) == 0, what="0")
    started = time.monotonic()
    agent, counts = await node.restart()
    assert counts[0] == 7, f"first ListAndWatch after a {how} restart carried {counts[0]} devices"
    await wait_for(lambda: kubelet.current is not None and kubelet.current.allocatable(GPU) == 7, what="7")
    print(f"{how}: process start -> kubelet has 7 devices {time.monotonic() - started:.2f} s")


async def test_a_restart_in_the_middle_of_a_drain_resumes_it_without_offering_the_gpu(node: Node) -> None:
    node.config.write_text(CONFIG % "{}")
    agent = node.start()
    pods = FakePodResources(agent.kubelet_root / "pod-resources")
    await pods.start()
    try:
        await asyncio.to_thread(agent.wait_ready)
        gpu7 = next(d["uuid"] for d in agent.state()["devices"] if d["index"] == 7)
        pods.allocate("ml", "trainer", "main", GPU, [gpu7])
        node.config.write_text(CONFIG % '{"7": dra}')
        draining = "draining:device-plugin->dra"
        await wait_for(lambda: agent.state()["devices"][7]["owner"] == draining, what="the drain")
        await wait_for(lambda: (c := newest_client(node.kubelet)) is not None and c.counts[-1] == 7, what="7 listed")
        agent.kill()
        agent, counts = await node.restart()
        assert counts[0] == 7, counts
        await asyncio.to_thread(agent.wait_port)
        await wait_for(lambda: agent.state()["devices"][7]["owner"] == draining, what="the drain resumed")
        client = newest_client(node.kubelet)
        assert client is not None and gpu7 not in {d.ID for d in client.devices}
        pods.release("ml", "trainer")
        await wait_for(lambda: agent.state()["devices"][7]["owner"] == "dra", what="the drain to complete")
    finally:
        await pods.stop()


async def test_a_restart_offers_the_gpus_before_anyone_answered(node: Node) -> None:
    """After a restart nothing has answered yet: no PodResources, and an API server that hangs (so
    an earlier run's slices cannot be listed). The GPUs the record and the kubelet's checkpoint
    both give the device plugin are in the first answer all the same."""
    api = await FakeApiServer().start()
    try:
        kubeconfig = write_kubeconfig(node.root, api.url, {"token": "t"})
        node.config.write_text((CONFIG % '{"7": dra}').replace("test-node", NODE))
        args = ["--simulated", "--config", str(node.config), "--kubeconfig", str(kubeconfig), "--node-name", NODE]
        node.agents.append(AgentProcess(node.root, args))
        agent = node.agents[-1]
        await asyncio.to_thread(agent.wait_ready)
        record = agent.state_dir / RECORD_FILE
        await wait_for(lambda: record.exists() and len(json.loads(record.read_text())["device_plugin"]) == 7)
        # and the kubelet has them in its checkpoint, the second witness (written with each message)
        await wait_for(lambda: (c := newest_client(node.kubelet)) is not None and c.counts[-1] == 7, what="7 listed")
        agent.kill()
        api.hang(times=None)
        current = node.kubelet.current
        assert current is not None
        seen = {id(c) for c in current.all_clients}
        node.agents.append(AgentProcess(node.root, args))
        await wait_for(lambda: newest_client(node.kubelet, lambda c: id(c) not in seen), what="a new stream")
        client = newest_client(node.kubelet, lambda c: id(c) not in seen)
        assert client is not None and client.counts[0] == 7, client and client.counts
        assert any('"complete": true' in line for line in node.agents[-1].lines if "first grants" in line)
    finally:
        api.clear()
        await api.stop()
