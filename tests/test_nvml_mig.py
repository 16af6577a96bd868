"""MIG through NVML over the fake pynvml: profiles and placements in the inventory, and the fake's
MIG functions themselves (tests/fakes/fake_nvml_mig.py) against the real binding's names."""

from __future__ import annotations

import ctypes
from dataclasses import fields, replace
from pathlib import Path

import pytest

from agent.backends.nvml import migread
from agent.core.inventory.model import Inventory, MigPlacement
from tests.fakes import fake_nvml_mig
from tests.fakes.fake_pynvml import FakeNvml, h100_node
from tests.nvml_fixtures import opened

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
