"""CdiService and its reconciler: the API both mechanisms use, and repairs within one period."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from agent.cdi import spec as s
from agent.cdi.errors import CdiError, DriverDiscoveryError, InvalidNameError, UnknownCdiDeviceError
from agent.cdi.service import CdiService, NullCdiService, create_cdi_service
from agent.core.config.loader import build_config
from agent.core.config.schema import CdiConfig
from agent.core.inventory.current import InventoryState
from tests.cdi_fixtures import LIB_DIR, NEW_VERSION, VERSION, FakeDriver, inventory, mig, prepare_claim, unprepare_claim

DP_FILE = "k8s.gpu-node-agent.nvidia.com-gpu.json"
UID = "0e3f1a2b-aaaa-bbbb-cccc-000000000001"
CLAIM_FILE = f"k8s.gpu-node-agent.nvidia.com-claim_{UID}.json"
PERIOD = 0.2  # reconcile interval in these tests
SLACK = 5.0  # a hang guard: one pass takes milliseconds, a loaded CI machine may take far longer


@pytest.fixture
def driver(tmp_path: Path) -> FakeDriver:
    return FakeDriver(tmp_path / "driver", cap_minors=(21, 22)).build()


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def make_service(
    tmp_path: Path,
    driver: FakeDriver,
    registry: CollectorRegistry,
    n_gpus: int = 2,
    clock: Callable[[], float] = time.monotonic,
) -> CdiService:
    return CdiService(
        config=CdiConfig(reconcile_interval_s=PERIOD),
        cdi_root=tmp_path / "cdi",
        driver_root=driver.root,
        inventory=InventoryState(inventory(n_gpus)),
        registry=registry,
        hook_candidates=[],
        clock=clock,
    )


@contextlib.asynccontextmanager
async def running(service: CdiService) -> AsyncIterator[None]:
    """The service's loop (start pass, watch, period) as the agent runs it; cancelled after."""
    task = asyncio.create_task(service.run(), name="cdi-reconciler")
    try:
        yield
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def load(path: Path) -> s.Spec:
    return s.loads(path.read_text())


def repairs(registry: CollectorRegistry, action: str) -> float:
    return registry.get_sample_value("gpu_agent_cdi_repairs_total", {"action": action}) or 0.0


async def wait_for(condition: Callable[[], bool], *, within: float) -> None:
    """Poll the file system (there is no event to wait on) until ``condition`` holds."""
    async with asyncio.timeout(within):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.005)


async def test_ensure_writes_the_device_plugin_spec(
    tmp_path: Path, driver: FakeDriver, registry: CollectorRegistry
) -> None:
    service = make_service(tmp_path, driver, registry)
    await service.ensure_device_plugin_spec()
    await service.ensure_device_plugin_spec()  # idempotent
    spec = load(tmp_path / "cdi" / DP_FILE)
    assert s.validate(spec) == [] and spec.version == s.minimum_version(spec) == "0.5.0"
    g0 = inventory(2).gpus[0]
    assert service.device_name(g0.uuid) == f"k8s.gpu-node-agent.nvidia.com/gpu={g0.uuid}"
    assert {service.device_name(g0.uuid).partition("=")[2], "0", "all"} <= set(spec.device_names)
    with pytest.raises(UnknownCdiDeviceError):
        service.device_name("GPU-unknown")


async def test_node_without_gpus_writes_nothing(tmp_path: Path, registry: CollectorRegistry) -> None:
    service = CdiService(
        config=CdiConfig(),
        cdi_root=tmp_path / "cdi",
        driver_root=tmp_path / "no-driver",
        inventory=InventoryState(inventory(0)),
    )
    await service.ensure_device_plugin_spec()
    report = await service.reconcile_once()
    assert report.errors == () and not (tmp_path / "cdi").exists()


async def test_missing_driver_root_is_a_clear_error_and_keeps_files(
    tmp_path: Path, driver: FakeDriver, registry: CollectorRegistry
) -> None:
    service = make_service(tmp_path, driver, registry)
    await service.ensure_device_plugin_spec()
    before = (tmp_path / "cdi" / DP_FILE).read_bytes()
    driver.root.rename(tmp_path / "moved")
    with pytest.raises(DriverDiscoveryError, match="does not exist"):
        await service.ensure_device_plugin_spec()
    report = await service.reconcile_once()
    assert any("does not exist" in e for e in report.errors)
    assert (tmp_path / "cdi" / DP_FILE).read_bytes() == before
    assert registry.get_sample_value("gpu_agent_cdi_reconcile_errors_total") == 1.0
    assert "does not exist" in str(service.debug_state()["last_error"])


async def test_prepare_and_unprepare_claim(tmp_path: Path, driver: FakeDriver, registry: CollectorRegistry) -> None:
    service = make_service(tmp_path, driver, registry)
    g1 = inventory(2).gpus[1]
    names = await prepare_claim(service, UID, [g1.uuid])
    assert names == [f"k8s.gpu-node-agent.nvidia.com/claim={UID}-{g1.uuid}"]
    assert await prepare_claim(service, UID, [g1.uuid]) == names  # idempotent
    spec = load(tmp_path / "cdi" / CLAIM_FILE)
    assert s.validate(spec) == [] and spec.qualified_names() == tuple(names)
    assert [n.path for n in spec.devices[0].container_edits.device_nodes] == ["/dev/nvidia1"]
    await unprepare_claim(service, UID)
    await unprepare_claim(service, UID)
    assert not (tmp_path / "cdi" / CLAIM_FILE).exists()


@pytest.mark.parametrize("uid", ["../../etc/passwd", "a/b", "has space", "", "x:y"])
async def test_bad_claim_uid_is_rejected_before_any_io(
    tmp_path: Path, driver: FakeDriver, registry: CollectorRegistry, uid: str
) -> None:
    service = make_service(tmp_path, driver, registry)
    with pytest.raises(InvalidNameError, match="cannot be used in a CDI name"):
        await prepare_claim(service, uid, [inventory(2).gpus[0].uuid])
    with pytest.raises(InvalidNameError):
        await unprepare_claim(service, uid)
    assert not (tmp_path / "cdi").exists()


async def test_conflicting_foreign_file_is_an_error_and_damages_nothing(
    tmp_path: Path, driver: FakeDriver, registry: CollectorRegistry
) -> None:
    service = make_service(tmp_path, driver, registry)
    await service.ensure_device_plugin_spec()
    ours = (tmp_path / "cdi" / DP_FILE).read_bytes()
    foreign = tmp_path / "cdi" / "vendor.json"
    doc = json.loads(ours)
    doc["devices"] = [d for d in doc["devices"] if d["name"] == "0"]
    foreign.write_text(json.dumps(doc))
    driver.add_node("/dev/nvidia0", (1, 5))  # something to rewrite
    report = await service.reconcile_once()
    assert any("vendor.json already defines" in e for e in report.errors)
    assert (tmp_path / "cdi" / DP_FILE).read_bytes() == ours
    assert json.loads(foreign.read_text()) == doc


# --- reconciler: each kind of damage is repaired by one pass, and by the loop within one period --


def _delete(tmp: Path, driver: FakeDriver) -> Callable[[], bool]:
    for name in (DP_FILE, CLAIM_FILE):
        (tmp / "cdi" / name).unlink()
    return lambda: (tmp / "cdi" / DP_FILE).exists() and (tmp / "cdi" / CLAIM_FILE).exists()


def _corrupt(tmp: Path, driver: FakeDriver) -> Callable[[], bool]:
    path = tmp / "cdi" / DP_FILE
    good = path.read_text()
    path.write_text('{"cdiVersion": "0.5.0", "kind": ')
    return lambda: path.read_text() == good


def _orphan(tmp: Path, driver: FakeDriver) -> Callable[[], bool]:
    orphan = tmp / "cdi" / "k8s.gpu-node-agent.nvidia.com-claim_deadbeef-0000.json"
    orphan.write_text((tmp / "cdi" / CLAIM_FILE).read_text())
    foreign = tmp / "cdi" / "other-vendor.json"
    foreign.write_text("not even json")
    # never touches anyone else's files
    return lambda: not orphan.exists() and foreign.read_text() == "not even json"


def _upgrade(tmp: Path, driver: FakeDriver) -> Callable[[], bool]:
    driver.upgrade(NEW_VERSION)

    def done() -> bool:
        texts = [(tmp / "cdi" / name).read_text() for name in (DP_FILE, CLAIM_FILE)]
        return all(f"{LIB_DIR}/libcuda.so.{NEW_VERSION}" in t and VERSION not in t for t in texts)

    return done


def _renumber(tmp: Path, driver: FakeDriver) -> Callable[[], bool]:
    driver.add_node("/dev/nvidiactl", (1, 5))
    return lambda: load(tmp / "cdi" / DP_FILE).container_edits.device_nodes[0].minor == 5


DAMAGE = {
    "deleted": _delete,
    "corrupt": _corrupt,
    "orphan": _orphan,
    "driver-upgrade": _upgrade,
    "renumbered": _renumber,
}
EXPECTED_ACTION = {"deleted": "created", "orphan": "deleted"}


@pytest.fixture
async def service(tmp_path: Path, driver: FakeDriver, registry: CollectorRegistry) -> CdiService:
    service = make_service(tmp_path, driver, registry)
    await prepare_claim(service, UID, [inventory(2).gpus[0].uuid])
    await service.reconcile_once()
    assert sorted(service.debug_state()["files"]) == sorted([DP_FILE, CLAIM_FILE])  # type: ignore[type-var]
    return service


@pytest.mark.parametrize("damage", sorted(DAMAGE))
async def test_one_pass_repairs(
    service: CdiService, tmp_path: Path, driver: FakeDriver, registry: CollectorRegistry, damage: str
) -> None:
    repaired = DAMAGE[damage](tmp_path, driver)
    report = await service.reconcile_once()
    assert repaired(), report
    assert report.errors == ()
    action = EXPECTED_ACTION.get(damage, "rewritten")
    assert action in {r.action for r in report.repairs}
    assert repairs(registry, action) >= 1
    for name in report.owned:
        spec = load(tmp_path / "cdi" / name)
        assert s.validate(spec) == [] and spec.version == s.minimum_version(spec)


@pytest.mark.parametrize("damage", sorted(DAMAGE))
async def test_running_loop_repairs_within_one_period(
    service: CdiService, tmp_path: Path, driver: FakeDriver, damage: str
) -> None:
    passes = service.debug_state()["reconcile_passes"]
    async with running(service):
        await wait_for(lambda: service.debug_state()["reconcile_passes"] != passes, within=SLACK)  # the start pass
        repaired = DAMAGE[damage](tmp_path, driver)  # now only the periodic pass can repair it
        await wait_for(repaired, within=PERIOD + SLACK)


async def test_deleted_spec_is_back_long_before_the_period(
    tmp_path: Path, driver: FakeDriver, registry: CollectorRegistry
) -> None:
    """The directory watch repairs at once; the period (an hour here) is only the backstop."""
    service = CdiService(
        config=CdiConfig(reconcile_interval_s=3600),
        cdi_root=tmp_path / "cdi",
        driver_root=driver.root,
        inventory=InventoryState(inventory(2)),
        registry=registry,
        hook_candidates=[],
    )
    async with running(service):
        spec = tmp_path / "cdi" / "k8s.gpu-node-agent.nvidia.com-gpu.json"
        await wait_for(spec.exists, within=SLACK)
        original = spec.read_bytes()
        spec.unlink()
        await wait_for(spec.exists, within=2.0)
        assert spec.read_bytes() == original
        (tmp_path / "cdi" / "someone-else.json").write_text("{}")  # not ours: ignored, untouched
        assert (tmp_path / "cdi" / "someone-else.json").read_text() == "{}"


async def test_the_agents_own_writes_start_no_pass_and_anyone_elses_do(
    tmp_path: Path, driver: FakeDriver, registry: CollectorRegistry
) -> None:
    """Every claim spec the agent wrote or removed came back from the directory watch as a change
    and started a full reconcile pass (every owned file read and compared) right after each
    prepare and unprepare, on the CPU the next prepare needed."""
    (tmp_path / "cdi").mkdir()  # watched from the start (a directory that appears is a rescan)
    service = _quiet_service(tmp_path, driver, registry)

    def state(key: str) -> int:
        value = service.debug_state()[key]
        assert isinstance(value, int)
        return value

    async with running(service):
        await wait_for(lambda: state("watch_echoes") >= 1, within=SLACK)  # the start pass's own write
        kicks = state("watch_kicks")
        g1 = inventory(2).gpus[1]
        echoes = state("watch_echoes")
        await prepare_claim(service, UID, [g1.uuid])
        await wait_for(lambda: state("watch_echoes") > echoes, within=SLACK)
        echoes = state("watch_echoes")
        await unprepare_claim(service, UID)
        await wait_for(lambda: state("watch_echoes") > echoes, within=SLACK)
        assert state("watch_kicks") == kicks
        # someone else's change to a file the agent wrote is a change: a pass repairs it at once
        await prepare_claim(service, UID, [g1.uuid])
        claim = tmp_path / "cdi" / CLAIM_FILE
        written = claim.read_bytes()
        claim.write_bytes(written.replace(b"nvidia1", b"nvidia9"))
        await wait_for(lambda: claim.read_bytes() == written, within=SLACK)
        assert state("watch_kicks") > kicks
        # and so is someone deleting a file the agent wrote
        dp = tmp_path / "cdi" / DP_FILE
        original = dp.read_bytes()
        kicks = state("watch_kicks")
        dp.unlink()
        await wait_for(lambda: dp.exists() and dp.read_bytes() == original, within=SLACK)
        assert state("watch_kicks") > kicks


async def test_claim_writes_reuse_the_drivers_last_look_for_one_interval(
    tmp_path: Path, driver: FakeDriver, registry: CollectorRegistry
) -> None:
    """Every claim write looked at the whole installed driver again (libraries, utilities, nodes:
    11 ms a claim for the small fake tree here); the reconcile pass looks every interval anyway."""
    now = [0.0]
    service = make_service(tmp_path, driver, registry, clock=lambda: now[0])
    g1 = inventory(2).gpus[1]

    def looks() -> object:
        return service.debug_state()["claim_driver_looks"]

    await service.reconcile_once()
    for i in range(5):
        await prepare_claim(service, f"{UID[:-1]}{i}", [g1.uuid])
    assert looks() == 0  # the pass's look
    now[0] += PERIOD
    await prepare_claim(service, f"{UID[:-1]}5", [g1.uuid])
    await prepare_claim(service, f"{UID[:-1]}6", [g1.uuid])
    assert looks() == 1  # one interval on: looked again, once
    service.inventories.update(inventory(2, migs={1: (mig(1, 0, 21, 22),)}))
    await prepare_claim(service, f"{UID[:-1]}7", [g1.uuid])
    assert looks() == 2  # another inventory: never the old look


async def test_a_driver_changed_within_the_interval_is_in_the_claim_specs_after_the_next_pass(
    tmp_path: Path, driver: FakeDriver, registry: CollectorRegistry
) -> None:
    service = make_service(tmp_path, driver, registry)
    await service.reconcile_once()
    driver.host("/usr/bin/nvidia-debugdump").unlink()  # a utility gone: the old look still lists it
    await prepare_claim(service, UID, [inventory(2).gpus[1].uuid])

    def mounted() -> list[str]:
        return [m.container_path for m in load(tmp_path / "cdi" / CLAIM_FILE).container_edits.mounts]

    assert "/usr/bin/nvidia-debugdump" in mounted()
    report = await service.reconcile_once()
    assert "/usr/bin/nvidia-debugdump" not in mounted()
    assert CLAIM_FILE in {r.file for r in report.repairs if r.action == "rewritten"}


def _quiet_service(tmp_path: Path, driver: FakeDriver, registry: CollectorRegistry) -> CdiService:
    """A service whose period (an hour) never comes round in a test."""
    return CdiService(
        config=CdiConfig(reconcile_interval_s=3600),
        cdi_root=tmp_path / "cdi",
        driver_root=driver.root,
        inventory=InventoryState(inventory(2)),
        registry=registry,
        hook_candidates=[],
    )


def _checks(service: CdiService) -> object:
    return service.debug_state()["device_plugin_spec_checks"]


async def _until_known_current(service: CdiService) -> None:
    """Ensure until the service trusts its memory (its own writes' watch events come first)."""
    async with asyncio.timeout(5.0):
        while not service.debug_state()["device_plugin_spec_known_current"]:
            await service.ensure_device_plugin_spec()
            await asyncio.sleep(0.005)


async def test_steady_state_ensure_answers_from_memory(
    tmp_path: Path, driver: FakeDriver, registry: CollectorRegistry
) -> None:
    """While the watch runs and nothing changed, an Allocate's ensure does not look at the disk."""
    service = _quiet_service(tmp_path, driver, registry)
    async with running(service):
        await _until_known_current(service)
        checks = _checks(service)
        for _ in range(100):
            await service.ensure_device_plugin_spec()
            await asyncio.sleep(0)
        assert _checks(service) == checks
    # without a running watch nothing is trusted: every call looks again
    (tmp_path / "cdi" / DP_FILE).unlink()
    await service.ensure_device_plugin_spec()
    assert (tmp_path / "cdi" / DP_FILE).exists()


@pytest.mark.parametrize("damage", ["deleted", "tampered"])
async def test_ensure_repairs_a_spec_changed_behind_its_back(
    tmp_path: Path, driver: FakeDriver, registry: CollectorRegistry, damage: str
) -> None:
    """Once the watch reports the file, the next ensure checks and repairs it itself (the
    reconciler is held back here, so only ensure can)."""
    service = _quiet_service(tmp_path, driver, registry)
    async with running(service):
        await _until_known_current(service)

        async def no_pass() -> None:
            return None

        service.reconcile_once = no_pass  # type: ignore[assignment,method-assign]
        path = tmp_path / "cdi" / DP_FILE
        original = path.read_bytes()
        if damage == "deleted":
            path.unlink()
        else:
            path.write_text('{"cdiVersion": "0.5.0", "kind": "k8s.gpu-node-agent.nvidia.com/gpu", "devices": []}')
        await wait_for(lambda: not service.debug_state()["device_plugin_spec_known_current"], within=2.0)
        await service.ensure_device_plugin_spec()
        assert path.read_bytes() == original


async def test_ensure_follows_a_new_inventory_at_once(
    tmp_path: Path, driver: FakeDriver, registry: CollectorRegistry
) -> None:
    """A new inventory is never answered from memory, even before the reconciler wakes."""
    service = _quiet_service(tmp_path, driver, registry)
    async with running(service):
        await _until_known_current(service)
        service.inventories.update(inventory(2, migs={1: (mig(1, 0, 21, 22),)}))
        await service.ensure_device_plugin_spec()  # before the reconciler's pass could run
        assert "1:0" in load(tmp_path / "cdi" / DP_FILE).device_names


async def test_concurrent_ensures_after_a_change_check_the_disk_once(
    tmp_path: Path, driver: FakeDriver, registry: CollectorRegistry
) -> None:
    """Callers queued behind the one that checked take its answer instead of checking again."""
    service = _quiet_service(tmp_path, driver, registry)
    async with running(service):
        await _until_known_current(service)

        async def no_pass() -> None:
            return None

        service.reconcile_once = no_pass  # type: ignore[assignment,method-assign]
        checks = _checks(service)
        # the watch reports the file (a touch): checked, found current, nothing written (a write
        # would bring a watch event of its own, and a second look after it)
        os.utime(tmp_path / "cdi" / DP_FILE)
        await wait_for(lambda: not service.debug_state()["device_plugin_spec_known_current"], within=2.0)
        await asyncio.gather(*(service.ensure_device_plugin_spec() for _ in range(32)))
        assert _checks(service) == checks + 1  # type: ignore[operator]


async def test_corrupt_is_reported_as_such(service: CdiService, tmp_path: Path) -> None:
    _corrupt(tmp_path, FakeDriver(tmp_path))
    await service.reconcile_once()
    assert {"action": "rewritten", "file": DP_FILE, "reason": "corrupt"} in service.debug_state()["last_repairs"]  # type: ignore[operator]


async def test_inventory_change_removes_gone_devices(service: CdiService, tmp_path: Path) -> None:
    task = asyncio.create_task(service.run())
    try:
        service.inventories.update(inventory(1))  # wakes the loop at once
        await wait_for(lambda: "1" not in load(tmp_path / "cdi" / DP_FILE).device_names, within=SLACK)
        with pytest.raises(UnknownCdiDeviceError):
            service.device_name(inventory(2).gpus[1].uuid)
        service.inventories.update(inventory(0))
        await wait_for(lambda: not (tmp_path / "cdi" / DP_FILE).exists(), within=SLACK)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_mig_reconfiguration(service: CdiService, tmp_path: Path) -> None:
    with_mig = inventory(2, migs={1: (mig(1, 0, 21, 22),)})
    service.inventories.update(with_mig)
    await service.reconcile_once()
    assert "1:0" in load(tmp_path / "cdi" / DP_FILE).device_names
    m = with_mig.gpus[1].mig_devices[0]
    assert service.device_name(m.uuid) == f"k8s.gpu-node-agent.nvidia.com/gpu={m.uuid}"


async def test_external_prepared_claims_source(tmp_path: Path, driver: FakeDriver, registry: CollectorRegistry) -> None:
    service = make_service(tmp_path, driver, registry)
    checkpoint = {UID: [inventory(2).gpus[0].uuid]}
    service.set_prepared_claims(lambda: checkpoint)
    await service.reconcile_once()  # e.g. after a reboot emptied the tmpfs: re-created from the checkpoint
    assert (tmp_path / "cdi" / CLAIM_FILE).exists()
    await unprepare_claim(service, UID)
    await service.reconcile_once()  # the checkpoint still lists it for a moment: stays gone
    assert not (tmp_path / "cdi" / CLAIM_FILE).exists()
    checkpoint.clear()
    await service.reconcile_once()
    assert service.debug_state()["claims"] == []


async def test_debug_state_and_metrics(tmp_path: Path, driver: FakeDriver, registry: CollectorRegistry) -> None:
    service = make_service(tmp_path, driver, registry)
    report = await service.reconcile_once()
    assert [r.action for r in report.repairs] == ["created"]
    state = service.debug_state()
    assert state["files"] == [DP_FILE] and state["driver_version"] == VERSION
    assert state["repairs_total"] == {"created": 1, "rewritten": 0, "deleted": 0}
    assert state["last_reconcile"] is not None and state["last_error"] is None
    assert repairs(registry, "created") == 1.0 and repairs(registry, "deleted") == 0.0
    assert registry.get_sample_value("gpu_agent_cdi_spec_files") == 1.0


async def test_null_service() -> None:
    config = build_config({"cdi": {"enabled": False}, "paths": {"cdi_root": "/nonexistent"}})
    null = create_cdi_service(config, inventory=InventoryState(inventory(1)))
    assert isinstance(null, NullCdiService)
    await null.ensure_device_plugin_spec()
    # a claim prepared without CDI would start its containers without their GPUs: refused, clearly
    with pytest.raises(CdiError, match=r"CDI is disabled \(cdi.enabled: false\)"):
        await prepare_claim(null, UID, ["x"])
    await unprepare_claim(null, UID)
    assert null.last_pass_ok() == (True, "")
    with pytest.raises(UnknownCdiDeviceError):
        null.device_name(inventory(1).gpus[0].uuid)
    assert null.debug_state() == {"enabled": False}
    task = asyncio.create_task(null.run())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_skipped_gpu_takes_its_mig_devices_and_all_with_it(tmp_path: Path, registry: CollectorRegistry) -> None:
    """No name is handed out for a device the spec on disk does not define."""
    driver = FakeDriver(tmp_path / "driver", gpu_minors=(1,), cap_minors=(21, 22)).build()  # /dev/nvidia0 missing
    inv = inventory(2, migs={0: (mig(0, 0, 21, 22),)})
    service = CdiService(
        config=CdiConfig(),
        cdi_root=tmp_path / "cdi",
        driver_root=driver.root,
        inventory=InventoryState(inv),
        registry=registry,
        hook_candidates=[],
    )
    await service.ensure_device_plugin_spec()
    spec = load(tmp_path / "cdi" / DP_FILE)
    defined = {d.name for d in spec.devices}
    mig_uuid = inv.gpus[0].mig_devices[0].uuid
    with pytest.raises(UnknownCdiDeviceError, match="left out of the CDI spec"):
        service.device_name(mig_uuid)
    assert service.device_name(inv.gpus[1].uuid).partition("=")[2] in defined


async def test_a_spec_that_would_leave_out_every_gpu_is_not_written(
    tmp_path: Path, registry: CollectorRegistry
) -> None:
    driver = FakeDriver(tmp_path / "driver", gpu_minors=()).build()
    service = CdiService(
        config=CdiConfig(),
        cdi_root=tmp_path / "cdi",
        driver_root=driver.root,
        inventory=InventoryState(inventory(1)),
        registry=registry,
        hook_candidates=[],
    )
    with pytest.raises(DriverDiscoveryError):
        await service.ensure_device_plugin_spec()
    assert not (tmp_path / "cdi" / DP_FILE).exists()


async def test_foreign_files_sharing_our_name_prefix_are_left_alone(service: CdiService, tmp_path: Path) -> None:
    """Kinds like <our vendor>/gpu_legacy or /claim_x map onto our file-name prefixes."""
    cdi = tmp_path / "cdi"
    await service.reconcile_once()
    foreign = {
        "k8s.gpu-node-agent.nvidia.com-gpu_legacy.json": "k8s.gpu-node-agent.nvidia.com/gpu_legacy",
        "k8s.gpu-node-agent.nvidia.com-claim_x.json": "k8s.gpu-node-agent.nvidia.com/claim_x",
    }
    for name, kind in foreign.items():
        body = {"cdiVersion": "0.5.0", "kind": kind, "devices": [{"name": "d", "containerEdits": {"env": ["A=1"]}}]}
        (cdi / name).write_text(json.dumps(body))
    report = await service.reconcile_once()
    assert not [r for r in report.repairs if r.file in foreign]
    for name, kind in foreign.items():
        assert json.loads((cdi / name).read_text())["kind"] == kind


async def test_a_reconcile_pass_is_timed(tmp_path: Path, driver: FakeDriver, registry: CollectorRegistry) -> None:
    service = make_service(tmp_path, driver, registry)
    await service.reconcile_once()
    await service.reconcile_once()
    assert registry.get_sample_value("gpu_agent_cdi_reconcile_duration_seconds_count") == 2.0
    assert registry.get_sample_value("gpu_agent_cdi_reconcile_duration_seconds_sum") > 0
