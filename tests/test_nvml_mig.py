"""MIG through NVML over the fake pynvml: profiles and placements in the inventory, and the fake's
MIG functions themselves (tests/fakes/fake_nvml_mig.py) against the real binding's names."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import threading
from collections.abc import AsyncIterator
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest

from agent.backends.nvml import migread
from agent.backends.nvml.backend import NvmlBackend
from agent.core.inventory.model import Inventory, MigPlacement
from agent.core.partitioning import PartitionError, PartitionErrorKind
from tests.fakes import fake_nvml_mig, fake_pynvml
from tests.fakes.fake_pynvml import FakeNvml, h100_node
from tests.nvml_fixtures import CHECKS, TIMEOUT, mig_minor, opened, single_line, until

NOT_SUPPORTED, NO_PERMISSION, FUNCTION_NOT_FOUND, GPU_IS_LOST = 3, 4, 13, 15

# --- the fake against the real binding ---------------------------------------------------------


def test_fake_mig_names_and_structs_match_real_pynvml() -> None:
    real = pytest.importorskip("pynvml")
    for name in dir(fake_nvml_mig):
        if name.startswith(("NVML_GPU_INSTANCE_PROFILE_", "NVML_COMPUTE_INSTANCE_")):
            assert getattr(real, name) == getattr(fake_nvml_mig, name), name
    assert real.NVML_ERROR_INSUFFICIENT_RESOURCES == h100_node().NVML_ERROR_INSUFFICIENT_RESOURCES
    for fake_struct, real_struct in [
        (fake_nvml_mig.c_nvmlGpuInstanceProfileInfo_v2_t, real.c_nvmlGpuInstanceProfileInfo_v2_t),
        (fake_nvml_mig.c_nvmlGpuInstanceInfo_t, real.c_nvmlGpuInstanceInfo_t),
        (fake_nvml_mig.c_nvmlComputeInstanceProfileInfo_v2_t, real.c_nvmlComputeInstanceProfileInfo_v2_t),
        (fake_nvml_mig.c_nvmlComputeInstanceInfo_t, real.c_nvmlComputeInstanceInfo_t),
    ]:
        assert [f.name for f in fields(fake_struct)] == [name for name, _ in real_struct._fields_]
    for fake_struct, real_struct in [
        (fake_nvml_mig.c_nvmlGpuInstancePlacement_t, real.c_nvmlGpuInstancePlacement_t),
        (fake_nvml_mig.c_nvmlComputeInstancePlacement_t, real.c_nvmlComputeInstancePlacement_t),
    ]:
        assert fake_struct._fields_ == real_struct._fields_


def test_the_fake_wants_a_pointer_to_the_placement() -> None:
    """pynvml hands ``placement`` to C as it is: a bare struct would go by value."""
    fake = h100_node()
    fake.nvmlInit()
    gpu = fake.gpus[0]
    gpu.mig_enabled = True
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    placement = fake.c_nvmlGpuInstancePlacement_t(0, 1)
    with pytest.raises(TypeError, match="by value"):
        fake.nvmlDeviceCreateGpuInstanceWithPlacement(handle, 19, placement)
    gi = fake.nvmlDeviceCreateGpuInstanceWithPlacement(handle, 19, ctypes.byref(placement))
    assert fake.nvmlGpuInstanceGetInfo(gi).id == 7


# --- profiles in the inventory ---------------------------------------------------------------


async def load(fake: FakeNvml, tmp_path: Path) -> Inventory:
    backend = await opened(fake, tmp_path)
    try:
        return await backend.load()
    finally:
        await backend.close()


async def test_h100_profiles_and_placements_are_read_with_mig_off(tmp_path: Path) -> None:
    """MIG off: the V call refuses, version 1 answers (without a name, so names are built)."""
    fake = h100_node()
    inventory = await load(fake, tmp_path)
    gpu = inventory.gpus[0]
    assert not gpu.mig_enabled and gpu.mig_memory_slices == 8 and inventory.problems == ()
    by_id = {p.profile_id: p for p in gpu.mig_profiles}
    assert [by_id[i].name for i in (19, 20, 15, 14, 9, 5, 0)] == [
        "1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"
    ]  # fmt: skip
    three = by_id[9]
    assert (three.compute_slices, three.memory_slices, three.memory_mib, three.max_instances) == (3, 4, 40448, 2)
    assert three.placements == (MigPlacement(0, 4), MigPlacement(4, 4))
    assert (three.multiprocessors, three.copy_engines, three.decoders, three.jpeg_engines) == (60, 3, 3, 3)
    assert by_id[20].ofa_engines == 1 and by_id[0].placements == (MigPlacement(0, 8),)


async def test_names_come_from_nvml_when_it_gives_them(tmp_path: Path) -> None:
    fake = h100_node()
    fake.gpus[0].mig_enabled = True
    fake.gpus[0].mig.profiles = tuple(replace(p, name=f"{p.name}-named") for p in fake.gpus[0].mig.profiles)
    gpu = (await load(fake, tmp_path)).gpus[0]
    assert {p.name for p in gpu.mig_profiles} >= {"1g.10gb-named", "7g.80gb-named"}


async def test_a_gpu_without_mig_is_not_asked_for_profiles(tmp_path: Path) -> None:
    fake = h100_node()
    for gpu in fake.gpus:
        gpu.mig_enabled = None  # nvmlDeviceGetMigMode: NOT_SUPPORTED
    inventory = await load(fake, tmp_path)
    assert all(g.mig_profiles == () and g.mig_memory_slices == 0 for g in inventory.gpus)
    assert "nvmlDeviceGetGpuInstanceProfileInfo" not in fake.call_names()


async def test_the_enumeration_is_bounded(tmp_path: Path) -> None:
    fake = h100_node()
    await load(fake, tmp_path)
    calls = fake.call_names().count("nvmlDeviceGetGpuInstanceProfileInfo")
    # per GPU: each value below COUNT once or twice (V, then version 1), and one past the end
    assert calls <= 8 * (2 * fake_nvml_mig.NVML_GPU_INSTANCE_PROFILE_COUNT + 2)


@pytest.mark.parametrize("code", [NOT_SUPPORTED, FUNCTION_NOT_FOUND])
async def test_old_drivers_have_no_profiles_and_no_problem(tmp_path: Path, code: int) -> None:
    fake = h100_node()
    for gpu in fake.gpus:
        gpu.mig.errors["nvmlDeviceGetGpuInstanceProfileInfo"] = [code] * 200
    inventory = await load(fake, tmp_path)
    assert all(g.mig_profiles == () for g in inventory.gpus) and inventory.problems == ()


async def test_a_binding_without_the_call_has_no_profiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = h100_node()
    monkeypatch.setattr(type(fake), "nvmlDeviceGetGpuInstanceProfileInfo", None)
    inventory = await load(fake, tmp_path)
    assert len(inventory.gpus) == 8 and all(g.mig_profiles == () for g in inventory.gpus)


async def test_unreadable_profiles_are_a_problem_not_a_lost_gpu(tmp_path: Path) -> None:
    fake = h100_node()
    fake.gpus[1].mig.errors["nvmlDeviceGetGpuInstanceProfileInfo"] = [NO_PERMISSION]
    fake.gpus[2].mig.errors["nvmlDeviceGetGpuInstancePossiblePlacements"] = [NO_PERMISSION]
    inventory = await load(fake, tmp_path)
    gpus = inventory.gpus
    assert len(gpus) == 8 and gpus[1].mig_profiles == () and gpus[2].mig_profiles == ()
    assert gpus[0].mig_profiles and gpus[3].mig_profiles
    problems = inventory.problems
    assert len(problems) == 2 and all(
        "reading its MIG profiles" in p and "no MIG profiles listed" in p for p in problems
    )


async def test_a_gpu_lost_while_its_profiles_are_read_is_left_out(tmp_path: Path) -> None:
    fake = h100_node()
    fake.gpus[5].mig.errors["nvmlDeviceGetGpuInstancePossiblePlacements"] = [GPU_IS_LOST]
    inventory = await load(fake, tmp_path)
    assert len(inventory.gpus) == 7 and "GPU 5" in inventory.problems[0]


async def test_mig_devices_know_their_profile_and_placement(tmp_path: Path) -> None:
    fake = h100_node()
    fake.nvmlInit()
    gpu = fake.gpus[0]
    gpu.mig_enabled = True
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    for profile_id, start, size in [(9, 4, 4), (19, 1, 1)]:
        gi = fake.nvmlDeviceCreateGpuInstanceWithPlacement(
            handle, profile_id, ctypes.byref(fake.c_nvmlGpuInstancePlacement_t(start, size))
        )
        info = fake.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, {9: 2, 19: 0}[profile_id], 0)
        fake.nvmlGpuInstanceCreateComputeInstance(gi, info.id)
    fake.nvmlShutdown()
    migs = (await load(fake, tmp_path)).gpus[0].mig_devices
    assert [(m.profile, m.gpu_instance_id, m.profile_id, m.placement) for m in migs] == [
        ("3g.40gb", 2, 9, MigPlacement(4, 4)),
        ("1g.10gb", 8, 19, MigPlacement(1, 1)),
    ]


def test_profile_names_as_go_nvlib_builds_them() -> None:
    assert migread.profile_name("", 0x0, 1, 9984, 81559) == "1g.10gb"
    assert migread.profile_name("", 0x7, 1, 4864, 40960) == "1g.5gb+me"
    assert migread.profile_name("", 0x9, 1, 9856, 40960) == "1g.10gb"
    assert migread.profile_name("", 0x4, 7, 81152, 81559) == "7g.80gb"
    assert migread.profile_name("MIG 2g.20gb", 0x1, 2, 1, 81559) == "2g.20gb"
    assert migread.profile_name("garbage name", 0xD, 1, 5949, 24064) == "1g.6gb-me"


# --- making and destroying instances (agent/backends/nvml/mig.py) -----------------------------

IN_USE, INSUFFICIENT_RESOURCES, INVALID_ARGUMENT, UNKNOWN = 19, 23, 2, 999
MIG_CALLS = (
    "nvmlDeviceSetMigMode",
    "nvmlDeviceCreateGpuInstanceWithPlacement",
    "nvmlGpuInstanceCreateComputeInstance",
    "nvmlComputeInstanceDestroy",
    "nvmlGpuInstanceDestroy",
)


@contextlib.asynccontextmanager
async def node(tmp_path: Path, fake: FakeNvml | None = None) -> AsyncIterator[tuple[FakeNvml, NvmlBackend]]:
    fake = fake or h100_node()
    backend = await opened(fake, tmp_path)
    await backend.load()
    try:
        yield fake, backend
    finally:
        await backend.close()


async def mig_refused(coro: Any, kind: PartitionErrorKind, *words: str) -> str:
    with pytest.raises(PartitionError) as info:
        await coro
    message = single_line(info.value)
    assert info.value.kind is kind, message
    assert all(word in message for word in words), message
    return message


async def test_create_switches_mig_on_and_makes_a_whole_device(tmp_path: Path) -> None:
    async with node(tmp_path) as (fake, backend):
        gpu = fake.gpus[0]
        mig = await backend.mig.create(gpu.uuid, 9, MigPlacement(4, 4))
        assert (mig.parent_uuid, mig.index, mig.gpu_instance_id, mig.compute_instance_id) == (gpu.uuid, 0, 2, 0)
        assert (mig.profile, mig.profile_id, mig.placement, mig.memory_mib) == ("3g.40gb", 9, MigPlacement(4, 4), 40448)
        assert (mig.gi_cap_minor, mig.ci_cap_minor) == (mig_minor(0, 2), mig_minor(0, 2, 0))
        assert mig.uuid.startswith("MIG-") and gpu.mig_enabled and gpu.mig.toggles == [1]
        ci = gpu.mig.instances[2].cis[0]
        assert ci.slices == 3  # the compute instance spans the GPU instance
        listed = (await backend.load()).gpus[0]
        assert listed.mig_enabled and listed.mig_devices == (mig,)
        assert await backend.mig.instances(gpu.uuid) == (mig,)
        assert backend.status()["mig"] == {"switched_on": [gpu.uuid], "cleanups": 0}

        await backend.mig.destroy(gpu.uuid, 2, 0)
        assert gpu.mig.instances == {} and gpu.mig.toggles == [1, 0] and not gpu.mig_enabled
        assert await backend.mig.instances(gpu.uuid) == ()
        calls = [name for name in fake.call_names() if name in MIG_CALLS]
        assert calls == [
            "nvmlDeviceSetMigMode",
            "nvmlDeviceCreateGpuInstanceWithPlacement",
            "nvmlGpuInstanceCreateComputeInstance",
            "nvmlComputeInstanceDestroy",
            "nvmlGpuInstanceDestroy",
            "nvmlDeviceSetMigMode",
        ]
        loop_thread = threading.get_ident()
        assert all(tid != loop_thread for name, tid in fake.calls if name in MIG_CALLS)


async def test_a_compute_instance_failure_leaves_no_gpu_instance_behind(tmp_path: Path) -> None:
    async with node(tmp_path) as (fake, backend):
        gpu = fake.gpus[1]
        gpu.mig.errors["nvmlGpuInstanceCreateComputeInstance"] = [INSUFFICIENT_RESOURCES]
        await mig_refused(
            backend.mig.create(gpu.uuid, 14, MigPlacement(2, 2)),
            PartitionErrorKind.INSUFFICIENT_RESOURCES,
            f"GPU 1 ({gpu.uuid}): creating MIG 2g.20gb at 2:2: its compute instance",
        )
        assert gpu.mig.instances == {} and gpu.migs == {}
        assert gpu.mig.toggles == [1, 0] and not gpu.mig_enabled  # MIG mode back as it was
        assert "nvmlGpuInstanceDestroy" in fake.call_names()


@pytest.mark.parametrize(
    ("code", "kind", "words"),
    [
        (IN_USE, PartitionErrorKind.IN_USE, "In use by another client"),
        (INSUFFICIENT_RESOURCES, PartitionErrorKind.INSUFFICIENT_RESOURCES, "Ran out of critical resources"),
        (NOT_SUPPORTED, PartitionErrorKind.NOT_SUPPORTED, "Not Supported"),
        (INVALID_ARGUMENT, PartitionErrorKind.NOT_SUPPORTED, "does not offer"),
        (NO_PERMISSION, PartitionErrorKind.NOT_SUPPORTED, "CAP_SYS_ADMIN"),
        (GPU_IS_LOST, PartitionErrorKind.GPU_LOST, "GPU is lost"),
        (6, PartitionErrorKind.NOT_FOUND, "Not Found"),
        (UNKNOWN, PartitionErrorKind.FAILED, "Unknown Error"),
    ],
)
async def test_nvml_codes_become_kinds(tmp_path: Path, code: int, kind: PartitionErrorKind, words: str) -> None:
    async with node(tmp_path) as (fake, backend):
        gpu = fake.gpus[0]
        gpu.mig.errors["nvmlDeviceCreateGpuInstanceWithPlacement"] = [code]
        message = await mig_refused(backend.mig.create(gpu.uuid, 19, MigPlacement(3, 1)), kind, words)
        assert message.startswith(f"GPU 0 ({gpu.uuid}): creating MIG 1g.10gb at 3:1: ")
        assert f"(NVML error {code})" in message
        assert gpu.mig.instances == {} and not gpu.mig_enabled


async def test_the_hardware_refuses_what_does_not_fit(tmp_path: Path) -> None:
    async with node(tmp_path) as (fake, backend):
        uuid = fake.gpus[0].uuid
        await backend.mig.create(uuid, 9, MigPlacement(0, 4))
        await mig_refused(backend.mig.create(uuid, 5, MigPlacement(0, 4)), PartitionErrorKind.INSUFFICIENT_RESOURCES)
        await mig_refused(backend.mig.create(uuid, 19, MigPlacement(7, 1)), PartitionErrorKind.NOT_SUPPORTED)
        await mig_refused(
            backend.mig.create(uuid, 77, MigPlacement(0, 1)), PartitionErrorKind.NOT_SUPPORTED, "no profile ID 77"
        )
        assert len(fake.gpus[0].mig.instances) == 1 and fake.gpus[0].mig_enabled  # the first one stays


async def test_mig_mode_off_on_ampere_or_pending_is_mig_disabled(tmp_path: Path) -> None:
    fake = h100_node()
    fake.gpus[0].arch = fake_pynvml.NVML_DEVICE_ARCH_AMPERE
    async with node(tmp_path, fake) as (fake, backend):
        await mig_refused(
            backend.mig.create(fake.gpus[0].uuid, 19, MigPlacement(0, 1)), PartitionErrorKind.MIG_DISABLED, "reset"
        )
        assert fake.gpus[0].mig.toggles == []


async def test_processes_on_the_gpu_keep_mig_mode_off(tmp_path: Path) -> None:
    async with node(tmp_path) as (fake, backend):
        gpu = fake.gpus[0]
        gpu.mig.toggle_status = IN_USE  # nvmlDeviceSetMigMode's activation status, not an exception
        await mig_refused(
            backend.mig.create(gpu.uuid, 19, MigPlacement(0, 1)), PartitionErrorKind.IN_USE, "switching MIG mode on"
        )
        assert not gpu.mig_enabled and gpu.mig.instances == {}


async def test_a_gpu_already_in_mig_mode_stays_there(tmp_path: Path) -> None:
    fake = h100_node()
    fake.gpus[0].mig_enabled = True
    async with node(tmp_path, fake) as (fake, backend):
        mig = await backend.mig.create(fake.gpus[0].uuid, 0, MigPlacement(0, 8))
        await backend.mig.destroy(fake.gpus[0].uuid, mig.gpu_instance_id, mig.compute_instance_id)
        assert fake.gpus[0].mig_enabled and fake.gpus[0].mig.toggles == []


async def test_destroy_in_use_and_half_destroyed(tmp_path: Path) -> None:
    async with node(tmp_path) as (fake, backend):
        gpu = fake.gpus[0]
        mig = await backend.mig.create(gpu.uuid, 14, MigPlacement(0, 2))
        gpu.mig.errors["nvmlComputeInstanceDestroy"] = [IN_USE]
        await mig_refused(backend.mig.destroy(gpu.uuid, mig.gpu_instance_id, 0), PartitionErrorKind.IN_USE)
        assert gpu.migs  # nothing destroyed
        gpu.mig.errors["nvmlGpuInstanceDestroy"] = [IN_USE]
        await mig_refused(backend.mig.destroy(gpu.uuid, mig.gpu_instance_id, 0), PartitionErrorKind.IN_USE)
        assert gpu.migs == {} and gpu.mig.instances  # the compute instance went, the GPU instance stayed
        await backend.mig.destroy(gpu.uuid, mig.gpu_instance_id, 0)  # a retry finishes the job
        assert gpu.mig.instances == {} and not gpu.mig_enabled
        await mig_refused(
            backend.mig.destroy(gpu.uuid, mig.gpu_instance_id, 0), PartitionErrorKind.NOT_FOUND, "already gone"
        )


async def test_unknown_gpus_and_a_closed_backend(tmp_path: Path) -> None:
    async with node(tmp_path) as (_, backend):
        await mig_refused(backend.mig.create("GPU-nope", 19, MigPlacement(0, 1)), PartitionErrorKind.NOT_FOUND)
        await mig_refused(backend.mig.instances("GPU-nope"), PartitionErrorKind.NOT_FOUND)
    fresh = NvmlBackend(health=CHECKS, nvml=h100_node())
    await mig_refused(fresh.mig.create("GPU-x", 19, MigPlacement(0, 1)), PartitionErrorKind.FAILED, "not open")


async def test_a_cancelled_create_destroys_what_it_made(tmp_path: Path) -> None:
    async with node(tmp_path) as (fake, backend):
        gpu = fake.gpus[3]
        gpu.mig.hang = threading.Event()
        task = asyncio.create_task(backend.mig.create(gpu.uuid, 19, MigPlacement(2, 1)))
        assert await asyncio.to_thread(gpu.mig.entered.wait, TIMEOUT)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gpu.mig.hang.set()  # NVML finishes the create after all
        await until(lambda: "nvmlGpuInstanceDestroy" in fake.call_names())
        await backend.mig.close()  # type: ignore[attr-defined]  # waits for the clean-up
        assert gpu.mig.instances == {} and gpu.migs == {} and not gpu.mig_enabled
