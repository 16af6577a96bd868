"""Simulated GPUs on a node without a driver: env-only CDI specs, same names, same repairs.

A node counts as "without a driver" when the driver root exists and holds no NVIDIA driver
libraries; the fixtures' inventories are all ``backend="simulated"``, so the driver root
alone decides the mode here (an NVML inventory is built explicitly where it matters).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from agent.cdi import spec as s
from agent.cdi.discovery import DriverDiscovery
from agent.cdi.driversource import SIMULATED_ENV, choose_driver_source
from agent.cdi.errors import DriverDiscoveryError
from agent.cdi.service import CdiService
from agent.cli import cdi as cli
from agent.core.config.schema import CdiConfig
from agent.core.inventory.current import InventoryState
from agent.core.inventory.model import Inventory
from tests.cdi_fixtures import LIB_DIR, VERSION, FakeDriver, inventory, mig, prepare_claim, unprepare_claim
from tests.test_cdi_service import CLAIM_FILE, DP_FILE, PERIOD, SLACK, UID, load, repairs, wait_for

KIND = "k8s.gpu-node-agent.nvidia.com/gpu"
CLAIM_KIND = "k8s.gpu-node-agent.nvidia.com/claim"
WITH_MIG = inventory(2, migs={1: (mig(1, 0, 21, 22), mig(1, 1, 23, 24))})


@pytest.fixture
def empty_root(tmp_path: Path) -> Path:
    """A driver root like a kind node's or a laptop's /: libraries, but none of NVIDIA's."""
    lib = tmp_path / "root" / LIB_DIR.lstrip("/")
    lib.mkdir(parents=True)
    (lib / "libz.so.1").write_bytes(b"not nvidia")
    return tmp_path / "root"


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def make_service(
    tmp_path: Path, driver_root: Path, inv: Inventory = WITH_MIG, registry: CollectorRegistry | None = None
) -> CdiService:
    return CdiService(
        config=CdiConfig(reconcile_interval_s=PERIOD),
        cdi_root=tmp_path / "cdi",
        driver_root=driver_root,
        inventory=InventoryState(inv),
        registry=registry,
        hook_candidates=[],
    )


def env_of(spec: s.Spec, name: str) -> tuple[str, ...]:
    (device,) = [d for d in spec.devices if d.name == name]
    return device.container_edits.env


def assert_env_only(spec: s.Spec) -> None:
    for edits in (spec.container_edits, *(d.container_edits for d in spec.devices)):
        assert not (edits.device_nodes or edits.mounts or edits.hooks), edits
        assert not any(e.startswith("NVIDIA_") for e in edits.env), edits.env
    assert all(d.container_edits.env for d in spec.devices)  # every device has an edit (CDI rule)


# --- choosing the mode -------------------------------------------------------------------


def _no_libraries(tmp: Path) -> Path:
    (tmp / "root").mkdir()
    return tmp / "root"


def _other_libraries(tmp: Path) -> Path:
    (tmp / "root" / LIB_DIR.lstrip("/")).mkdir(parents=True)
    (tmp / "root" / LIB_DIR.lstrip("/") / "libz.so.1").write_bytes(b"z")
    return tmp / "root"


def _fake_driver(tmp: Path) -> Path:
    return FakeDriver(tmp / "root").build().root


def _broken_driver(tmp: Path) -> Path:  # libnvidia-ml but no libcuda: a driver, just a broken one
    driver = FakeDriver(tmp / "root").build()
    driver.host(f"{LIB_DIR}/libcuda.so.{VERSION}").unlink()
    return driver.root


def _missing(tmp: Path) -> Path:  # a mistyped --driver-root is reported, not papered over
    return tmp / "nope"


@pytest.mark.parametrize(
    ("backend", "root", "mode"),
    [
        ("simulated", _no_libraries, "simulated"),
        ("simulated", _other_libraries, "simulated"),
        ("simulated", _fake_driver, "installed"),
        ("simulated", _broken_driver, "installed"),
        ("simulated", _missing, "installed"),
        ("nvml", _no_libraries, "installed"),
        ("nvml", _fake_driver, "installed"),
    ],
)
def test_choose_driver_source(tmp_path: Path, backend: str, root: Callable[[Path], Path], mode: str) -> None:
    assert choose_driver_source(backend, DriverDiscovery(root(tmp_path), hook_candidates=[])).mode == mode


async def test_nvml_node_without_driver_is_still_an_error(tmp_path: Path, empty_root: Path) -> None:
    service = make_service(tmp_path, empty_root, dataclasses.replace(WITH_MIG, backend="nvml"))
    with pytest.raises(DriverDiscoveryError, match="no NVIDIA driver libraries"):
        await service.ensure_device_plugin_spec()
    assert service.debug_state()["driver_mode"] == "installed"


# --- spec content ------------------------------------------------------------------------


async def test_device_plugin_spec_is_env_only_and_valid(tmp_path: Path, empty_root: Path) -> None:
    service = make_service(tmp_path, empty_root)
    await service.ensure_device_plugin_spec()
    spec = load(tmp_path / "cdi" / DP_FILE)
    assert spec.kind == KIND
    assert s.validate(spec) == [] and spec.version == s.minimum_version(spec) == "0.5.0"  # "0" starts with a digit
    assert_env_only(spec)
    assert spec.container_edits.env == (SIMULATED_ENV,)
    g0, g1 = WITH_MIG.gpus
    m10, m11 = g1.mig_devices
    assert env_of(spec, g0.uuid) == env_of(spec, "0") == (f"GPU_AGENT_SIMULATED_GPU_0={g0.uuid}",)
    assert env_of(spec, g1.uuid) == env_of(spec, "1") == (f"GPU_AGENT_SIMULATED_GPU_1={g1.uuid}",)
    assert env_of(spec, m11.uuid) == env_of(spec, "1:1") == (f"GPU_AGENT_SIMULATED_MIG_1_1={m11.uuid}",)
    assert set(env_of(spec, "all")) == {
        f"GPU_AGENT_SIMULATED_GPU_0={g0.uuid}",
        f"GPU_AGENT_SIMULATED_GPU_1={g1.uuid}",
        f"GPU_AGENT_SIMULATED_MIG_1_0={m10.uuid}",
        f"GPU_AGENT_SIMULATED_MIG_1_1={m11.uuid}",
    }
    assert s.loads(s.dumps(spec)) == spec  # strict parsing accepts what we write
    state = service.debug_state()
    assert state["driver_mode"] == "simulated" and state["skipped_devices"] == []


async def test_names_and_files_match_the_real_spec(tmp_path: Path, empty_root: Path) -> None:
    """The device plugin and DRA code cannot tell the modes apart: same files, kinds, names."""
    driver = FakeDriver(tmp_path / "driver", cap_minors=(21, 22, 23, 24)).build()
    real = make_service(tmp_path / "real", driver.root)
    simulated = make_service(tmp_path / "sim", empty_root)
    specs = {}
    for label, service in (("real", real), ("sim", simulated)):
        await service.ensure_device_plugin_spec()
        await prepare_claim(service, UID, [WITH_MIG.gpus[0].uuid, WITH_MIG.gpus[1].mig_devices[0].uuid])
        assert sorted(p.name for p in (tmp_path / label / "cdi").iterdir()) == sorted([DP_FILE, CLAIM_FILE])
        specs[label] = [load(tmp_path / label / "cdi" / name) for name in (DP_FILE, CLAIM_FILE)]
    assert real.debug_state()["driver_mode"] == "installed"
    for real_spec, sim_spec in zip(specs["real"], specs["sim"], strict=True):
        assert (real_spec.kind, real_spec.device_names) == (sim_spec.kind, sim_spec.device_names)
        assert real_spec.version == sim_spec.version == "0.5.0"
    uuids = [g.uuid for g in WITH_MIG] + [m.uuid for g in WITH_MIG for m in g.mig_devices]
    assert [simulated.device_name(u) for u in uuids] == [real.device_name(u) for u in uuids]
    for spec in (specs["real"][0], specs["sim"][0]):
        assert {"0", "1", "1:0", "1:1", "all"} <= set(spec.device_names)


async def test_claim_spec_is_env_only(tmp_path: Path, empty_root: Path) -> None:
    service = make_service(tmp_path, empty_root)
    g0, g1 = WITH_MIG.gpus
    m10 = g1.mig_devices[0]
    names = await prepare_claim(service, UID, [g0.uuid, m10.uuid])
    assert names == [f"{CLAIM_KIND}={UID}-{g0.uuid}", f"{CLAIM_KIND}={UID}-{m10.uuid}"]
    spec = load(tmp_path / "cdi" / CLAIM_FILE)
    assert s.validate(spec) == [] and spec.version == s.minimum_version(spec)
    assert spec.qualified_names() == tuple(names)
    assert_env_only(spec)
    assert spec.container_edits.env == (SIMULATED_ENV,)  # self-contained, like the real claim spec
    assert env_of(spec, f"{UID}-{m10.uuid}") == (f"GPU_AGENT_SIMULATED_MIG_1_0={m10.uuid}",)
    await unprepare_claim(service, UID)
    assert not (tmp_path / "cdi" / CLAIM_FILE).exists()


def test_cdi_generate_prints_what_the_agent_writes(empty_root: Path) -> None:
    spec = s.loads(cli.render_device_plugin_spec(WITH_MIG, driver_root=empty_root, hook_candidates=[]))
    assert_env_only(spec)
    assert spec.container_edits.env == (SIMULATED_ENV,)


async def test_simulated_node_with_a_driver_root_keeps_real_discovery(tmp_path: Path) -> None:
    driver = FakeDriver(tmp_path / "driver").build()
    service = make_service(tmp_path, driver.root, inventory(2))
    await service.ensure_device_plugin_spec()
    spec = load(tmp_path / "cdi" / DP_FILE)
    assert [n.path for n in spec.devices[0].container_edits.device_nodes] == ["/dev/nvidia0"]
    assert SIMULATED_ENV not in spec.container_edits.env
    assert service.debug_state()["driver_mode"] == "installed"


# --- reconciling -------------------------------------------------------------------------


def _delete(tmp: Path) -> Callable[[], bool]:
    for name in (DP_FILE, CLAIM_FILE):
        (tmp / "cdi" / name).unlink()
    return lambda: (tmp / "cdi" / DP_FILE).exists() and (tmp / "cdi" / CLAIM_FILE).exists()


def _corrupt(tmp: Path) -> Callable[[], bool]:
    path = tmp / "cdi" / DP_FILE
    good = path.read_text()
    path.write_text('{"cdiVersion": "0.5.0", "kind": ')
    return lambda: path.read_text() == good


def _edited(tmp: Path) -> Callable[[], bool]:  # valid, but not ours: someone added a device node
    path = tmp / "cdi" / DP_FILE
    good = path.read_text()
    spec = s.loads(good)
    first = dataclasses.replace(
        spec.devices[0], container_edits=s.ContainerEdits(device_nodes=(s.DeviceNode(path="/dev/nvidia0"),))
    )
    path.write_text(s.dumps(dataclasses.replace(spec, devices=(first, *spec.devices[1:]))))
    return lambda: path.read_text() == good


def _orphan(tmp: Path) -> Callable[[], bool]:
    orphan = tmp / "cdi" / "k8s.gpu-node-agent.nvidia.com-claim_deadbeef-0000.json"
    orphan.write_text((tmp / "cdi" / CLAIM_FILE).read_text())
    foreign = tmp / "cdi" / "other-vendor.json"
    foreign.write_text("not even json")
    return lambda: not orphan.exists() and foreign.read_text() == "not even json"


DAMAGE = {"deleted": _delete, "corrupt": _corrupt, "edited": _edited, "orphan": _orphan}
EXPECTED_ACTION = {"deleted": "created", "orphan": "deleted"}


@pytest.fixture
async def service(tmp_path: Path, empty_root: Path, registry: CollectorRegistry) -> CdiService:
    service = make_service(tmp_path, empty_root, registry=registry)
    await prepare_claim(service, UID, [WITH_MIG.gpus[0].uuid])
    report = await service.reconcile_once()
    assert report.errors == () and sorted(report.owned) == sorted([DP_FILE, CLAIM_FILE])
    return service


@pytest.mark.parametrize("damage", sorted(DAMAGE))
async def test_one_pass_repairs(service: CdiService, tmp_path: Path, registry: CollectorRegistry, damage: str) -> None:
    repaired = DAMAGE[damage](tmp_path)
    report = await service.reconcile_once()
    assert repaired(), report
    assert report.errors == () and report.driver_version == WITH_MIG.driver_version
    action = EXPECTED_ACTION.get(damage, "rewritten")
    assert action in {r.action for r in report.repairs}
    assert repairs(registry, action) >= 1
    for name in report.owned:
        spec = load(tmp_path / "cdi" / name)
        assert s.validate(spec) == [] and spec.version == s.minimum_version(spec)
        assert_env_only(spec)


async def test_running_loop_repairs_within_one_period(service: CdiService, tmp_path: Path) -> None:
    passes = service.debug_state()["reconcile_passes"]
    task = asyncio.create_task(service.run(), name="cdi-reconciler")
    try:
        await wait_for(lambda: service.debug_state()["reconcile_passes"] != passes, within=SLACK)
        repaired = _delete(tmp_path)
        await wait_for(repaired, within=PERIOD + SLACK)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_inventory_change_follows(service: CdiService, tmp_path: Path) -> None:
    service.inventories.update(inventory(1))  # MIG devices and GPU 1 gone
    report = await service.reconcile_once()
    assert report.errors == ()
    assert load(tmp_path / "cdi" / DP_FILE).device_names == (inventory(1).gpus[0].uuid, "0", "all")
    service.inventories.update(inventory(0))
    await unprepare_claim(service, UID)
    await service.reconcile_once()
    assert not (tmp_path / "cdi" / DP_FILE).exists() and not (tmp_path / "cdi" / CLAIM_FILE).exists()
