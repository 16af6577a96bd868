"""Allocate / PreStartContainer domain: validation table and every device-list strategy."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from agent.backends.simulated import SimulatedBackend
from agent.core.config.schema import HealthConfig, Owner, PluginConfig, TimeSlicingConfig
from agent.core.inventory.model import Inventory
from agent.core.ownership.table import OwnershipTable
from agent.deviceplugin.allocate import (
    VOLUME_MOUNT_ROOT,
    Allocator,
    ContainerAllocation,
    MountSpec,
    resolve_ids,
)
from agent.deviceplugin.errors import AllocationError, ErrorKind, format_ids
from agent.deviceplugin.resources import Resource, plan_resources
from tests.test_plugin_fakes import FakeCdi, ownership_for


class Health:
    def __init__(self, sick: Sequence[str] = ()) -> None:
        self.sick = set(sick)

    def is_healthy(self, uuid: str) -> bool:
        return uuid not in self.sick


@pytest.fixture
async def inv() -> Inventory:
    return await SimulatedBackend(preset="h100-8x-nvlink", node_name="node-a", health=HealthConfig()).load()


def gpu(inv: Inventory, index: int) -> str:
    found = inv.find(str(index))
    assert found is not None
    return found.uuid


def resource(inv: Inventory, config: PluginConfig) -> Resource:
    (res,) = plan_resources(inv, config).resources
    return res


@pytest.mark.parametrize(
    ("case", "kind", "fragment"),
    [
        ("empty", ErrorKind.INVALID_ARGUMENT, "empty device list"),
        ("duplicate", ErrorKind.INVALID_ARGUMENT, "duplicate device IDs"),
        ("unknown", ErrorKind.INVALID_ARGUMENT, "unknown device IDs GPU-nope"),
        ("not-owned", ErrorKind.FAILED_PRECONDITION, "not owned by the device plugin (owner dra)"),
        ("unhealthy", ErrorKind.FAILED_PRECONDITION, "unhealthy devices"),
        ("replicas-of-one-gpu", ErrorKind.INVALID_ARGUMENT, "several replicas of one device"),
    ],
)
def test_resolve_refusals(inv: Inventory, case: str, kind: ErrorKind, fragment: str) -> None:
    g0, g1, g2 = gpu(inv, 0), gpu(inv, 1), gpu(inv, 2)
    config = PluginConfig()
    ids: list[str] = {
        "empty": [],
        "duplicate": [g0, g0],
        "unknown": [g0, "GPU-nope"],
        "not-owned": [g0, g1],
        "unhealthy": [g2],
        "replicas-of-one-gpu": [f"{g0}::0", f"{g0}::1"],
    }[case]
    if case == "replicas-of-one-gpu":
        config = PluginConfig(time_slicing=TimeSlicingConfig(replicas=2, fail_requests_greater_than_one=True))
    table = ownership_for(inv, {g1: Owner.DRA})
    with pytest.raises(AllocationError) as err:
        resolve_ids(resource(inv, config), ids, ownership=table, health=Health([g2]))
    assert err.value.kind is kind
    assert fragment in str(err.value)
    if ids and case != "empty":
        assert err.value.device_ids  # the offending IDs travel with the error, for the log


def test_replicas_of_different_gpus_are_fine_when_refusing_several(inv: Inventory) -> None:
    config = PluginConfig(time_slicing=TimeSlicingConfig(replicas=2, fail_requests_greater_than_one=True))
    ids = [f"{gpu(inv, 0)}::1", f"{gpu(inv, 1)}::0"]
    devices = resolve_ids(resource(inv, config), ids, ownership=ownership_for(inv), health=Health())
    assert [d.gpu_uuid for d in devices] == [gpu(inv, 0), gpu(inv, 1)]


def test_replicas_of_one_gpu_allowed_by_default(inv: Inventory) -> None:
    config = PluginConfig(time_slicing=TimeSlicingConfig(replicas=2))
    ids = [f"{gpu(inv, 0)}::0", f"{gpu(inv, 0)}::1"]
    assert len(resolve_ids(resource(inv, config), ids, ownership=ownership_for(inv), health=Health())) == 2


async def allocate(
    inv: Inventory,
    config: PluginConfig,
    requests: list[list[str]],
    cdi: FakeCdi | None = None,
    table: OwnershipTable | None = None,
) -> list[ContainerAllocation]:
    allocator = Allocator(config=config, cdi=cdi or FakeCdi(), request_id=lambda: "req-1")
    return await allocator.allocate(
        resource(inv, config), requests, ownership=table or ownership_for(inv), health=Health()
    )


async def test_envvar(inv: Inventory) -> None:
    g0, g1 = gpu(inv, 0), gpu(inv, 1)
    (out,) = await allocate(inv, PluginConfig(), [[g1, g0]])
    assert out == ContainerAllocation(envs={"NVIDIA_VISIBLE_DEVICES": f"{g1},{g0}"})


async def test_envvar_index_ids(inv: Inventory) -> None:
    (out,) = await allocate(inv, PluginConfig(device_id_strategy="index"), [["3", "5"]])
    assert out.envs == {"NVIDIA_VISIBLE_DEVICES": "3,5"}


async def test_volume_mounts(inv: Inventory) -> None:
    g0 = gpu(inv, 0)
    (out,) = await allocate(inv, PluginConfig(device_list_strategy=("volume-mounts",)), [[g0]])
    assert out.envs == {"NVIDIA_VISIBLE_DEVICES": VOLUME_MOUNT_ROOT}
    assert out.mounts == (MountSpec(container_path=f"{VOLUME_MOUNT_ROOT}/{g0}", host_path="/dev/null"),)


async def test_cdi_annotations(inv: Inventory) -> None:
    g0, g4 = gpu(inv, 0), gpu(inv, 4)
    cdi = FakeCdi()
    (out,) = await allocate(inv, PluginConfig(device_list_strategy=("cdi-annotations",)), [[g0, g4]], cdi)
    assert out.envs == {}
    assert out.annotations == {
        "cdi.k8s.io/gpu-node-agent_req-1": f"{cdi.kind}={g0},{cdi.kind}={g4}",
    }
    assert cdi.ensured == 1


async def test_cdi_cri(inv: Inventory) -> None:
    g2 = gpu(inv, 2)
    cdi = FakeCdi()
    (out,) = await allocate(inv, PluginConfig(device_list_strategy=("cdi-cri",)), [[g2]], cdi)
    assert out.cdi_devices == (f"{cdi.kind}={g2}",)
    assert out.envs == {} and out.annotations == {} and out.mounts == ()
    assert cdi.ensured == 1


async def test_combined_strategies_and_replicas_resolve_to_the_gpu(inv: Inventory) -> None:
    g0, g1 = gpu(inv, 0), gpu(inv, 1)
    config = PluginConfig(
        device_list_strategy=("envvar", "cdi-cri", "cdi-annotations"),
        time_slicing=TimeSlicingConfig(replicas=4),
    )
    cdi = FakeCdi()
    (out,) = await allocate(inv, config, [[f"{g0}::2", f"{g0}::3", f"{g1}::0"]], cdi)
    assert out.envs == {"NVIDIA_VISIBLE_DEVICES": f"{g0},{g1}"}
    assert out.cdi_devices == (f"{cdi.kind}={g0}", f"{cdi.kind}={g1}")
    assert out.annotations == {"cdi.k8s.io/gpu-node-agent_req-1": f"{cdi.kind}={g0},{cdi.kind}={g1}"}


async def test_no_cdi_call_without_a_cdi_strategy(inv: Inventory) -> None:
    cdi = FakeCdi(fail="must not be called")
    await allocate(inv, PluginConfig(), [[gpu(inv, 0)]], cdi)
    assert cdi.ensured == 0


async def test_cdi_failure_is_failed_precondition(inv: Inventory) -> None:
    with pytest.raises(AllocationError) as err:
        await allocate(inv, PluginConfig(device_list_strategy=("cdi-cri",)), [[gpu(inv, 0)]], FakeCdi(fail="disk full"))
    assert err.value.kind is ErrorKind.FAILED_PRECONDITION
    assert "disk full" in str(err.value)


async def test_several_containers_one_answer_each(inv: Inventory) -> None:
    out = await allocate(inv, PluginConfig(), [[gpu(inv, 0)], [gpu(inv, 1), gpu(inv, 2)]])
    assert [a.envs["NVIDIA_VISIBLE_DEVICES"].count(",") for a in out] == [0, 1]


async def test_empty_request_and_one_bad_container_refuse_all(inv: Inventory) -> None:
    with pytest.raises(AllocationError) as err:
        await allocate(inv, PluginConfig(), [])
    assert err.value.kind is ErrorKind.INVALID_ARGUMENT
    with pytest.raises(AllocationError) as err:
        await allocate(inv, PluginConfig(), [[gpu(inv, 0)], []])
    assert err.value.kind is ErrorKind.INVALID_ARGUMENT


async def test_one_id_in_two_containers_is_refused_naming_it(inv: Inventory) -> None:
    g0, g1, g2 = gpu(inv, 0), gpu(inv, 1), gpu(inv, 2)
    with pytest.raises(AllocationError) as err:
        await allocate(inv, PluginConfig(), [[g0, g1], [g2], [g1, g0]])
    assert err.value.kind is ErrorKind.INVALID_ARGUMENT
    assert err.value.device_ids == tuple(sorted((g0, g1)))
    assert "more than one container" in str(err.value) and g0 in str(err.value) and g1 in str(err.value)
    assert g2 not in str(err.value)


async def test_replicas_of_one_gpu_may_go_to_two_containers(inv: Inventory) -> None:
    config = PluginConfig(time_slicing=TimeSlicingConfig(replicas=2))
    g0 = gpu(inv, 0)
    out = await allocate(inv, config, [[f"{g0}::0"], [f"{g0}::1"]])
    assert [a.envs["NVIDIA_VISIBLE_DEVICES"] for a in out] == [g0, g0]
    with pytest.raises(AllocationError, match="more than one container"):
        await allocate(inv, config, [[f"{g0}::0"], [f"{g0}::0"]])


def test_prestart_validates(inv: Inventory) -> None:
    allocator = Allocator(config=PluginConfig(), cdi=FakeCdi())
    res = resource(inv, PluginConfig())
    allocator.prestart(res, [gpu(inv, 0)], ownership=ownership_for(inv), health=Health())
    with pytest.raises(AllocationError, match=r"pre-start nvidia\.com/gpu: unknown"):
        allocator.prestart(res, ["x"], ownership=ownership_for(inv), health=Health())


@pytest.mark.parametrize(
    ("ids", "shown"),
    [
        (["GPU-1", "GPU-2"], "GPU-1, GPU-2"),
        (["a\nb"], "'a\\nb'"),
        (["x" * 100], "x" * 64 + "...(100 characters)"),
        (["y\n" * 50], repr("y\n" * 32) + "...(100 characters)"),
        ([f"G{i}" for i in range(10)], "G0, G1, G2, G3, G4, G5, G6, G7 (+2 more)"),
    ],
)
def test_ids_in_messages_are_cut_short_and_quoted(ids: list[str], shown: str) -> None:
    assert format_ids(ids) == shown
