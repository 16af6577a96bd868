"""plan_resources / advertised: resource names, IDs, MIG strategies, replicas, ownership."""

from __future__ import annotations

import pytest

from agent.backends.simulated import SimulatedBackend
from agent.core.config.schema import HealthConfig, Owner, PluginConfig, TimeSlicingConfig
from agent.core.inventory.model import Gpu, Inventory, MigDevice
from agent.deviceplugin.resources import Resource, advertised, plan_resources
from tests.test_plugin_fakes import ownership_for


async def inventory(preset: str) -> Inventory:
    return await SimulatedBackend(preset=preset, node_name="node-a", health=HealthConfig()).load()


class Health:
    def __init__(self, sick: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.sick = set(sick)

    def is_healthy(self, uuid: str) -> bool:
        return uuid not in self.sick


def by_name(plan_resources_result: tuple[Resource, ...]) -> dict[str, Resource]:
    return {r.name: r for r in plan_resources_result}


async def test_whole_gpus_by_uuid() -> None:
    inv = await inventory("h100-8x-nvlink")
    plan = plan_resources(inv, PluginConfig())
    assert plan.names() == ["nvidia.com/gpu"]
    res = plan.resources[0]
    assert [d.id for d in res.devices] == [g.uuid for g in sorted(inv.gpus, key=lambda g: g.index)]
    assert [d.numa_node for d in res.devices] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert res.socket_name == "gpu-node-agent-nvidia-gpu.sock"
    assert all(d.visible_id == d.target_uuid == d.gpu_uuid for d in res.devices)
    assert plan.problems == ()


async def test_index_strategy_and_rename() -> None:
    inv = await inventory("h100-8x-nvlink")
    plan = plan_resources(inv, PluginConfig(resource_name="example.com/accel", device_id_strategy="index"))
    (res,) = plan.resources
    assert res.name == "example.com/accel"
    assert res.socket_name == "gpu-node-agent-example-accel.sock"
    assert [d.id for d in res.devices] == [str(i) for i in range(8)]
    assert res.devices[3].target_uuid == inv.find("3").uuid  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("sharing", "name", "count"),
    [
        (TimeSlicingConfig(replicas=4), "nvidia.com/gpu", 32),
        (TimeSlicingConfig(replicas=4, rename_by_default=True), "nvidia.com/gpu.shared", 32),
        (TimeSlicingConfig(replicas=1, rename_by_default=True), "nvidia.com/gpu", 8),
    ],
)
async def test_time_slicing(sharing: TimeSlicingConfig, name: str, count: int) -> None:
    inv = await inventory("h100-8x-nvlink")
    (res,) = plan_resources(inv, PluginConfig(time_slicing=sharing)).resources
    assert res.name == name
    assert len(res.devices) == count
    if sharing.replicas > 1:
        first = inv.find("0").uuid  # type: ignore[union-attr]
        assert [d.id for d in res.devices[:4]] == [f"{first}::{n}" for n in range(4)]
        assert {d.gpu_uuid for d in res.devices[:4]} == {first}
        assert res.gpu_of[f"{first}::3"] == first


async def test_mig_none_advertises_whole_gpus() -> None:
    inv = await inventory("a100-4x-mig")
    plan = plan_resources(inv, PluginConfig(mig_strategy="none"))
    assert plan.names() == ["nvidia.com/gpu"]
    assert len(plan.resources[0].devices) == 4


async def test_mig_mixed_one_resource_per_profile() -> None:
    inv = await inventory("a100-4x-mig")
    plan = plan_resources(inv, PluginConfig(mig_strategy="mixed"))
    resources = by_name(plan.resources)
    profiles = {m.profile for g in inv.gpus for m in g.mig_devices}
    assert set(resources) == {f"nvidia.com/mig-{p}" for p in profiles}
    one_g = resources["nvidia.com/mig-1g.5gb"]
    expected = [m for g in sorted(inv.gpus, key=lambda g: g.index) for m in g.mig_devices if m.profile == "1g.5gb"]
    assert [d.id for d in one_g.devices] == [m.uuid for m in expected]
    assert all(
        d.gpu_uuid == m.parent_uuid and d.mig_uuid == m.uuid for d, m in zip(one_g.devices, expected, strict=True)
    )
    assert one_g.socket_name == "gpu-node-agent-nvidia-mig-1g.5gb.sock"


async def test_mig_mixed_index_ids() -> None:
    inv = await inventory("a100-4x-mig")
    plan = plan_resources(inv, PluginConfig(mig_strategy="mixed", device_id_strategy="index"))
    seven = by_name(plan.resources)["nvidia.com/mig-7g.40gb"]
    gpu = next(g for g in inv.gpus if any(m.profile == "7g.40gb" for m in g.mig_devices))
    assert [d.id for d in seven.devices] == [f"{gpu.index}:0"]


def _mig_inventory(profiles: list[list[str]], *, plain: int = 0) -> Inventory:
    gpus = []
    for i, migs in enumerate(profiles):
        uuid = f"GPU-{i}"
        gpus.append(
            Gpu(
                uuid=uuid,
                index=i,
                minor=i,
                product_name="A100",
                architecture="ampere",
                compute_capability="8.0",
                memory_mib=40960,
                pci_bus_id=f"00000000:0{i}:00.0",
                numa_node=0,
                mig_enabled=True,
                mig_devices=tuple(
                    MigDevice(
                        uuid=f"MIG-{i}-{j}",
                        parent_uuid=uuid,
                        index=j,
                        gpu_instance_id=j,
                        compute_instance_id=0,
                        profile=p,
                        memory_mib=4864,
                    )
                    for j, p in enumerate(migs)
                ),
            )
        )
    for k in range(plain):
        i = len(profiles) + k
        gpus.append(
            Gpu(
                uuid=f"GPU-{i}",
                index=i,
                minor=i,
                product_name="A100",
                architecture="ampere",
                compute_capability="8.0",
                memory_mib=40960,
                pci_bus_id=f"00000000:1{i}:00.0",
                numa_node=None,
            )
        )
    return Inventory(backend="test", driver_version="", cuda_driver_version="", gpus=tuple(gpus))


def test_mig_single_counts_mig_devices_as_the_gpu_resource() -> None:
    inv = _mig_inventory([["1g.5gb", "1g.5gb"], ["1g.5gb"]])
    plan = plan_resources(inv, PluginConfig(mig_strategy="single"))
    (res,) = plan.resources
    assert res.name == "nvidia.com/gpu"
    assert [d.id for d in res.devices] == ["MIG-0-0", "MIG-0-1", "MIG-1-0"]
    assert plan.problems == ()


def test_mig_single_refuses_mixed_profiles() -> None:
    plan = plan_resources(_mig_inventory([["1g.5gb"], ["2g.10gb"]]), PluginConfig(mig_strategy="single"))
    assert plan.resources == ()
    assert "one MIG profile" in plan.problems[0]


def test_mig_single_skips_gpus_without_mig() -> None:
    plan = plan_resources(_mig_inventory([["1g.5gb"]], plain=1), PluginConfig(mig_strategy="single"))
    assert [d.id for d in plan.resources[0].devices] == ["MIG-0-0"]
    assert "MIG disabled" in plan.problems[0]


def test_mig_single_without_mig_gpus_is_whole_gpus() -> None:
    plan = plan_resources(_mig_inventory([], plain=2), PluginConfig(mig_strategy="single"))
    assert [d.id for d in plan.resources[0].devices] == ["GPU-0", "GPU-1"]
    assert plan.resources[0].devices[0].numa_node is None


def test_mig_mixed_with_plain_gpus_and_sharing() -> None:
    inv = _mig_inventory([["1g.5gb"]], plain=1)
    config = PluginConfig(mig_strategy="mixed", time_slicing=TimeSlicingConfig(replicas=2, rename_by_default=True))
    resources = by_name(plan_resources(inv, config).resources)
    assert sorted(resources) == ["nvidia.com/gpu.shared", "nvidia.com/mig-1g.5gb.shared"]
    assert [d.id for d in resources["nvidia.com/mig-1g.5gb.shared"].devices] == ["MIG-0-0::0", "MIG-0-0::1"]


async def test_advertised_follows_ownership_and_health() -> None:
    inv = await inventory("h100-8x-nvlink")
    (res,) = plan_resources(inv, PluginConfig()).resources
    g = {i: inv.find(str(i)).uuid for i in range(8)}  # type: ignore[union-attr]
    table = ownership_for(inv, {g[1]: Owner.DRA, "2": Owner.NONE})
    states = advertised(res, table, Health({g[3]}))
    assert [s.device.id for s in states] == [g[i] for i in (0, 3, 4, 5, 6, 7)]
    assert {s.device.id: s.health for s in states}[g[3]] == "Unhealthy"
    assert {s.device.id: s.health for s in states}[g[0]] == "Healthy"


def test_empty_inventory_plans_nothing() -> None:
    assert plan_resources(Inventory.empty("none"), PluginConfig()).resources == ()
