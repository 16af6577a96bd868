"""MIG instances and MPS daemons on the simulated backend (agent/backends/simulated_mig.py, simulated_mps.py)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from agent.backends.backend import NullBackend
from agent.backends.factory import open_backend
from agent.backends.migprofiles import cap_minors
from agent.backends.simulated import SimulatedBackend
from agent.core.config.schema import Config, HealthConfig, PathsConfig
from agent.core.health.model import SignalKind
from agent.core.inventory.model import MigPlacement
from agent.core.mechanism import Readiness
from agent.core.partitioning import PartitionError, PartitionErrorKind
from agent.observe.debug.server import DebugContext
from tests.conftest import DebugClient

FAST = HealthConfig(check_interval_s=3600)
UUID = re.compile(r"^MIG-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
# H100 80GB profile IDs
P1G, P1G_ME, P1G_WIDE, P2G, P3G, P4G, P7G = 19, 20, 15, 14, 9, 5, 0


def make(preset: str = "h100-8x-nvlink", node: str = "node-a", mps_dir: Path | None = None) -> SimulatedBackend:
    return SimulatedBackend(preset=preset, node_name=node, health=FAST, mps_dir=mps_dir)


def at(start: int, size: int) -> MigPlacement:
    return MigPlacement(start=start, size=size)


async def refused(coro: Any, kind: PartitionErrorKind, words: str = "") -> str:
    with pytest.raises(PartitionError) as info:
        await coro
    message = str(info.value)
    assert info.value.kind is kind, message
    assert words in message and "\n" not in message
    return message


# --- creating and destroying ----------------------------------------------------------------


async def test_first_instance_switches_a_hopper_gpu_into_mig_mode_and_the_last_switches_it_back() -> None:
    backend = make()
    gpu = (await backend.load()).gpus[2]
    assert not gpu.mig_enabled and gpu.mig_memory_slices == 8

    mig = await backend.mig.create(gpu.uuid, P1G, at(3, 1))
    assert UUID.fullmatch(mig.uuid) and mig.parent_uuid == gpu.uuid
    assert (mig.index, mig.gpu_instance_id, mig.compute_instance_id) == (0, 10, 0)
    assert (mig.profile, mig.profile_id, mig.placement, mig.memory_mib) == ("1g.10gb", P1G, at(3, 1), 9984)
    assert (mig.gi_cap_minor, mig.ci_cap_minor) == cap_minors(gpu.minor, 10, 0)

    after = (await backend.load()).gpus[2]
    assert after.mig_enabled and after.mig_devices == (mig,)
    assert await backend.mig.instances(gpu.uuid) == (mig,)
    assert backend.status()["mig"] == {"switched_on": [gpu.uuid], "injected_failures": []}

    await backend.mig.destroy(gpu.uuid, 10, 0)
    gone = (await backend.load()).gpus[2]
    assert not gone.mig_enabled and gone.mig_devices == ()
    assert await backend.mig.instances(gpu.uuid) == ()


async def test_mig_uuids_are_deterministic_per_node_gpu_and_instance() -> None:
    first, again, other = make(node="node-a"), make(node="node-a"), make(node="node-b")
    uuids = []
    for backend in (first, again, other):
        gpu = (await backend.load()).gpus[0]
        uuids.append((await backend.mig.create(gpu.uuid, P3G, at(4, 4))).uuid)
    assert uuids[0] == uuids[1] != uuids[2]
    gpu = (await first.load()).gpus[0]
    await first.mig.destroy(gpu.uuid, 2, 0)
    assert (await first.mig.create(gpu.uuid, P3G, at(4, 4))).uuid == uuids[0]  # same place, same device
    assert (await first.mig.create(gpu.uuid, P3G, at(0, 4))).uuid != uuids[0]


async def test_instances_fill_a_gpu_as_the_hardware_allows() -> None:
    backend = make()
    uuid = (await backend.load()).gpus[0].uuid
    big = await backend.mig.create(uuid, P4G, at(0, 4))
    two = await backend.mig.create(uuid, P2G, at(4, 2))
    one = await backend.mig.create(uuid, P1G, at(6, 1))
    assert [d.gpu_instance_id for d in (big, two, one)] == [1, 5, 13]
    assert [d.index for d in (big, two, one)] == [0, 1, 2]
    await refused(backend.mig.create(uuid, P1G, at(5, 1)), PartitionErrorKind.INSUFFICIENT_RESOURCES, "taken by")
    await refused(backend.mig.create(uuid, P7G, at(0, 8)), PartitionErrorKind.INSUFFICIENT_RESOURCES)
    await backend.mig.destroy(uuid, 5, 0)
    again = await backend.mig.create(uuid, P1G_WIDE, at(4, 2))
    assert again.index == 1 and again.gpu_instance_id == 5  # the freed index and slices


@pytest.mark.parametrize(
    ("first", "second", "words"),
    [
        ((P1G_ME, at(0, 1)), (P1G_ME, at(1, 1)), "at most 1 1g.10gb+me"),
        ((P3G, at(0, 4)), (P4G, at(0, 4)), "taken by"),
        ((P1G_WIDE, at(0, 2)), (P1G, at(1, 1)), "taken by"),
    ],
)
async def test_what_does_not_fit_is_insufficient_resources(
    first: tuple[int, MigPlacement], second: tuple[int, MigPlacement], words: str
) -> None:
    backend = make()
    uuid = (await backend.load()).gpus[0].uuid
    await backend.mig.create(uuid, *first)
    await refused(backend.mig.create(uuid, *second), PartitionErrorKind.INSUFFICIENT_RESOURCES, words)


async def test_profiles_and_placements_the_gpu_does_not_offer() -> None:
    backend = make()
    uuid = (await backend.load()).gpus[0].uuid
    await refused(backend.mig.create(uuid, 99, at(0, 1)), PartitionErrorKind.NOT_SUPPORTED, "offered: 19 (1g.10gb)")
    await refused(backend.mig.create(uuid, P1G, at(7, 1)), PartitionErrorKind.NOT_SUPPORTED, "its placements: 0:1")
    await refused(backend.mig.create(uuid, P1G_WIDE, at(1, 2)), PartitionErrorKind.NOT_SUPPORTED)
    # a failed create leaves the GPU as it was: still out of MIG mode
    assert not (await backend.load()).gpus[0].mig_enabled
    assert backend.status()["mig"] == {"switched_on": [], "injected_failures": []}


async def test_gpus_that_cannot_and_gpus_that_are_gone() -> None:
    workstation = make("workstation-2x-pcie")
    uuid = (await workstation.load()).gpus[0].uuid
    await refused(workstation.mig.create(uuid, P1G, at(0, 1)), PartitionErrorKind.NOT_SUPPORTED, "cannot do MIG")
    backend = make()
    await refused(backend.mig.create("GPU-nope", P1G, at(0, 1)), PartitionErrorKind.NOT_FOUND)
    await refused(backend.mig.instances("GPU-nope"), PartitionErrorKind.NOT_FOUND)
    uuid = (await backend.load()).gpus[0].uuid
    await refused(backend.mig.destroy(uuid, 7, 0), PartitionErrorKind.NOT_FOUND, "no such MIG device")


async def test_an_ampere_gpu_out_of_mig_mode_needs_a_reset(tmp_path: Path) -> None:
    path = tmp_path / "a100.yaml"
    path.write_text(
        "defaults: {product_name: NVIDIA A100-SXM4-40GB, architecture: ampere, compute_capability: '8.0',\n"
        "           memory_mib: 40960, mig_model: a100-40gb}\ngpus: [{}]\n"
    )
    backend = make(str(path))
    uuid = (await backend.load()).gpus[0].uuid
    await refused(backend.mig.create(uuid, P1G, at(0, 1)), PartitionErrorKind.MIG_DISABLED, "only with a reset")


async def test_preset_mig_devices_can_be_destroyed_and_their_gpu_stays_in_mig_mode() -> None:
    backend = make("a100-4x-mig")
    last = (await backend.load()).gpus[3]  # one 7g.40gb
    (whole,) = await backend.mig.instances(last.uuid)
    await refused(backend.mig.create(last.uuid, P3G, at(0, 4)), PartitionErrorKind.INSUFFICIENT_RESOURCES)
    await backend.mig.destroy(last.uuid, whole.gpu_instance_id, whole.compute_instance_id)
    after = (await backend.load()).gpus[3]
    assert after.mig_enabled and after.mig_devices == ()  # the preset put it in MIG mode
    made = await backend.mig.create(last.uuid, P3G, at(0, 4))
    assert (made.profile, made.memory_mib, made.gpu_instance_id) == ("3g.20gb", 20096, 1)


async def test_an_edited_preset_file_starts_its_gpus_again(tmp_path: Path) -> None:
    path = tmp_path / "node.yaml"
    head = "defaults: {product_name: H100, architecture: hopper, compute_capability: '9.0', mig_model: h100-80gb}\n"
    path.write_text(head + "gpus: [{memory_mib: 81559}, {memory_mib: 81559}]\n")
    backend = make(str(path))
    first, second = (await backend.load()).gpus
    await backend.mig.create(first.uuid, P1G, at(0, 1))
    await backend.mig.create(second.uuid, P1G, at(0, 1))
    path.write_text(head + "gpus: [{memory_mib: 81559}, {memory_mib: 81920}]\n")  # the second GPU changed
    again = (await backend.load()).gpus
    assert len(again[0].mig_devices) == 1 and again[1].mig_devices == () and not again[1].mig_enabled


async def test_health_follows_a_new_mig_device() -> None:
    backend = make()
    uuid = (await backend.load()).gpus[0].uuid
    mig = await backend.mig.create(uuid, P2G, at(0, 2))
    inventory = await backend.load()
    watching = asyncio.Event()
    watch = asyncio.create_task(backend.watch_health(inventory, lambda _: watching.set()))
    try:
        await asyncio.wait_for(watching.wait(), 10)
        signal = backend.inject(mig.uuid, healthy=False, xid=79)
    finally:
        watch.cancel()
    assert (signal.uuid, signal.kind, signal.xid) == (mig.uuid, SignalKind.XID, 79)


# --- injected failures ------------------------------------------------------------------------


async def test_injected_failures_hit_the_next_calls_only() -> None:
    backend = make()
    gpus = (await backend.load()).gpus
    answer = backend.inject_mig_failure("create", "in-use", device="1", count=2)
    assert answer == {"op": "create", "kind": "in-use", "device": gpus[1].uuid, "count": 2}
    made = await backend.mig.create(gpus[0].uuid, P1G, at(0, 1))  # another GPU: unaffected
    for _ in range(2):
        await refused(backend.mig.create(gpus[1].uuid, P1G, at(0, 1)), PartitionErrorKind.IN_USE, "injected")
    await backend.mig.create(gpus[1].uuid, P1G, at(0, 1))
    backend.inject_mig_failure("destroy", "gpu-lost")
    await refused(backend.mig.destroy(gpus[0].uuid, made.gpu_instance_id, 0), PartitionErrorKind.GPU_LOST)
    await backend.mig.destroy(gpus[0].uuid, made.gpu_instance_id, 0)


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"op": "create", "kind": "in-use", "device": 0}, 200, "in-use"),
        ({"op": "destroy", "kind": "not-found"}, 200, "destroy"),
        ({"op": "resize", "kind": "in-use"}, 400, "op must be one of create, destroy"),
        ({"op": "create", "kind": "sad"}, 400, "kind must be one of in-use"),
        ({"op": "create", "kind": "in-use", "count": 0}, 400, "count must be 1-100"),
        ({"op": "create", "kind": "in-use", "count": "1"}, 400, "'count' must be an integer"),
        ({"op": "create", "kind": "in-use", "device": "GPU-missing"}, 404, "no simulated GPU"),
        ([1, 2], 400, "JSON object"),
    ],
)
async def test_the_debug_hook(debug_client: DebugClient, body: Any, status: int, words: str) -> None:
    backend = make()
    context = DebugContext(
        state=dict,
        readiness=lambda: {"inventory": Readiness(True)},
        status=lambda: "serving",
        registry=CollectorRegistry(),
        simulated=backend,
    )
    client = await debug_client(context)
    response = await client.post("/debug/simulated/mig", json=body)
    assert response.status == status
    assert words in await response.text()


# --- MPS --------------------------------------------------------------------------------------


async def test_simulated_mps_daemons(tmp_path: Path) -> None:
    backend = make(mps_dir=tmp_path / "mps")
    gpu = (await backend.load()).gpus[0]
    await refused(
        backend.mps.set_limits(gpu.uuid, active_thread_percentage=50, pinned_memory_mib=1024),
        PartitionErrorKind.NOT_FOUND,
    )
    daemon = await backend.mps.ensure(gpu.uuid)
    assert daemon == await backend.mps.ensure(gpu.uuid)
    assert daemon.pipe_dir == tmp_path / "mps" / gpu.uuid[:12] / "pipe" and daemon.pipe_dir.is_dir()
    assert daemon.log_dir.is_dir()
    await backend.mps.set_limits(gpu.uuid, active_thread_percentage=50, pinned_memory_mib=40960)
    await refused(
        backend.mps.set_limits(gpu.uuid, active_thread_percentage=0, pinned_memory_mib=0), PartitionErrorKind.FAILED
    )
    view = backend.mps.status()
    assert view["daemons"][gpu.uuid]["active_thread_percentage"] == 50  # type: ignore[index]
    await refused(backend.mps.ensure("GPU-00000000-nope"), PartitionErrorKind.NOT_FOUND)
    mig = await backend.mig.create(gpu.uuid, P3G, at(0, 4))
    assert (await backend.mps.ensure(mig.uuid)).gpu_uuid == mig.uuid  # a MIG device can be shared too
    await backend.mps.release(gpu.uuid)
    await backend.mps.release(gpu.uuid)
    assert set(backend.mps.status()["daemons"]) == {mig.uuid}  # type: ignore[arg-type]
    await backend.close()


async def test_no_state_directory_no_mps() -> None:
    backend = make()
    await refused(backend.mps.ensure((await backend.load()).gpus[0].uuid), PartitionErrorKind.NOT_SUPPORTED)
    assert backend.mps.status()["enabled"] is False


async def test_the_factory_puts_mps_under_the_state_directory(tmp_path: Path) -> None:
    config = Config(backend="simulated", node_name="n", paths=PathsConfig(state_dir=tmp_path / "state"))
    backend = await open_backend(config)
    try:
        daemon = await backend.mps.ensure((await backend.load()).gpus[0].uuid)
        assert daemon.pipe_dir.is_relative_to(tmp_path / "state" / "mps")
    finally:
        await backend.close()


async def test_a_node_without_gpus_carves_nothing() -> None:
    backend = NullBackend("no driver")
    await refused(backend.mig.create("GPU-x", P1G, at(0, 1)), PartitionErrorKind.NOT_SUPPORTED, "no GPUs")
    assert await backend.mig.instances("GPU-x") == ()
    await refused(backend.mps.ensure("GPU-x"), PartitionErrorKind.NOT_SUPPORTED)
    await backend.mps.release("GPU-x")
