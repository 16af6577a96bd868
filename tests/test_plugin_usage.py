"""Who holds which GPU through the device plugin: the PodResources client and the ID mapping."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from agent.backends.simulated import SimulatedBackend
from agent.core.config.schema import HealthConfig, PluginConfig, TimeSlicingConfig
from agent.core.inventory.model import Inventory
from agent.deviceplugin.podresources import ContainerDevices, PodResourcesClient, PodResourcesWatcher, Snapshot
from agent.deviceplugin.resources import plan_resources
from agent.deviceplugin.usage import device_usage, gpu_of_id
from tests.fake_podresources import FakePodResources
from tests.test_plugin_fakes import short_tmpdir

GPU = "nvidia.com/gpu"


@pytest.fixture
async def kubelet() -> AsyncIterator[FakePodResources]:
    with short_tmpdir() as root:
        fake = FakePodResources(root / "pod-resources")
        await fake.start()
        try:
            yield fake
        finally:
            await fake.stop()


async def _inventory(preset: str = "h100-8x-nvlink") -> Inventory:
    return await SimulatedBackend(preset=preset, node_name="n", health=HealthConfig()).load()


async def test_list_and_allocatable_through_the_real_socket(kubelet: FakePodResources) -> None:
    kubelet.allocate("ml", "train-0", "main", GPU, ["GPU-a", "GPU-b"])
    kubelet.allocatable = {GPU: ["GPU-a", "GPU-b", "GPU-c"]}
    watcher = PodResourcesWatcher(PodResourcesClient(kubelet.socket))
    await watcher.poll()
    assert watcher.known and watcher.latest is not None
    assert watcher.latest.containers == (ContainerDevices("ml", "train-0", "main", GPU, ("GPU-a", "GPU-b")),)
    assert watcher.latest.allocatable == {GPU: ("GPU-a", "GPU-b", "GPU-c")}


async def test_an_older_kubelet_without_get_allocatable_is_fine(kubelet: FakePodResources) -> None:
    kubelet.allocatable_served = False
    client = PodResourcesClient(kubelet.socket)
    watcher = PodResourcesWatcher(client)
    await watcher.poll()
    assert watcher.known and watcher.latest is not None and watcher.latest.allocatable is None
    assert not client.allocatable_served


@pytest.mark.parametrize("status", [grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL])
async def test_a_failing_kubelet_means_unknown_not_idle(kubelet: FakePodResources, status: grpc.StatusCode) -> None:
    watcher = PodResourcesWatcher(PodResourcesClient(kubelet.socket))
    await watcher.poll()
    assert watcher.known
    kubelet.fail = status
    await watcher.poll()
    assert not watcher.known and status.name in watcher.last_error
    assert "\n" not in watcher.last_error
    kubelet.fail = None
    await watcher.poll()
    assert watcher.known


async def test_a_missing_socket_means_unknown(kubelet: FakePodResources) -> None:
    await kubelet.stop()
    watcher = PodResourcesWatcher(PodResourcesClient(kubelet.socket))
    await watcher.poll()
    assert not watcher.known and "no PodResources socket" in watcher.last_error
    inventory = await _inventory()
    usage = device_usage(None, reason=watcher.last_error, plan={}, inventory=inventory, own_names=[GPU]).usage
    assert not usage.known and "no PodResources socket" in usage.reason


async def test_an_unreadable_kubelet_directory_means_unknown_not_a_crash() -> None:
    with short_tmpdir() as root:
        blocker = root / "pod-resources"
        blocker.write_text("a file where the directory should be")  # lstat fails with ENOTDIR
        watcher = PodResourcesWatcher(PodResourcesClient(blocker / "kubelet.sock"))
        await watcher.poll()
        assert not watcher.known and "cannot look for the PodResources socket" in watcher.last_error


async def test_ids_map_back_to_physical_gpus_in_every_form() -> None:
    inventory = await _inventory("a100-4x-mig")
    mig_gpu = next(g for g in inventory.gpus if g.mig_enabled)
    whole = next((g for g in inventory.gpus if not g.mig_enabled), None)
    if whole is None:  # every GPU of the preset in MIG mode: take one out of it
        from dataclasses import replace

        whole = replace(inventory.gpus[-1], mig_enabled=False, mig_devices=())
        inventory = replace(inventory, gpus=(*inventory.gpus[:-1], whole))
    mig = mig_gpu.mig_devices[0]
    shared = PluginConfig(time_slicing=TimeSlicingConfig(replicas=4), mig_strategy="mixed")
    plan = {r.name: r for r in plan_resources(inventory, shared).resources}
    names = list(plan)
    # a replica of the current plan, a MIG UUID, an index from an earlier index-strategy config
    assert gpu_of_id(f"{whole.uuid}::2", GPU, plan=plan, inventory=inventory, own_names=names) == whole.uuid
    assert gpu_of_id(mig.uuid, "nvidia.com/mig-x", plan=plan, inventory=inventory, own_names=names) == mig_gpu.uuid
    assert gpu_of_id(f"{mig_gpu.index}:0::1", GPU, plan=plan, inventory=inventory, own_names=names) == mig_gpu.uuid
    # an index under a resource that is not ours says nothing; a UUID is a UUID whoever listed it
    assert gpu_of_id(str(whole.index), "example.com/fpga", plan=plan, inventory=inventory, own_names=names) is None
    assert gpu_of_id(whole.uuid, "nvidia.com/other", plan=plan, inventory=inventory, own_names=names) == whole.uuid


async def test_usage_names_each_holder_and_reports_unmapped_ids() -> None:
    inventory = await _inventory()
    gpu0, gpu1 = inventory.gpus[0].uuid, inventory.gpus[1].uuid
    snapshot = Snapshot(
        containers=(
            ContainerDevices("ml", "a", "main", GPU, (gpu0, gpu1)),
            ContainerDevices("ml", "b", "side", GPU, (gpu1,)),
            ContainerDevices("ml", "c", "main", GPU, ("GPU-never-advertised",)),
        ),
        as_of=12.5,
    )
    plan = {r.name: r for r in plan_resources(inventory, PluginConfig()).resources}
    result = device_usage(snapshot, reason="", plan=plan, inventory=inventory, own_names=plan)
    usage = result.usage
    assert usage.known and usage.as_of == 12.5
    assert [(h.name, h.detail, h.devices) for h in usage.holders[gpu1]] == [
        ("a", "main", (gpu1,)),
        ("b", "side", (gpu1,)),
    ]
    assert usage.in_use(gpu0) and not usage.in_use(inventory.gpus[2].uuid)
    assert result.unmapped == ("nvidia.com/gpu GPU-never-advertised (ml/c)",)


async def test_a_cut_answer_is_not_trusted() -> None:
    inventory = await _inventory()
    snapshot = Snapshot(containers=(), as_of=1.0, truncated=True)
    usage = device_usage(snapshot, reason="", plan={}, inventory=inventory, own_names=[GPU]).usage
    assert not usage.known and "too large" in usage.reason
