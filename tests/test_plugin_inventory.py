"""The device plugin follows a changed node inventory (MIG relayout, GPU gone or back, driver).

The changed inventories are the simulated one edited with :func:`dataclasses.replace`, applied
the way the agent's inventory reload does (:meth:`PluginHarness.set_inventory`: health, then
ownership, then the inventory feed). Everything waits on conditions.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

import grpc
import pytest

from agent.backends.simulated import SimulatedBackend
from agent.core.config.current import ConfigState
from agent.core.config.schema import Config, HealthConfig, Owner, PluginConfig
from agent.core.health.monitor import HealthMonitor
from agent.core.inventory.current import InventoryState
from agent.core.inventory.model import Inventory, Link, MigDevice, PcieLevel, link_key
from agent.core.node import NodeFacts
from agent.core.ownership.table import OwnershipState
from agent.deviceplugin.manager import PluginManager
from tests._grpcio import deviceplugin_v1beta1_pb2 as pb
from tests._grpcio import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from tests.test_plugin_fakes import (
    NODE,
    PRESET,
    FakeCdi,
    FakeKubelet,
    PluginHarness,
    ids_of,
    loaded,
    next_message,
    ownership_for,
    plugin_harness,
    short_tmpdir,
    wait_for,
)

pytestmark = pytest.mark.integration

GPU = "nvidia.com/gpu"


def mig(profile: str) -> str:
    return f"nvidia.com/mig-{profile}"


def mig_socket(profile: str) -> str:
    return f"gpu-node-agent-nvidia-mig-{profile}.sock"


def with_mig(inventory: Inventory, index: int, profiles: Sequence[str], layout: str) -> Inventory:
    """``inventory`` with GPU ``index`` carved into ``profiles`` (none: MIG disabled)."""
    gpu = inventory.find(str(index))
    assert gpu is not None
    devices = tuple(
        MigDevice(
            uuid=f"MIG-{index}-{layout}-{n}",
            parent_uuid=gpu.uuid,
            index=n,
            gpu_instance_id=n + 1,
            compute_instance_id=0,
            profile=profile,
            memory_mib=int(profile.split(".")[1].removesuffix("gb")) * 1024,
        )
        for n, profile in enumerate(profiles)
    )
    carved = replace(gpu, mig_enabled=bool(devices), mig_devices=devices)
    return replace(inventory, gpus=tuple(carved if g.uuid == gpu.uuid else g for g in inventory.gpus))


def without_gpu(inventory: Inventory, index: int) -> Inventory:
    return replace(inventory, gpus=tuple(g for g in inventory.gpus if g.index != index))


@pytest.fixture
async def h() -> AsyncIterator[PluginHarness]:
    async with plugin_harness() as harness:
        await harness.wait_ready()
        yield harness


def allocate(*ids: str) -> pb.AllocateRequest:
    return pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=list(ids))])


async def test_mig_relayout_under_mixed_adds_and_removes_resources() -> None:
    async with plugin_harness(PluginConfig(mig_strategy="mixed")) as h:
        await h.wait_ready()
        original = h.inventory
        gpus = [h.gpu(i) for i in range(8)]
        gpu_server = h.manager.servers[GPU]
        async with h.channel() as channel:
            call = pb_grpc.DevicePluginStub(channel).ListAndWatch(pb.Empty())
            assert ids_of(await next_message(call)) == gpus

            # GPU 0 goes MIG: one resource per profile appears next to the whole GPUs
            h.set_inventory(with_mig(original, 0, ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"], "a"), "2")
            assert ids_of(await next_message(call)) == gpus[1:]
            carved = {mig("3g.40gb"), mig("2g.20gb"), mig("1g.10gb")}
            await wait_for(lambda: carved <= {c.request.resource_name for c in h.kubelet.calls}, what="MIG Register")
            await h.wait_ready()
            assert sorted(h.manager.servers) == sorted({GPU} | carved)
            assert all(c.error == "" for c in h.kubelet.calls)
            async with h.channel(mig_socket("1g.10gb")) as mig_channel:
                stub = pb_grpc.DevicePluginStub(mig_channel)
                mig_call = stub.ListAndWatch(pb.Empty())
                assert ids_of(await next_message(mig_call)) == ["MIG-0-a-2", "MIG-0-a-3"]
                response = await stub.Allocate(allocate("MIG-0-a-3"))
                assert response.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == "MIG-0-a-3"
                mig_call.cancel()

            # relayout to one 7g device: the three old profiles stop and take their sockets along
            h.set_inventory(with_mig(original, 0, ["7g.80gb"], "b"), "3")
            await wait_for(lambda: bool(h.kubelet.calls_for(mig("7g.80gb"))), what="7g Register")
            assert sorted(h.manager.servers) == [GPU, mig("7g.80gb")]
            for profile in ("3g.40gb", "2g.20gb", "1g.10gb"):
                assert not h.socket(mig_socket(profile)).exists()
            await h.wait_ready()

            # MIG off again: GPU 0 is a whole GPU on the still-open stream, no MIG resource left
            h.set_inventory(original, "4")
            assert ids_of(await next_message(call)) == gpus
            assert list(h.manager.servers) == [GPU]
            await wait_for(lambda: not h.socket(mig_socket("7g.80gb")).exists(), what="7g socket removed")
            call.cancel()
        # the whole-GPU resource was kept through it all: one run, one Register
        assert h.manager.servers[GPU] is gpu_server and gpu_server.runs == 1
        assert len(h.kubelet.calls_for(GPU)) == 1
        await h.wait_ready()


async def test_removed_gpu_vanishes_from_stream_and_is_refused(h: PluginHarness) -> None:
    original = h.inventory
    gpus = [h.gpu(i) for i in range(8)]
    gone = gpus[5]
    async with h.channel() as channel:
        stub = pb_grpc.DevicePluginStub(channel)
        call = stub.ListAndWatch(pb.Empty())
        await next_message(call)
        h.set_inventory(without_gpu(original, 5), "2")
        assert ids_of(await next_message(call)) == gpus[:5] + gpus[6:]
        for method, request in (
            (stub.Allocate, allocate(gone)),
            (stub.PreStartContainer, pb.PreStartContainerRequest(devices_ids=[gone])),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await method(request)  # type: ignore[operator]
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            details = err.value.details() or ""
            assert gone in details and "unknown device" in details
        await stub.Allocate(allocate(gpus[4]))  # the others still allocate

        # it comes back, owned by the device plugin: listed again on the same stream
        h.set_inventory(original, "3")
        assert ids_of(await next_message(call)) == gpus
        await stub.Allocate(allocate(gone))
        call.cancel()
    assert len(h.kubelet.calls) == 1 and h.manager.servers[GPU].runs == 1


async def test_gpu_that_appears_is_advertised_only_when_the_device_plugin_owns_it(h: PluginHarness) -> None:
    original = h.inventory
    gpus = [h.gpu(i) for i in range(8)]
    h.set_inventory(without_gpu(original, 7), "2")
    async with h.channel() as channel:
        call = pb_grpc.DevicePluginStub(channel).ListAndWatch(pb.Empty())
        assert ids_of(await next_message(call)) == gpus[:7]
        h.set_inventory(original, "3", gpus={gpus[7]: Owner.DRA})
        await wait_for(lambda: h.manager.inventory is original, what="re-plan")
        h.set_owner({gpus[3]: Owner.DRA, gpus[7]: Owner.DRA}, "4")  # a later change reaches the stream
        assert ids_of(await next_message(call)) == gpus[:3] + gpus[4:7]
        h.set_owner({}, "5")
        assert ids_of(await next_message(call)) == gpus
        call.cancel()


async def test_unchanged_resource_keeps_its_registration_and_follows_the_new_topology(h: PluginHarness) -> None:
    server = h.manager.servers[GPU]
    gpus = [h.gpu(i) for i in range(8)]
    # a driver upgrade that also reports different links: only GPUs 1 and 6 share NVLink now
    upgraded = replace(
        h.inventory,
        driver_version="580.65.06",
        links={link_key(gpus[1], gpus[6]): Link(nvlinks=18, pcie=PcieLevel.SYSTEM)},
    )
    preferred = pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=gpus, must_include_deviceIDs=[gpus[1]], allocation_size=2
            )
        ]
    )
    async with h.channel() as channel:
        stub = pb_grpc.DevicePluginStub(channel)
        call = stub.ListAndWatch(pb.Empty())
        await next_message(call)
        h.set_inventory(upgraded, "2")
        await wait_for(lambda: h.manager.inventory is upgraded, what="re-plan")
        answer = (await stub.GetPreferredAllocation(preferred)).container_responses[0]
        assert sorted(answer.deviceIDs) == sorted([gpus[1], gpus[6]])  # the scorer is the new one
        # the same stream of the same run is still open: the next change reaches it
        h.set_owner({gpus[0]: Owner.DRA}, "3")
        assert ids_of(await next_message(call)) == gpus[1:]
        call.cancel()
    assert h.manager.servers[GPU] is server and server.runs == 1
    assert len(h.kubelet.calls) == 1
    assert h.manager.ready


async def test_every_gpu_gone_stops_every_server(h: PluginHarness) -> None:
    h.set_inventory(Inventory.empty("simulated"), "2")
    # a stopping server leaves the table first and removes its socket as it closes
    await wait_for(lambda: h.manager.servers == {} and not h.socket().exists(), what="servers stopped")
    await h.wait_ready()  # nothing to serve is ready
    assert h.kubelet.socket.exists()


async def test_update_before_run_plans_from_the_newest_inventory() -> None:
    inventory = await SimulatedBackend(preset=PRESET, node_name=NODE, health=HealthConfig()).load()
    inventories = InventoryState(inventory)
    with short_tmpdir() as root:
        manager = PluginManager(
            config_state=ConfigState(loaded(Config())),
            node=NodeFacts(
                inventory=inventories, health=HealthMonitor(config=HealthConfig()), ownership=OwnershipState()
            ),
            cdi=FakeCdi(),
            plugin_dir=root / "device-plugins",
        )
        inventories.update(Inventory.empty("simulated"))
        task = asyncio.create_task(manager.run())
        await wait_for(lambda: manager.ready, what="ready with zero servers")
        assert manager.servers == {} and manager.inventory.gpus == ()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_gpus_that_appear_later_are_served_without_a_restart() -> None:
    """A driver container becomes ready after the agent: the node goes from no GPUs to eight."""
    full = await SimulatedBackend(preset=PRESET, node_name=NODE, health=HealthConfig()).load()
    inventories = InventoryState(Inventory.empty("nvml"))
    health = HealthMonitor(config=HealthConfig())
    ownership = OwnershipState()
    with short_tmpdir() as root:
        kubelet = FakeKubelet(root / "device-plugins")
        await kubelet.start()
        manager = PluginManager(
            config_state=ConfigState(loaded(Config())),
            node=NodeFacts(inventory=inventories, health=health, ownership=ownership),
            cdi=FakeCdi(),
            plugin_dir=root / "device-plugins",
        )
        task = asyncio.create_task(manager.run())
        try:
            await wait_for(lambda: manager.ready, what="ready with zero servers")
            assert kubelet.calls == [] and manager.advertised_gpus() == frozenset()
            # what the agent does with a new inventory: health and ownership first, then the feed
            health.set_inventory(full)
            ownership.update(ownership_for(full))
            inventories.update(full)
            await wait_for(lambda: len(kubelet.calls) == 1 and manager.ready, what="registration")
            assert manager.advertised_gpus() == {g.uuid for g in full.gpus}
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await kubelet.stop()
