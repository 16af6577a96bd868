"""The whole agent as a DRA driver and a device plugin at once: a real process, a grpcio kubelet
(device-plugin registration, PodResources, the plugin watcher's GetInfo/Notify and
NodePrepareResources), and the fake API server for slices, claims and the Node.

A node split between the mechanisms serves both from one process, and a GPU is never in
ListAndWatch and in a slice at once; prepared claims survive a SIGKILL in the middle of a batch;
slices someone deletes come back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests._grpcio import deviceplugin_v1beta1_pb2 as dp_pb
from tests._grpcio import deviceplugin_v1beta1_pb2_grpc as dp_grpc
from tests._grpcio import dra_v1_pb2 as dra_pb
from tests._grpcio import dra_v1_pb2_grpc as dra_grpc
from tests._grpcio import pluginregistration_v1_pb2 as reg_pb
from tests._grpcio import pluginregistration_v1_pb2_grpc as reg_grpc
from tests.agentproc import AgentProcess
from tests.agentproc import wait_for as sync_wait_for
from tests.fake_apiserver import NODE, FakeApiServer, write_kubeconfig
from tests.fake_podresources import FakePodResources
from tests.test_plugin_fakes import FakeKubelet, short_tmpdir

pytestmark = pytest.mark.integration

DRIVER = "gpu-node-agent.nvidia.com"
SPLIT = """
cdi: {reconcile_interval_s: 0.5}
health: {check_interval_s: 0.2}
ownership:
  default: device-plugin
  nodes:
    - match: {names: [NODE]}
      gpus: {"0": dra, "1": dra, "2": dra, "3": dra}
""".replace("NODE", NODE)


async def eventually(predicate: Callable[[], object], what: str, within_s: float = 15.0) -> None:
    await asyncio.to_thread(sync_wait_for, predicate, within_s, what)


@dataclass
class Node:
    root: Path
    args: list[str]
    agent: AgentProcess
    api: FakeApiServer
    kubelet: FakeKubelet
    pods: FakePodResources

    @property
    def registry(self) -> Path:
        return self.agent.kubelet_root / "plugins_registry" / f"{DRIVER}-reg.sock"

    async def register_dra(self) -> str:
        """What the kubelet's plugin watcher does: GetInfo (retried, like its reconciler, while the
        socket is missing or a dead process's), then NotifyRegistrationStatus(true)."""
        async with asyncio.timeout(15):
            while True:
                try:
                    async with grpc.aio.insecure_channel(f"unix://{self.registry}") as channel:
                        info = await reg_grpc.RegistrationStub(channel).GetInfo(reg_pb.InfoRequest(), timeout=1)
                    break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.05)
        async with grpc.aio.insecure_channel(f"unix://{self.registry}") as channel:
            stub = reg_grpc.RegistrationStub(channel)
            assert info.type == "DRAPlugin" and info.name == DRIVER
            assert list(info.supported_versions)[:2] == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
            await stub.NotifyRegistrationStatus(reg_pb.RegistrationStatus(plugin_registered=True), timeout=5)
        return str(info.endpoint)

    def claim(self, name: str, device: str, uid: str) -> dra_pb.Claim:
        self.api.put_claim(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"namespace": "ml", "name": name, "uid": uid},
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu"}}]}},
                "status": {
                    "allocation": {
                        "devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}]}
                    },
                    "reservedFor": [{"resource": "pods", "name": f"pod-{name}", "uid": f"pod-{uid}"}],
                },
            }
        )
        return dra_pb.Claim(namespace="ml", name=name, uid=uid)

    def published(self) -> set[str]:
        """Device names in this node's slices of our driver."""
        return {d["name"] for s in self.api.slices_of() if s["spec"]["driver"] == DRIVER for d in s["spec"]["devices"]}

    def published_uuids(self) -> set[str]:
        return {
            str(d["attributes"]["uuid"]["string"])
            for s in self.api.slices_of()
            if s["spec"]["driver"] == DRIVER
            for d in s["spec"]["devices"]
        }


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    async with running_node(SPLIT) as found:
        yield found


@contextlib.asynccontextmanager
async def running_node(config_text: str) -> AsyncIterator[Node]:
    """The agent process on a simulated node with ``config_text``, the fake API server and kubelet."""
    api = await FakeApiServer().start()
    with short_tmpdir() as root:
        config = root / "config.yaml"
        config.write_text(config_text)
        kubeconfig = write_kubeconfig(root, api.url, {"token": "t"})
        kubelet = FakeKubelet(root / "kubelet" / "device-plugins")
        await kubelet.start()
        pods = FakePodResources(root / "kubelet" / "pod-resources")
        await pods.start()
        args = ["--simulated", "--config", str(config), "--kubeconfig", str(kubeconfig), "--node-name", NODE]
        node = Node(root, args, AgentProcess(root, args), api, kubelet, pods)
        try:
            yield node
        finally:
            node.agent.kill()
            await pods.stop()
            await kubelet.stop()
            await api.stop()


async def list_and_watch(node: Node) -> tuple[grpc.aio.Channel, Any, asyncio.Queue[set[str]]]:
    """Our own ListAndWatch stream on the plugin socket: each message's device IDs, in order."""
    socket = node.agent.kubelet_root / "device-plugins" / "gpu-node-agent-nvidia-gpu.sock"
    await eventually(socket.exists, "the device plugin socket")
    channel = grpc.aio.insecure_channel(f"unix://{socket}")
    call = dp_grpc.DevicePluginStub(channel).ListAndWatch(dp_pb.Empty())
    messages: asyncio.Queue[set[str]] = asyncio.Queue()

    async def pump() -> None:
        async for message in call:
            await messages.put({d.ID for d in message.devices})

    task = asyncio.create_task(pump())
    return channel, task, messages


async def test_a_split_node_serves_both_mechanisms_and_never_one_gpu_twice(node: Node) -> None:
    await asyncio.to_thread(node.agent.wait_port)
    endpoint = await node.register_dra()
    await eventually(lambda: node.published() == {"gpu-0", "gpu-1", "gpu-2", "gpu-3"}, "the DRA GPUs in a slice")
    state = node.agent.state()
    uuids = [d["uuid"] for d in sorted(state["devices"], key=lambda d: d["index"])]
    await eventually(lambda: node.agent.get("/readyz")[0] == 200, "ready")
    channel, pump, messages = await list_and_watch(node)
    try:

        async def first_listing() -> set[str]:  # the plugin registers before it is granted GPUs
            while not (ids := await messages.get()):
                pass
            return ids

        listed = await asyncio.wait_for(first_listing(), 15)
        assert listed == set(uuids[4:])  # the device plugin lists exactly the other four
        assert not listed & node.published_uuids()

        # a claim on a DRA GPU is prepared through the real socket; its CDI spec is on disk
        ref = node.claim("c0", "gpu-1", "uid-c0")
        async with grpc.aio.insecure_channel(f"unix://{endpoint}") as dra:
            answer = await dra_grpc.DRAPluginStub(dra).NodePrepareResources(
                dra_pb.NodePrepareResourcesRequest(claims=[ref]), timeout=45
            )
        entry = answer.claims["uid-c0"]
        assert entry.error == "" and [d.device_name for d in entry.devices] == ["gpu-1"]
        kind, _, name = entry.devices[0].cdi_device_ids[0].partition("=")
        specs = [json.loads(p.read_text()) for p in node.agent.cdi_root.glob("*.json")]
        assert any(s["kind"] == kind and any(d["name"] == name for d in s["devices"]) for s in specs)
        holders = node.agent.state()["devices"][1]["holders"]["dra"]
        assert [(h["namespace"], h["name"], h["uid"]) for h in holders] == [("ml", "c0", "uid-c0")]

        # slices the kubelet (or anyone) deletes come back
        node.api.delete_slices(node=NODE)
        await eventually(lambda: node.published() == {"gpu-0", "gpu-1", "gpu-2", "gpu-3"}, "re-published slices")
    finally:
        pump.cancel()
        await channel.close()


async def test_prepared_claims_survive_a_sigkill_in_the_middle_of_a_batch(node: Node) -> None:
    await asyncio.to_thread(node.agent.wait_port)
    endpoint = await node.register_dra()
    refs = [node.claim(f"c{i}", f"gpu-{i}", f"uid-c{i}") for i in range(4)]
    node.api.delay_s = 0.3  # every API answer is slow: the batch is still reading claims when killed
    async with grpc.aio.insecure_channel(f"unix://{endpoint}") as dra:
        call = dra_grpc.DRAPluginStub(dra).NodePrepareResources(
            dra_pb.NodePrepareResourcesRequest(claims=refs), timeout=45
        )
        await eventually(lambda: any("/resourceclaims/" in r.path for r in node.api.requests), "a claim read")
        node.agent.proc.send_signal(signal.SIGKILL)
        with pytest.raises(grpc.aio.AioRpcError):
            await call
    node.agent.proc.wait(timeout=5)
    node.api.delay_s = 0.0

    # the same directories, a new process: the kubelet retries the whole batch
    node.agent.kill()
    node.agent = AgentProcess(node.root, node.args)
    await asyncio.to_thread(node.agent.wait_port)
    endpoint = await node.register_dra()

    def dra_granted() -> bool:  # derived afresh on start: confirmed idle through PodResources first
        return [d["owner"] for d in node.agent.state()["devices"][:4]] == ["dra"] * 4

    await eventually(dra_granted, "the DRA grants after the restart")
    async with grpc.aio.insecure_channel(f"unix://{endpoint}") as dra:
        first = await dra_grpc.DRAPluginStub(dra).NodePrepareResources(
            dra_pb.NodePrepareResourcesRequest(claims=refs), timeout=45
        )
        again = await dra_grpc.DRAPluginStub(dra).NodePrepareResources(
            dra_pb.NodePrepareResourcesRequest(claims=refs), timeout=45
        )
    assert set(first.claims) == {r.uid for r in refs}
    assert all(first.claims[r.uid].error == "" for r in refs), {u: c.error for u, c in first.claims.items()}
    assert first == again  # a repeated prepare is the identical answer
    claim_specs = sorted(p.name for p in node.agent.cdi_root.glob("*claim_*.json"))
    assert claim_specs == sorted(f"k8s.gpu-node-agent.nvidia.com-claim_uid-c{i}.json" for i in range(4))
    checkpoint = json.loads((node.agent.state_dir / "checkpoint.json").read_text())
    assert checkpoint["kind"] == "GpuNodeAgentDraCheckpoint"
    assert sorted(c["uid"] for c in checkpoint["data"]["claims"]) == [f"uid-c{i}" for i in range(4)]


async def test_a_handover_waits_for_the_pods_and_the_claims_then_moves(node: Node) -> None:
    """GPU 4 held by a pod through the device plugin moves to DRA only once the pod is gone; GPU 5
    (idle) moves at once; GPU 0 held by a prepared claim moves to the device plugin only after
    Unprepare."""
    await asyncio.to_thread(node.agent.wait_port)
    endpoint = await node.register_dra()
    await eventually(lambda: node.published() == {"gpu-0", "gpu-1", "gpu-2", "gpu-3"}, "the DRA GPUs in a slice")
    uuids = [d["uuid"] for d in sorted(node.agent.state()["devices"], key=lambda d: d["index"])]
    node.pods.allocate("ml", "train", "main", "nvidia.com/gpu", [uuids[4]])
    ref = node.claim("c0", "gpu-0", "uid-c0")
    async with grpc.aio.insecure_channel(f"unix://{endpoint}") as dra:
        stub = dra_grpc.DRAPluginStub(dra)
        answer = await stub.NodePrepareResources(dra_pb.NodePrepareResourcesRequest(claims=[ref]), timeout=45)
        assert answer.claims["uid-c0"].error == ""
        channel, pump, messages = await list_and_watch(node)
        try:
            await eventually(lambda: node.agent.state()["devices"][4]["holders"].get("device-plugin"), "the holder")
            config = node.root / "config.yaml"
            config.write_text(SPLIT.replace('"3": dra}', '"3": dra, "4": dra, "5": dra, "0": device-plugin}'))

            def owners() -> list[str]:
                return [d["owner"] for d in sorted(node.agent.state()["devices"], key=lambda d: d["index"])]

            await eventually(lambda: owners()[5] == "dra", "the idle GPU to move")
            assert owners()[4] == "draining:device-plugin->dra" and owners()[0] == "draining:dra->device-plugin"
            drain = node.agent.state()["devices"][4]["draining"]
            assert "in use through device-plugin by pod ml/train" in drain["waiting_for"]
            await eventually(lambda: "gpu-5" in node.published(), "GPU 5 in the slice")
            # while the pod runs, GPU 4 is neither listed by the device plugin nor published
            latest = await messages.get()  # at least the stream's first message is there
            while not messages.empty():
                latest = messages.get_nowait()
            assert uuids[4] not in latest and uuids[5] not in latest
            assert "gpu-4" not in node.published() and "gpu-0" not in node.published()

            node.pods.release("ml", "train")  # the pod ends
            await eventually(lambda: "gpu-4" in node.published(), "GPU 4 in the slice after its pod left")
            assert owners()[0] == "draining:dra->device-plugin"  # the claim still holds GPU 0
            await stub.NodeUnprepareResources(dra_pb.NodeUnprepareResourcesRequest(claims=[ref]), timeout=45)
            await eventually(lambda: owners()[0] == "device-plugin", "GPU 0 back to the device plugin")
            await eventually(lambda: "gpu-0" not in node.published(), "GPU 0 out of the slice")

            async def listed_again() -> set[str]:
                while True:
                    ids = await messages.get()
                    if uuids[0] in ids:
                        return ids

            ids = await asyncio.wait_for(listed_again(), 15)
            assert not ids & node.published_uuids()
        finally:
            pump.cancel()
            await channel.close()


async def test_a_gpu_leaves_the_device_plugin_only_once_the_node_no_longer_counts_it(node: Node) -> None:
    """GPU 5 moves to DRA. The kubelet (its device manager) keeps it until the Node in the API no
    longer counts it, and the kubelet's own status write in between, computed while GPU 5 was still
    listed, does not let it go early: at no moment does the kubelet lack a GPU the scheduler still
    counts on. (A real kubelet writes the Node only every 10 s: without the agent's patch the
    scheduler would bind pods to GPU 5 for that long, and the kubelet would refuse them.)"""
    await asyncio.to_thread(node.agent.wait_port)
    await node.register_dra()
    uuids = [d["uuid"] for d in sorted(node.agent.state()["devices"], key=lambda d: d["index"])]

    def kubelet_lists() -> set[str]:
        process = node.kubelet.current
        client = process.clients.get("nvidia.com/gpu") if process is not None else None
        return {d.ID for d in client.devices} if client is not None else set()

    def node_counts() -> int:
        return int(node.api.nodes[NODE]["status"]["allocatable"]["nvidia.com/gpu"])

    await eventually(lambda: kubelet_lists() == set(uuids[4:]), "the device plugin's four GPUs at the kubelet")
    node.api.set_allocatable({"nvidia.com/gpu": "4", "cpu": "8"})  # the kubelet's next status sync
    samples: list[tuple[int, bool]] = []
    reverted = False

    async def sample() -> None:
        nonlocal reverted
        while True:
            samples.append((node_counts(), uuids[5] in kubelet_lists()))
            if not reverted and node_counts() == 3:
                node.api.set_allocatable({"nvidia.com/gpu": "4", "cpu": "8"})  # a status sync from before
                reverted = True
            await asyncio.sleep(0.002)

    sampler = asyncio.create_task(sample())
    try:
        config = node.root / "config.yaml"
        config.write_text(SPLIT.replace('"3": dra}', '"3": dra, "5": dra}'))
        await eventually(lambda: uuids[5] not in kubelet_lists(), "GPU 5 gone from ListAndWatch")
        await eventually(lambda: uuids[5] in node.published_uuids(), "GPU 5 in a slice")
    finally:
        sampler.cancel()
    assert reverted and node.api.node_status_patches, "the Node was lowered by the agent, twice"
    assert all(count <= 3 for count, listed in samples if not listed), "a GPU the kubelet lacks was still counted"
    assert (4, True) in samples and (3, True) in samples  # listed while the Node was lowered: closing
    assert node.api.nodes[NODE]["status"]["allocatable"]["cpu"] == "8"  # nothing else touched
    patched = [p["status"]["allocatable"] for p in node.api.node_status_patches]
    assert patched == [{"nvidia.com/gpu": "3"}, {"nvidia.com/gpu": "3"}]


async def test_a_claim_allocated_from_the_old_slice_is_prepared_and_held_not_stranded(node: Node) -> None:
    """Seen on a real cluster: GPU 0 moves from DRA to the device plugin while the scheduler
    allocates a claim from the slice that still lists it; the kubelet asks for it only later. The
    agent finds the claim through the node's pods, keeps GPU 0 draining for it, and prepares it."""
    await asyncio.to_thread(node.agent.wait_port)
    endpoint = await node.register_dra()
    await eventually(lambda: node.published() == {"gpu-0", "gpu-1", "gpu-2", "gpu-3"}, "the DRA GPUs in a slice")
    ref = node.claim("late", "gpu-0", "uid-late")  # allocated from the slice with gpu-0 in it
    pod = node.api.add_pod("ml", "pod-late", uid="pod-uid-late")
    pod["status"]["resourceClaimStatuses"] = [{"name": "gpu", "resourceClaimName": "late"}]
    config = node.root / "config.yaml"
    config.write_text(SPLIT.replace('"0": dra, ', ""))  # GPU 0 to the device plugin
    await eventually(lambda: "gpu-0" not in node.published(), "GPU 0 out of the slice")

    def gpu0() -> dict[str, Any]:
        return dict(node.agent.state()["devices"][0])

    await eventually(lambda: "claim ml/late" in (gpu0()["draining"] or {}).get("waiting_for", ""), "held by it")
    async with grpc.aio.insecure_channel(f"unix://{endpoint}") as dra:
        stub = dra_grpc.DRAPluginStub(dra)
        answer = await stub.NodePrepareResources(dra_pb.NodePrepareResourcesRequest(claims=[ref]), timeout=45)
        assert answer.claims["uid-late"].error == "", answer.claims["uid-late"].error
        assert gpu0()["owner"] == "draining:dra->device-plugin"
        await stub.NodeUnprepareResources(dra_pb.NodeUnprepareResourcesRequest(claims=[ref]), timeout=45)
    node.api.delete_pod("ml", "pod-late")
    await eventually(lambda: gpu0()["owner"] == "device-plugin", "GPU 0 with the device plugin")
