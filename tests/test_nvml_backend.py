"""The NVML backend over a fake pynvml (tests/fakes/fake_pynvml.py): finding the library under
the driver root, open/close, the factory, and the inventory read device by device."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from dataclasses import fields
from pathlib import Path

import pytest

from agent.backends import ldcache
from agent.backends.backend import NullBackend
from agent.backends.factory import open_backend
from agent.backends.nvml.backend import NvmlBackend
from agent.base.errors import BackendError, LibraryMissingError
from agent.core.config.schema import Config, HealthConfig, PathsConfig
from agent.core.inventory.model import PcieLevel
from tests.fakes import fake_pynvml
from tests.fakes.fake_pynvml import FakeNvml, a100_mig_node, gh200_node, h100_node
from tests.nvml_fixtures import CHECKS, backend, mig_minor, opened, single_line, stand_in_library

LIB_DIR = "usr/lib/x86_64-linux-gnu"

# --- the fake itself ----------------------------------------------------------------------


def test_fake_matches_real_pynvml() -> None:
    real = pytest.importorskip("pynvml")
    fake = h100_node()
    for name in dir(fake_pynvml):
        if name.startswith(
            ("NVML_ERROR_", "NVML_TOPOLOGY_", "NVML_DEVICE_ARCH_", "NVML_NVLINK_", "NVML_BRAND_", "nvmlEventType")
        ):
            assert getattr(real, name) == getattr(fake_pynvml, name), name
        if name.startswith("NVMLError_"):
            assert hasattr(real, name), name
    for name in dir(type(fake)):
        if name.startswith("nvml"):
            assert callable(getattr(real, name, None)), f"pynvml has no {name}"
    real_fields = [name for name, _ in real.c_nvmlEventData_t._fields_]
    assert real_fields == [f.name for f in fields(fake_pynvml.c_nvmlEventData_t)]
    assert type(fake.NVMLError(fake.NVML_ERROR_GPU_IS_LOST)) is fake.NVMLError_GpuIsLost
    assert type(real.NVMLError(real.NVML_ERROR_GPU_IS_LOST)).__name__ == "NVMLError_GpuIsLost"
    # the library hook the backend loads through exists in the real binding
    assert "nvmlLib" in vars(real) and hasattr(real, "libLoadLock")


def test_fake_handle_by_uuid_fails_for_every_gpu_while_one_is_lost() -> None:
    fake = h100_node()
    fake.nvmlInit()
    fake.gpus[3].lost = True
    with pytest.raises(fake.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetHandleByUUID(fake.gpus[0].uuid)  # nvml.h: "if any GPU has fallen off the bus"
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    assert fake.nvmlDeviceGetUUID(handle) == fake.gpus[0].uuid  # its own handle still answers
    with pytest.raises(fake.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetHandleByIndex(3)


# --- finding and loading the library ------------------------------------------------------


def _library(driver_root: Path, directory: str = LIB_DIR) -> Path:
    """libnvidia-ml.so.1 under the driver root: a link to a real ELF, as a driver install has it."""
    lib = driver_root / directory
    lib.mkdir(parents=True, exist_ok=True)
    real = lib / "libnvidia-ml.so.550.54.15"
    shutil.copyfile(stand_in_library(), real)  # a copy: a link out of the root would not resolve in it
    (lib / "libnvidia-ml.so.1").symlink_to("libnvidia-ml.so.550.54.15")
    return real


async def test_library_only_under_the_driver_root_is_found_and_loaded(tmp_path: Path) -> None:
    fake = h100_node(library_missing=True)  # not on the loader path, like in a DaemonSet pod
    b = backend(fake, tmp_path, required=True)
    _library(tmp_path / "driver-root")
    await b.open()
    inventory = await b.load()
    status = b.status()
    await b.close()
    assert len(inventory.gpus) == 8 and inventory.reason == ""
    assert fake.nvmlLib is not None and not isinstance(fake.nvmlLib, str)  # our CDLL, not the default
    assert status["state"] == "ready" and b.status()["state"] == "closed"
    assert status["library"] == str(tmp_path / "driver-root" / LIB_DIR / "libnvidia-ml.so.550.54.15")


async def test_library_named_by_the_driver_roots_linker_cache(tmp_path: Path) -> None:
    fake = h100_node(library_missing=True)
    b = backend(fake, tmp_path)
    root = tmp_path / "driver-root"
    _library(root, "opt/nvidia/lib")  # not one of the usual directories
    (root / "etc").mkdir()
    (root / "etc/ld.so.cache").write_bytes(ldcache.build([("libnvidia-ml.so.1", "/opt/nvidia/lib/libnvidia-ml.so.1")]))
    await b.open()
    assert len(await b.load()) == 8
    await b.close()


async def test_waits_for_the_driver_then_serves_its_gpus_without_a_restart(tmp_path: Path) -> None:
    """A driver container becomes ready after the agent: no GPUs (with the reason), then GPUs."""
    fake = h100_node(library_missing=True)
    b = backend(fake, tmp_path, required=True)
    await b.open()  # no error: the driver may still come
    first = await b.load()
    assert first.gpus == () and first.backend == "nvml"
    assert "libnvidia-ml.so.1 not found under" in single_line(first.reason)
    assert str(tmp_path / "driver-root") in first.reason
    ready, detail = b.readiness()
    assert not ready and "waiting for NVML" in single_line(detail)
    assert b.status()["state"] == "waiting"

    _library(tmp_path / "driver-root")
    second = await b.load()
    assert len(second.gpus) == 8 and second.reason == ""
    assert b.readiness()[0]
    await b.close()
    assert fake.shutdown_calls == 1


async def test_auto_mode_is_ready_while_it_waits(tmp_path: Path) -> None:
    b = backend(h100_node(library_missing=True), tmp_path, required=False)
    await b.open()
    assert (await b.load()).gpus == ()
    ready, detail = b.readiness()
    assert ready and "waiting for NVML" in detail
    await b.close()


async def test_a_file_that_is_not_a_library_is_reported(tmp_path: Path) -> None:
    fake = h100_node(library_missing=True)
    b = backend(fake, tmp_path)
    lib = tmp_path / "driver-root" / LIB_DIR
    lib.mkdir(parents=True)
    (lib / "libnvidia-ml.so.1").write_text("not an ELF file")
    await b.open()
    inventory = await b.load()
    assert inventory.gpus == () and "cannot load" in single_line(inventory.reason)
    await b.close()


async def test_init_failure_is_the_reason_and_is_retried(tmp_path: Path) -> None:
    fake = h100_node(init_error=fake_pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    b = backend(fake, tmp_path)
    await b.open()
    inventory = await b.load()
    assert inventory.gpus == () and "Driver Not Loaded" in single_line(inventory.reason)
    fake.init_error = None  # the kernel module is loaded now
    assert len(await b.load()) == 8
    await b.close()
    assert b.status()["init_attempts"] == 3  # open, the first load, the second load


async def test_default_module_is_pynvml_imported_in_open(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = FakeNvml([])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    b = NvmlBackend(health=CHECKS, driver_root=tmp_path)
    await b.open()
    assert fake.init_count == 1
    await b.close()
    assert fake.shutdown_calls == 1


async def test_binding_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes "import pynvml" raise ImportError
    with pytest.raises(LibraryMissingError) as info:
        await NvmlBackend(health=CHECKS).open()
    assert "nvidia-ml-py" in single_line(info.value)


def test_importing_the_backend_does_not_import_pynvml() -> None:
    code = "import sys, agent.backends.nvml.backend, agent.backends.factory; assert 'pynvml' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


async def test_close_is_idempotent_and_load_needs_open(tmp_path: Path) -> None:
    fake = h100_node()
    b = backend(fake, tmp_path)
    with pytest.raises(BackendError):
        await b.load()
    await b.open()
    await b.close()
    await b.close()
    assert fake.shutdown_calls == 1 and fake.init_count == 0


# --- the factory ----------------------------------------------------------------------------


def _config(backend_name: str, tmp_path: Path) -> Config:
    return Config(backend=backend_name, paths=PathsConfig(driver_root=tmp_path))  # type: ignore[arg-type]


async def test_factory_nvml_without_a_driver_opens_and_is_not_ready(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", h100_node(library_missing=True))
    b = await open_backend(_config("nvml", tmp_path))
    assert isinstance(b, NvmlBackend) and (await b.load()).gpus == ()
    assert b.readiness()[0] is False
    await b.close()


async def test_factory_auto_without_a_driver_keeps_looking(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = h100_node(library_missing=True)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    b = await open_backend(_config("auto", tmp_path))
    assert isinstance(b, NvmlBackend) and b.readiness()[0]
    assert (await b.load()).gpus == ()
    _library(tmp_path)
    assert len(await b.load()) == 8
    await b.close()


async def test_factory_without_the_binding(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    auto = await open_backend(_config("auto", tmp_path))
    assert isinstance(auto, NullBackend)
    inventory = await auto.load()
    assert inventory.gpus == () and "nvidia-ml-py" in inventory.reason
    with pytest.raises(LibraryMissingError):
        await open_backend(_config("nvml", tmp_path))


# --- inventory -------------------------------------------------------------------------------


async def test_h100_node_inventory(tmp_path: Path) -> None:
    fake = h100_node()
    b = await opened(fake, tmp_path)
    inventory = await b.load()
    await b.close()

    assert threading.get_ident() not in fake.call_threads()  # nothing ran on the loop thread
    assert (inventory.backend, inventory.driver_version, inventory.cuda_driver_version) == ("nvml", "550.54.15", "12.4")
    assert [g.index for g in inventory] == list(range(8))
    gpu = inventory.gpus[1]
    assert gpu.uuid == fake.gpus[1].uuid
    assert (gpu.minor, gpu.product_name, gpu.architecture, gpu.compute_capability, gpu.brand) == (
        1,
        "NVIDIA H100 80GB HBM3",
        "hopper",
        "9.0",
        "Nvidia",
    )
    assert (gpu.memory_mib, gpu.pci_bus_id, gpu.short_bus_id) == (81559, "00000000:2A:00.0", "0000:2a:00.0")
    assert [g.numa_node for g in inventory] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [g.pcie_root for g in inventory] == ["pci0000:00"] * 4 + ["pci0000:80"] * 4
    assert not any(g.mig_enabled or g.mig_devices for g in inventory)
    assert inventory.problems == ()

    uuids = [g.uuid for g in inventory]
    assert len(inventory.links) == 28
    for i, a in enumerate(uuids):
        for j, b2 in enumerate(uuids[i + 1 :], start=i + 1):
            link = inventory.link(a, b2)
            assert link.nvlinks == 18, (i, j)
            same_switch, same_socket = i // 2 == j // 2, i // 4 == j // 4
            expected = PcieLevel.SINGLE if same_switch else PcieLevel.NODE if same_socket else PcieLevel.SYSTEM
            assert link.pcie is expected, (i, j)
    assert inventory.link(uuids[0], uuids[7]).describe() == "NV18"


async def test_a100_mig_node_inventory(tmp_path: Path) -> None:
    fake = a100_mig_node()
    b = await opened(fake, tmp_path)
    inventory = await b.load()
    await b.close()

    assert [g.numa_node for g in inventory] == [0, 0, 1, None]  # -1 in sysfs means none
    assert {(g.architecture, g.compute_capability, g.memory_mib) for g in inventory} == {("ampere", "8.0", 40960)}
    assert [g.mig_enabled for g in inventory] == [True, True, False, True]

    gpu0 = inventory.gpus[0]
    rows = [(m.index, m.profile, m.gpu_instance_id, m.compute_instance_id, m.memory_mib) for m in gpu0.mig_devices]
    assert rows == [
        (0, "3g.20gb", 1, 0, 19968),
        (2, "2g.10gb", 5, 0, 9856),
        (4, "1g.5gb", 13, 0, 4864),
        (5, "1g.5gb", 14, 0, 4864),
    ]
    for mig in gpu0.mig_devices:
        assert mig.parent_uuid == gpu0.uuid
        # capability minors are keyed by the parent's minor (2), not its index (0)
        assert mig.gi_cap_minor == mig_minor(2, mig.gpu_instance_id)
        assert mig.ci_cap_minor == mig_minor(2, mig.gpu_instance_id, mig.compute_instance_id)
    assert [m.profile for m in inventory.gpus[1].mig_devices] == ["7g.40gb"]
    assert inventory.gpus[2].mig_devices == ()
    assert [m.profile for m in inventory.gpus[3].mig_devices] == ["2g.10gb"]  # derived: name has no profile
    assert inventory.find_mig(gpu0.mig_devices[2].uuid) == gpu0.mig_devices[2]

    uuids = [g.uuid for g in inventory]
    assert {inventory.link(a, c).nvlinks for a in uuids for c in uuids if a < c} == {4}
    assert inventory.link(uuids[0], uuids[1]).pcie is PcieLevel.SINGLE
    assert inventory.link(uuids[1], uuids[2]).pcie is PcieLevel.SYSTEM


async def test_mig_minors_and_sysfs_facts_unknown_without_their_files(tmp_path: Path) -> None:
    b = await opened(a100_mig_node(), tmp_path, sysfs=False, mig_minors=False)
    inventory = await b.load()
    await b.close()
    migs = [m for g in inventory for m in g.mig_devices]
    assert migs and all(m.gi_cap_minor is None and m.ci_cap_minor is None for m in migs)
    assert all(g.numa_node is None and g.pcie_root is None for g in inventory)


async def test_grace_numa_node_is_the_cpu_side_node_from_sysfs(tmp_path: Path) -> None:
    """On GH200/GB200 NVML names the GPU's own memory node (no CPUs); the kubelet needs the CPU's."""
    fake = gh200_node()
    b = await opened(fake, tmp_path)
    inventory = await b.load()
    await b.close()
    assert fake.gpus[0].nvml_numa_node == 1
    assert inventory.gpus[0].numa_node == 0
    assert inventory.gpus[0].pcie_root == "pci0009:00"
    assert "nvmlDeviceGetNumaNodeId" not in fake.call_names()


@pytest.mark.parametrize(
    ("brand", "expected"),
    [(fake_pynvml.NVML_BRAND_TESLA, "Tesla"), (fake_pynvml.NVML_BRAND_NVIDIA_RTX, "NvidiaRTX"), (99, "")],
)
async def test_brand_as_nvidias_dra_driver_spells_it(tmp_path: Path, brand: int, expected: str) -> None:
    fake = gh200_node()
    fake.gpus[0].brand = brand
    b = await opened(fake, tmp_path)
    assert (await b.load()).gpus[0].brand == expected
    await b.close()


# --- reading device by device ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("knob", "value", "problem"),
    [
        ("no_permission", True, "GPU 2: getting its handle: Insufficient Permissions (NVML error 4)"),
        ("lost", True, "GPU 2: getting its handle: GPU is lost (NVML error 15)"),
    ],
)
async def test_one_unreadable_gpu_leaves_the_others(tmp_path: Path, knob: str, value: object, problem: str) -> None:
    fake = h100_node()
    setattr(fake.gpus[2], knob, value)
    b = await opened(fake, tmp_path)
    inventory = await b.load()
    await b.close()
    assert [g.index for g in inventory] == [0, 1, 3, 4, 5, 6, 7]  # indexes stay NVML's
    assert inventory.problems == (problem,)
    assert len(inventory.links) == 21
    assert b.status()["problems"] == [problem]


async def test_integrated_gpu_without_memory_info(tmp_path: Path) -> None:
    fake = gh200_node()
    fake.gpus[0].memory_supported = False  # NOT_SUPPORTED, as integrated GPUs answer
    b = await opened(fake, tmp_path)
    inventory = await b.load()
    await b.close()
    assert inventory.gpus[0].memory_mib == 0 and inventory.problems == ()


async def test_mig_slots_answering_invalid_argument_are_empty(tmp_path: Path) -> None:
    fake = a100_mig_node()
    fake.gpus[0].invalid_mig_slots = frozenset({1, 3, 6})  # go-nvlib skips these like NOT_FOUND
    b = await opened(fake, tmp_path)
    inventory = await b.load()
    await b.close()
    assert [m.index for m in inventory.gpus[0].mig_devices] == [0, 2, 4, 5]
    assert inventory.problems == ()


async def test_a_mig_device_that_cannot_be_read_is_left_out(tmp_path: Path) -> None:
    fake = a100_mig_node()
    original = fake.nvmlDeviceGetComputeInstanceId

    def refuse_one(handle: fake_pynvml.Handle) -> int:
        if handle.mig is not None and handle.mig.gi == 5:
            raise fake.NVMLError(fake.NVML_ERROR_NO_PERMISSION)
        return original(handle)

    fake.nvmlDeviceGetComputeInstanceId = refuse_one  # type: ignore[method-assign]
    b = await opened(fake, tmp_path)
    inventory = await b.load()
    await b.close()
    assert [m.gpu_instance_id for m in inventory.gpus[0].mig_devices] == [1, 13, 14]
    assert len(inventory.problems) == 1
    assert "MIG device 2: reading its compute instance id" in inventory.problems[0]
    assert "MIG device left out" in inventory.problems[0]


async def test_a_gpu_lost_after_a_good_read_keeps_its_record(tmp_path: Path) -> None:
    fake = h100_node()
    b = await opened(fake, tmp_path)
    first = await b.load()
    fake.gpus[5].lost = True
    second = await b.load()
    await b.close()
    assert second.gpus == first.gpus  # still listed: its health check reports it lost
    assert second.links == first.links
    assert len(second.problems) == 1 and "GPU 5" in second.problems[0]
    assert "keeping its last known record" in second.problems[0]


async def test_node_wide_failure(tmp_path: Path) -> None:
    """Before a first good read the failure is the empty inventory's reason; after, an error."""
    fake = h100_node()
    b = await opened(fake, tmp_path)
    good = fake.nvmlDeviceGetCount
    fake.nvmlDeviceGetCount = lambda: (_ for _ in ()).throw(fake.NVMLError(fake.NVML_ERROR_UNKNOWN))  # type: ignore[method-assign]
    first = await b.load()
    assert first.gpus == () and "counting GPUs: Unknown Error" in single_line(first.reason)
    fake.nvmlDeviceGetCount = good  # type: ignore[method-assign]
    assert len(await b.load()) == 8
    fake.nvmlDeviceGetCount = lambda: (_ for _ in ()).throw(fake.NVMLError(fake.NVML_ERROR_UNKNOWN))  # type: ignore[method-assign]
    with pytest.raises(BackendError, match="counting GPUs"):
        await b.load()  # the caller keeps the inventory it has
    await b.close()


def test_status_and_readiness_are_json_ready(tmp_path: Path) -> None:
    import json

    b = backend(h100_node(), tmp_path, required=True)
    json.dumps(b.status())
    assert b.readiness() == (False, "waiting for NVML: not tried yet")
    assert NullBackend("why").readiness() == (True, "why")
    assert os.fspath(tmp_path) in str(b.status()["driver_root"])


async def test_health_config_default_is_used_until_updated(tmp_path: Path) -> None:
    b = backend(h100_node(), tmp_path)
    b.update_health_config(HealthConfig(check_interval_s=7, event_wait_ms=300))
    health = b.status()["health"]
    assert health == {"enabled": True, "check_interval_s": 7, "event_wait_ms": 300}


async def test_inventory_views_show_what_could_not_be_read(tmp_path: Path) -> None:
    from agent.core.inventory.model import Inventory
    from agent.core.inventory.render import inventory_json, inventory_table

    fake = h100_node()
    fake.gpus[6].no_permission = True
    b = await opened(fake, tmp_path)
    inventory = await b.load()
    await b.close()
    table = inventory_table(inventory)
    assert "could not read:" in table and "GPU 6: getting its handle: Insufficient Permissions" in table
    doc = inventory_json(inventory)
    assert doc["problems"] == list(inventory.problems) and doc["gpus"][0]["pcie_root"] == "pci0000:00"
    empty = inventory_table(Inventory.empty("nvml", reason="libnvidia-ml.so.1 not found under /driver-root"))
    assert "no GPUs on this node: libnvidia-ml.so.1 not found under /driver-root" in empty
