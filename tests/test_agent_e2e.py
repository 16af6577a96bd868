"""The whole agent, as a real process, against a grpcio "kubelet" and real HTTP.

This is the path users take: `gpu-agent run --simulated` with a config file, a kubelet
registration socket in the kubelet root, and health flips through the debug endpoint.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest

from tests._grpcio import deviceplugin_v1beta1_pb2 as pb
from tests._grpcio import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from tests.agentproc import AgentProcess
from tests.agentproc import wait_for as sync_wait_for
from tests.fake_podresources import FakePodResources
from tests.test_plugin_fakes import FakeKubelet, short_tmpdir, wait_for

pytestmark = pytest.mark.integration

GPU = "nvidia.com/gpu"

CONFIG = """
cdi: {enabled: false}
health: {check_interval_s: 0.2}
plugin: {device_list_strategy: [envvar]}
ownership:
  default: device-plugin
  nodes:
    - match: {names: [test-node]}
      gpus: {"7": dra}
"""


class Stream:
    """An open ListAndWatch stream whose messages land in a queue."""

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:  # type: ignore[type-arg]
        self.call = call
        self.messages: asyncio.Queue[pb.ListAndWatchResponse] = asyncio.Queue()
        self.task = asyncio.create_task(self._pump())

    async def _pump(self) -> None:
        async for message in self.call:
            await self.messages.put(message)

    async def next_matching(self, predicate: object, within_s: float = 10.0) -> pb.ListAndWatchResponse:
        async def find() -> pb.ListAndWatchResponse:
            while True:
                message = await self.messages.get()
                if predicate(message):  # type: ignore[operator]
                    return message

        return await asyncio.wait_for(find(), within_s)


@pytest.fixture
async def running() -> AsyncIterator[tuple[AgentProcess, FakeKubelet, Path]]:
    with short_tmpdir() as root:
        kubelet = FakeKubelet(root / "kubelet" / "device-plugins")
        await kubelet.start()
        config = root / "config.yaml"
        config.write_text(CONFIG)
        agent = AgentProcess(root, ["--simulated", "--config", str(config)])
        try:
            await asyncio.to_thread(agent.wait_ready)
            yield agent, kubelet, config
        finally:
            agent.kill()
            await kubelet.stop()


def health_of(message: pb.ListAndWatchResponse) -> dict[str, str]:
    return {d.ID: d.health for d in message.devices}


async def test_agent_serves_the_kubelet_end_to_end(running: tuple[AgentProcess, FakeKubelet, Path]) -> None:
    agent, kubelet, config = running
    state = agent.state()
    uuids = [d["uuid"] for d in state["devices"]]

    (call,) = kubelet.calls_for("nvidia.com/gpu")
    assert call.request.endpoint == "gpu-node-agent-nvidia-gpu.sock" and not call.error
    assert call.options is not None and call.options.get_preferred_allocation_available
    assert state["device_plugin"]["ready"] is True

    socket = kubelet.plugin_dir / "gpu-node-agent-nvidia-gpu.sock"
    async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
        stub = pb_grpc.DevicePluginStub(channel)
        stream = Stream(stub.ListAndWatch(pb.Empty()))
        first = await stream.next_matching(lambda m: True)
        assert set(health_of(first)) == set(uuids[:7])  # GPU 7 belongs to DRA
        assert set(health_of(first).values()) == {"Healthy"}
        assert {d.topology.nodes[0].ID for d in first.devices} == {0, 1}

        # a health flip through the debug endpoint reaches the open stream
        status, _ = await asyncio.to_thread(
            agent.post, "/debug/simulated/health", {"device": "2", "healthy": False, "xid": 79}
        )
        assert status == 200
        await stream.next_matching(lambda m: health_of(m).get(uuids[2]) == "Unhealthy")

        response = await stub.Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=[uuids[0], uuids[1]])])
        )
        assert response.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == f"{uuids[0]},{uuids[1]}"
        for refused in ([uuids[7]], [uuids[2]], []):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Allocate(
                    pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=refused)])
                )
            assert info.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)

        preferred = await stub.GetPreferredAllocation(
            pb.PreferredAllocationRequest(
                container_requests=[
                    pb.ContainerPreferredAllocationRequest(available_deviceIDs=uuids[:7], allocation_size=4)
                ]
            )
        )
        assert len(preferred.container_responses[0].deviceIDs) == 4

        # a live config change hands every GPU to DRA: the stream empties
        config.write_text(CONFIG.replace("default: device-plugin", "default: dra"))
        await stream.next_matching(lambda m: len(m.devices) == 0)
        stream.task.cancel()

    # a kubelet restart (sockets wiped, new kubelet.sock) leads to one fresh Register
    process = await kubelet.restart()
    await wait_for(lambda: process.holds_live_stream(GPU), what="re-registration")
    await eventually(socket.exists, "the plugin socket to be re-created")
    assert process.registrations(GPU) == 1

    code, _ = await asyncio.to_thread(agent.terminate)
    assert code == 0, agent.output()
    assert not socket.exists()
    # the clean exit ended the stream: the kubelet drops the resource's allocatable at once
    await wait_for(lambda: GPU in process.disconnected, what="the kubelet to see the stream end")


async def test_agent_paused_across_kubelet_restarts_registers_once_and_its_death_is_noticed() -> None:
    """SIGSTOP the agent, restart the kubelet, SIGCONT: one registration per kubelet start, the
    new kubelet holds a live stream and /readyz says ready. Then SIGKILL: the kubelet sees the
    stream end (what makes a real kubelet drop the node's allocatable)."""
    with short_tmpdir() as root:
        kubelet = FakeKubelet(root / "kubelet" / "device-plugins")
        await kubelet.start()
        config = root / "config.yaml"
        config.write_text(CONFIG)
        agent = AgentProcess(root, ["--simulated", "--config", str(config)])
        try:
            await asyncio.to_thread(agent.wait_ready)
            await wait_for(lambda: kubelet.holds_live_stream(GPU), what="the first registration")
            for round_ in range(4):
                await asyncio.to_thread(agent.pause)
                process = await kubelet.restart(reuse_inode=round_ % 2 == 0, crash=round_ == 3)
                assert process.registrations(GPU) == 0  # nobody registers while the agent is stopped
                agent.resume()
                await wait_for(lambda p=process: p.holds_live_stream(GPU), what="registration after the pause")
                await eventually(lambda: agent.get("/readyz")[0] == 200, "/readyz after the pause")
                state = agent.state()["device_plugin"]["resources"][GPU]
                assert state["registered"] is True and state["stream_open_since"]
            assert [p.registrations(GPU) for p in kubelet.starts] == [1] * 5
            assert all(p.dropped_new == 0 for p in kubelet.starts)
            assert process.allocatable(GPU) == 7  # GPU 7 belongs to DRA

            agent.proc.kill()  # SIGKILL: no clean shutdown, the kernel closes the connections
            await asyncio.to_thread(agent.proc.wait, 10)
            await wait_for(lambda: GPU in process.disconnected, what="the kubelet to see the stream end")
            assert process.allocatable(GPU) == 0
        finally:
            agent.resume()
            agent.kill()
            await kubelet.stop()


async def eventually(predicate: Callable[[], object], what: str, within_s: float = 10.0) -> None:
    """Wait for a condition that blocking calls (HTTP, the file system) answer, off the loop."""
    await asyncio.to_thread(sync_wait_for, predicate, within_s, what)


CDI_CONFIG = """
cdi: {reconcile_interval_s: 0.3}
plugin: {device_list_strategy: [cdi-cri, cdi-annotations]}
"""


async def test_cdi_names_from_allocate_exist_on_disk_and_come_back() -> None:
    """Allocate's CDI names resolve to the spec the agent wrote; a deleted spec is re-created."""
    from tests.cdi_fixtures import FakeDriver

    with short_tmpdir() as root:
        driver = FakeDriver(root / "driver", gpu_minors=tuple(range(8))).build()
        kubelet = FakeKubelet(root / "kubelet" / "device-plugins")
        await kubelet.start()
        config = root / "config.yaml"
        config.write_text(CDI_CONFIG)
        agent = AgentProcess(root, ["--simulated", "--config", str(config), "--driver-root", str(driver.root)])
        try:
            await asyncio.to_thread(agent.wait_ready)
            uuid = agent.state()["devices"][3]["uuid"]
            socket = kubelet.plugin_dir / "gpu-node-agent-nvidia-gpu.sock"
            async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
                stub = pb_grpc.DevicePluginStub(channel)
                response = await stub.Allocate(
                    pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=[uuid])])
                )
            container = response.container_responses[0]
            (name,) = [d.name for d in container.cdi_devices]
            assert list(container.annotations.values()) == [name]

            kind, _, device = name.partition("=")
            specs = [p for p in agent.cdi_root.iterdir() if p.suffix == ".json"]
            assert len(specs) == 1
            spec = json.loads(specs[0].read_text())
            assert spec["kind"] == kind and device in {d["name"] for d in spec["devices"]}
            assert spec["cdiVersion"] == "0.5.0"

            specs[0].unlink()  # a reboot empties /var/run/cdi
            await eventually(specs[0].exists, "the deleted spec to be re-created")
            assert json.loads(specs[0].read_text()) == spec
            assert agent.state()["cdi"]["repairs_total"]["created"] >= 1
            assert (await asyncio.to_thread(agent.terminate))[0] == 0
        finally:
            agent.kill()
            await kubelet.stop()


SIMULATED_CDI_CONFIG = """
cdi: {reconcile_interval_s: 0.3}
plugin: {device_list_strategy: [envvar, volume-mounts, cdi-annotations, cdi-cri]}
"""


async def test_simulated_node_without_driver_answers_every_strategy() -> None:
    """No --driver-root ("/" holds no NVIDIA driver): env-only CDI specs, names that resolve on disk."""
    from agent.cdi.discovery import DriverDiscovery

    if DriverDiscovery(Path("/")).installed_versions():
        pytest.skip("this host's / holds an NVIDIA driver: the agent would describe that driver instead")
    with short_tmpdir() as root:
        kubelet = FakeKubelet(root / "kubelet" / "device-plugins")
        await kubelet.start()
        config = root / "config.yaml"
        config.write_text(SIMULATED_CDI_CONFIG)
        agent = AgentProcess(root, ["--simulated", "--config", str(config)])
        try:
            await asyncio.to_thread(agent.wait_ready)
            state = agent.state()
            assert state["cdi"]["enabled"] is True and state["cdi"]["driver_mode"] == "simulated"
            uuids = [d["uuid"] for d in state["devices"][:2]]
            socket = kubelet.plugin_dir / "gpu-node-agent-nvidia-gpu.sock"
            async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
                stub = pb_grpc.DevicePluginStub(channel)
                response = await stub.Allocate(
                    pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=uuids)])
                )
            container = response.container_responses[0]
            assert "NVIDIA_VISIBLE_DEVICES" in container.envs  # envvar, then volume-mounts
            assert len(container.mounts) == 2  # volume-mounts
            names = [d.name for d in container.cdi_devices]  # cdi-cri
            assert len(names) == 2
            assert list(container.annotations.values()) == [",".join(names)]  # cdi-annotations

            specs = {p.name: json.loads(p.read_text()) for p in agent.cdi_root.iterdir() if p.suffix == ".json"}
            (spec,) = specs.values()
            assert spec["cdiVersion"] == "0.5.0"
            assert spec["containerEdits"] == {"env": ["GPU_AGENT_SIMULATED=true"]}
            devices = {d["name"]: d["containerEdits"] for d in spec["devices"]}
            assert all(set(edits) == {"env"} for edits in devices.values())  # env only, every device
            for name, uuid in zip(names, uuids, strict=True):
                kind, _, device = name.partition("=")
                assert spec["kind"] == kind and device in devices
                assert any(e.endswith(f"={uuid}") for e in devices[device]["env"])
            assert (await asyncio.to_thread(agent.terminate))[0] == 0
        finally:
            agent.kill()
            await kubelet.stop()


LABEL_CONFIG = """
cdi: {enabled: false}
plugin: {enabled: false}
ownership:
  default: device-plugin
  nodes:
    - match: {labels: {pool: dra}}
      default: dra
"""


async def test_node_labels_from_the_api_server_drive_ownership(tmp_path: Path) -> None:
    """One ConfigMap for every node: the labels come from the Node object, and a relabel moves the GPUs."""
    from tests.fake_apiserver import NODE, FakeApiServer, write_kubeconfig

    api = await FakeApiServer().start()
    api.set_labels({"pool": "dra"})
    config = tmp_path / "config.yaml"
    config.write_text(LABEL_CONFIG)
    kubeconfig = write_kubeconfig(tmp_path, api.url, {"token": "t0ken"})
    agent = AgentProcess(
        tmp_path, ["--simulated", "--config", str(config), "--kubeconfig", str(kubeconfig), "--node-name", NODE]
    )
    pods = FakePodResources(agent.kubelet_root / "pod-resources")  # the kubelet: no pod holds a GPU
    await pods.start()
    try:
        await asyncio.to_thread(agent.wait_ready)
        await eventually(lambda: {d["owner"] for d in agent.state()["devices"]} == {"dra"}, "the grants")
        state = agent.state()
        assert state["node"]["labels"] == {"pool": "dra"}
        assert api.tokens and api.tokens[0] == "Bearer t0ken"

        await api.next_watch()
        api.set_labels({"pool": "a100"})  # the pool is relabelled back to the device plugin

        def moved() -> bool:
            return {d["owner"] for d in agent.state()["devices"]} == {"device-plugin"}

        await eventually(moved, "ownership to follow the labels")
        assert (await asyncio.to_thread(agent.terminate))[0] == 0
    finally:
        agent.kill()
        await pods.stop()
        await api.stop()


async def test_an_api_server_that_never_answers_holds_serving_but_not_the_probes(tmp_path: Path) -> None:
    """Liveness and readiness answer at once; GPUs are not advertised under unknown labels."""
    from tests.fake_apiserver import NODE, write_kubeconfig

    silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)  # accepts, never answers
    port = silent.sockets[0].getsockname()[1]
    config = tmp_path / "config.yaml"
    config.write_text(LABEL_CONFIG.replace("plugin: {enabled: false}", "plugin: {enabled: true}"))
    kubeconfig = write_kubeconfig(tmp_path, f"http://127.0.0.1:{port}", {"token": "t"})
    agent = AgentProcess(
        tmp_path, ["--simulated", "--config", str(config), "--kubeconfig", str(kubeconfig), "--node-name", NODE]
    )
    try:
        await asyncio.to_thread(agent.wait_port)
        assert (await asyncio.to_thread(agent.get, "/healthz"))[0] == 200
        status, body = await asyncio.to_thread(agent.get, "/readyz")
        assert status == 503
        assert body["checks"]["node-labels"].startswith("waiting for the node's labels from the API server")
        sockets = [p.name for p in (agent.kubelet_root / "device-plugins").iterdir()]
        assert sockets == []  # nothing served while the owner of each GPU is unknown
        assert (await asyncio.to_thread(agent.terminate))[0] == 0
    finally:
        agent.kill()
        silent.close()
