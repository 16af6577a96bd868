"""The NVML backend over a fake pynvml (tests/fakes/fake_pynvml.py): inventory, errors, health."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import fields
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from agent.config.schema import HealthConfig
from agent.errors import BackendError, BackendInitError, GpuLostError, LibraryMissingError
from agent.health.model import HealthState, Signal, SignalKind
from agent.health.monitor import HealthMonitor
from agent.inventory.model import Inventory, PcieLevel
from agent.inventory.nvml import NvmlBackend, nvml_available
from tests.fakes import fake_pynvml
from tests.fakes.fake_pynvml import DBE, SBE, XID, FakeNvml, a100_mig_node, h100_node

# periodic checks fast; or effectively only the first one, so events tests see no churn
CHECKS = HealthConfig(check_interval_s=0.02, event_wait_ms=20)
EVENTS = HealthConfig(check_interval_s=3600, event_wait_ms=20)
TIMEOUT = 2.0

Sink = Callable[[Signal], None]


def _mig_minor(gpu_minor: int, gi: int, ci: int | None = None) -> int:
    base = 3 + gpu_minor * 15 * 9 + gi * 9
    return base if ci is None else base + 1 + ci


def _fs(tmp_path: Path, *, numa: dict[str, str] | None = None, mig_minors: bool = True) -> tuple[Path, Path]:
    sysfs, procfs = tmp_path / "sys", tmp_path / "proc"
    for bus, node in (numa or {}).items():
        path = sysfs / "bus" / "pci" / "devices" / bus / "numa_node"
        path.parent.mkdir(parents=True)
        path.write_text(node + "\n")
    if mig_minors:
        lines = ["config 1", "monitor 2"]
        for minor in range(4):
            for gi in range(15):
                lines.append(f"gpu{minor}/gi{gi}/access {_mig_minor(minor, gi)}")
                lines.extend(f"gpu{minor}/gi{gi}/ci{ci}/access {_mig_minor(minor, gi, ci)}" for ci in range(8))
        path = procfs / "driver" / "nvidia-caps" / "mig-minors"
        path.parent.mkdir(parents=True)
        path.write_text("\n".join(lines) + "\n")
    return sysfs, procfs


async def _open(fake: FakeNvml, tmp_path: Path, health: HealthConfig = CHECKS, **fs: object) -> NvmlBackend:
    sysfs, procfs = _fs(tmp_path, **fs)  # type: ignore[arg-type]
    backend = NvmlBackend(health=health, nvml=fake, sysfs_root=sysfs, procfs_root=procfs)
    await backend.open()
    return backend


@contextlib.asynccontextmanager
async def _watching(
    backend: NvmlBackend, inventory: Inventory, also: Sink | None = None
) -> AsyncIterator[asyncio.Queue[Signal]]:
    signals: asyncio.Queue[Signal] = asyncio.Queue()

    def sink(signal: Signal) -> None:
        if also is not None:
            also(signal)
        signals.put_nowait(signal)

    task = asyncio.create_task(backend.watch_health(inventory, sink))
    try:
        yield signals
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, TIMEOUT)
        await backend.close()


async def _next(signals: asyncio.Queue[Signal], match: Callable[[Signal], bool]) -> Signal:
    async def find() -> Signal:
        while not match(signal := await signals.get()):
            pass
        return signal

    return await asyncio.wait_for(find(), TIMEOUT)


def _not_ok(signal: Signal) -> bool:
    return signal.kind is not SignalKind.CHECK_OK


async def _waiting(fake: FakeNvml, count: int = 1) -> None:
    """Until the event thread has entered its wait ``count`` times (it registered first)."""
    assert await asyncio.to_thread(fake.wait_for_waits, count, TIMEOUT)


def _single_line(exc: BaseException) -> str:
    message = str(exc)
    assert message and "\n" not in message and "Traceback" not in message
    return message


# --- the fake itself ----------------------------------------------------------------------


def test_fake_matches_real_pynvml() -> None:
    real = pytest.importorskip("pynvml")
    fake = h100_node()
    for name in dir(fake_pynvml):
        if name.startswith(("NVML_ERROR_", "NVML_TOPOLOGY_", "NVML_DEVICE_ARCH_", "NVML_NVLINK_", "nvmlEventType")):
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


# --- open / close / availability -----------------------------------------------------------


async def test_library_missing_is_a_one_line_error(tmp_path: Path) -> None:
    fake = h100_node(library_missing=True)
    backend = NvmlBackend(health=CHECKS, nvml=fake)
    with pytest.raises(LibraryMissingError) as info:
        await backend.open()
    assert "libnvidia-ml.so.1" in _single_line(info.value)
    await backend.close()  # safe after a failed open
    assert fake.shutdown_calls == 0
    assert not await nvml_available(fake)


async def test_init_failure_is_backend_init_error() -> None:
    fake = h100_node(init_error=fake_pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    backend = NvmlBackend(health=CHECKS, nvml=fake)
    with pytest.raises(BackendInitError) as info:
        await backend.open()
    assert "Driver Not Loaded" in _single_line(info.value)
    await backend.close()
    assert fake.shutdown_calls == 0
    assert not await nvml_available(fake)


async def test_nvml_available_needs_a_gpu_and_shuts_down() -> None:
    fake = h100_node()
    assert await nvml_available(fake)
    assert fake.init_count == 0 and fake.shutdown_calls == 1
    empty = FakeNvml([])
    assert not await nvml_available(empty)
    assert empty.init_count == 0


async def test_default_module_is_pynvml_imported_in_open(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml([])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert await nvml_available() is False  # initialises, sees no GPU, shuts down
    backend = NvmlBackend(health=CHECKS)
    await backend.open()
    assert fake.init_count == 1 and fake.shutdown_calls == 1
    await backend.close()


async def test_binding_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes "import pynvml" raise ImportError
    assert await nvml_available() is False
    with pytest.raises(LibraryMissingError) as info:
        await NvmlBackend(health=CHECKS).open()
    assert "nvidia-ml-py" in _single_line(info.value)


def test_importing_the_backend_does_not_import_pynvml() -> None:
    code = "import sys, agent.inventory.nvml; assert 'pynvml' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


async def test_close_is_idempotent_and_load_needs_open(tmp_path: Path) -> None:
    fake = h100_node()
    backend = NvmlBackend(health=CHECKS, nvml=fake)
    with pytest.raises(BackendError):
        await backend.load()
    await backend.open()
    await backend.close()
    await backend.close()
    assert fake.shutdown_calls == 1 and fake.init_count == 0


# --- inventory -----------------------------------------------------------------------------


async def test_h100_node_inventory(tmp_path: Path) -> None:
    fake = h100_node()
    backend = await _open(fake, tmp_path)
    inventory = await backend.load()
    await backend.close()

    assert threading.get_ident() not in fake.call_threads()  # nothing ran on the loop thread
    assert (inventory.backend, inventory.driver_version, inventory.cuda_driver_version) == ("nvml", "550.54.15", "12.4")
    assert [g.index for g in inventory] == list(range(8))
    gpu = inventory.gpus[1]
    assert gpu.uuid == fake.gpus[1].uuid
    assert (gpu.minor, gpu.product_name, gpu.architecture, gpu.compute_capability) == (
        1,
        "NVIDIA H100 80GB HBM3",
        "hopper",
        "9.0",
    )
    assert (gpu.memory_mib, gpu.pci_bus_id, gpu.short_bus_id) == (81559, "00000000:2A:00.0", "0000:2a:00.0")
    assert [g.numa_node for g in inventory] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert not any(g.mig_enabled or g.mig_devices for g in inventory)

    uuids = [g.uuid for g in inventory]
    assert len(inventory.links) == 28
    for i, a in enumerate(uuids):
        for j, b in enumerate(uuids[i + 1 :], start=i + 1):
            link = inventory.link(a, b)
            assert link.nvlinks == 18, (i, j)
            same_switch, same_socket = i // 2 == j // 2, i // 4 == j // 4
            expected = PcieLevel.SINGLE if same_switch else PcieLevel.NODE if same_socket else PcieLevel.SYSTEM
            assert link.pcie is expected, (i, j)
    assert inventory.link(uuids[0], uuids[7]).describe() == "NV18"


async def test_a100_mig_node_inventory(tmp_path: Path) -> None:
    fake = a100_mig_node()
    numa = {"0000:07:00.0": "0", "0000:0f:00.0": "0", "0000:47:00.0": "1", "0000:4e:00.0": "-1"}
    backend = await _open(fake, tmp_path, numa=numa)
    inventory = await backend.load()
    await backend.close()

    assert [g.numa_node for g in inventory] == [0, 0, 1, None]  # sysfs fallback; -1 means none
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
        assert mig.gi_cap_minor == _mig_minor(2, mig.gpu_instance_id)
        assert mig.ci_cap_minor == _mig_minor(2, mig.gpu_instance_id, mig.compute_instance_id)
    assert [m.profile for m in inventory.gpus[1].mig_devices] == ["7g.40gb"]
    assert inventory.gpus[2].mig_devices == ()
    assert [m.profile for m in inventory.gpus[3].mig_devices] == ["2g.10gb"]  # derived: name has no profile
    assert inventory.find_mig(gpu0.mig_devices[2].uuid) == gpu0.mig_devices[2]

    uuids = [g.uuid for g in inventory]
    assert {inventory.link(a, b).nvlinks for a in uuids for b in uuids if a < b} == {4}
    assert inventory.link(uuids[0], uuids[1]).pcie is PcieLevel.SINGLE
    assert inventory.link(uuids[1], uuids[2]).pcie is PcieLevel.SYSTEM


async def test_mig_minors_unknown_without_the_proc_file(tmp_path: Path) -> None:
    backend = await _open(a100_mig_node(), tmp_path, mig_minors=False)
    inventory = await backend.load()
    await backend.close()
    migs = [m for g in inventory for m in g.mig_devices]
    assert migs and all(m.gi_cap_minor is None and m.ci_cap_minor is None for m in migs)
    assert inventory.gpus[0].numa_node is None  # no sysfs either


async def test_load_on_a_lost_gpu_raises_gpu_lost_error(tmp_path: Path) -> None:
    fake = h100_node()
    fake.gpus[3].lost = True
    backend = await _open(fake, tmp_path)
    with pytest.raises(GpuLostError) as info:
        await backend.load()
    await backend.close()
    message = _single_line(info.value)
    assert "GPU 3" in message and "GPU is lost" in message


# --- periodic checks ------------------------------------------------------------------------


async def test_periodic_check_reports_a_lost_gpu(tmp_path: Path) -> None:
    fake = h100_node()
    backend = await _open(fake, tmp_path)
    inventory = await backend.load()
    lost = inventory.gpus[3].uuid
    async with _watching(backend, inventory) as signals:
        ok = await _next(signals, lambda s: s.kind is SignalKind.CHECK_OK and s.uuid == lost)
        assert ok.uuid == lost
        fake.gpus[3].lost = True
        signal = await _next(signals, _not_ok)
        assert (signal.uuid, signal.kind) == (lost, SignalKind.LOST)
        # the other GPUs keep passing
        others = {g.uuid for g in inventory} - {lost}
        seen: set[str] = set()
        while seen != others:
            signal = await _next(signals, lambda s: s.uuid != lost)
            assert signal.kind is SignalKind.CHECK_OK
            seen.add(signal.uuid)
    assert threading.get_ident() not in fake.call_threads()


@pytest.mark.parametrize(
    ("field", "value", "detail"),
    [
        ("uuid_readback", "GPU-somebody-else", "UUID read back"),
        ("memory_total_override", 0, "total memory 0"),
        ("memory_total_override", 2**62, "total memory"),
        ("temperature", 0xFFFFFFFF, "temperature"),
    ],
)
async def test_periodic_check_reports_garbage(tmp_path: Path, field: str, value: object, detail: str) -> None:
    fake = h100_node()
    backend = await _open(fake, tmp_path)
    inventory = await backend.load()
    setattr(fake.gpus[6], field, value)
    async with _watching(backend, inventory) as signals:
        signal = await _next(signals, _not_ok)
    assert (signal.uuid, signal.kind) == (inventory.gpus[6].uuid, SignalKind.GARBAGE)
    assert detail in signal.detail


@pytest.mark.parametrize(
    ("error", "emits_ok"),
    [
        (fake_pynvml.NVML_ERROR_UNKNOWN, False),  # inconclusive: nothing for that GPU
        (RuntimeError("binding bug"), False),  # not even a bug stops the other GPUs
        (fake_pynvml.NVML_ERROR_NOT_SUPPORTED, True),  # the field is skipped
    ],
)
async def test_one_gpu_check_does_not_stop_the_others(tmp_path: Path, error: object, emits_ok: bool) -> None:
    fake = h100_node()
    backend = await _open(fake, tmp_path)
    inventory = await backend.load()
    fake.gpus[2].temperature_error = error  # type: ignore[assignment]
    odd = inventory.gpus[2].uuid
    counts = dict.fromkeys((g.uuid for g in inventory), 0)
    async with _watching(backend, inventory) as signals:
        while min(n for uuid, n in counts.items() if uuid != odd) < 3:
            signal = await _next(signals, lambda s: True)
            assert signal.kind is SignalKind.CHECK_OK
            counts[signal.uuid] += 1
    assert (counts[odd] > 0) is emits_ok


# --- events -------------------------------------------------------------------------------


async def test_xid_events_end_to_end_with_the_health_monitor(tmp_path: Path) -> None:
    fake = h100_node()
    backend = await _open(fake, tmp_path, health=EVENTS)
    inventory = await backend.load()
    monitor = HealthMonitor(config=EVENTS)
    monitor.set_inventory(inventory)
    uuid = inventory.gpus[4].uuid
    async with _watching(backend, inventory, also=monitor.observe) as signals:
        await _waiting(fake)
        fake.inject_event(4, XID, 13)  # an application Xid: reported, then ignored by policy
        signal = await _next(signals, _not_ok)
        assert (signal.uuid, signal.kind, signal.xid) == (uuid, SignalKind.XID, 13)
        assert monitor.state(uuid) is HealthState.HEALTHY
        fake.inject_event(4, XID, 79)  # fallen off the bus
        signal = await _next(signals, _not_ok)
        assert (signal.uuid, signal.xid) == (uuid, 79)
    assert monitor.state(uuid) is HealthState.UNHEALTHY
    record = monitor.record(uuid)
    assert record is not None and record.reset_required
    assert all(monitor.is_healthy(g.uuid) for g in inventory if g.uuid != uuid)
    assert threading.get_ident() not in fake.call_threads()


async def test_ecc_events(tmp_path: Path) -> None:
    fake = h100_node()
    backend = await _open(fake, tmp_path, health=EVENTS)
    inventory = await backend.load()
    async with _watching(backend, inventory) as signals:
        await _waiting(fake)
        fake.inject_event(0, DBE)
        fake.inject_event(7, SBE)
        first, second = await _next(signals, _not_ok), await _next(signals, _not_ok)
    assert (first.uuid, first.kind, first.xid) == (inventory.gpus[0].uuid, SignalKind.ECC_DOUBLE_BIT, None)
    assert (second.uuid, second.kind) == (inventory.gpus[7].uuid, SignalKind.ECC_SINGLE_BIT)


async def test_events_name_the_mig_device(tmp_path: Path) -> None:
    fake = a100_mig_node()
    backend = await _open(fake, tmp_path, health=EVENTS)
    inventory = await backend.load()
    gpu0, gpu1 = inventory.gpus[0], inventory.gpus[1]
    async with _watching(backend, inventory) as signals:
        await _waiting(fake)
        fake.inject_event(0, XID, 43, gi=13, ci=0)  # exactly one MIG device
        fake.inject_event(1, XID, 31, gi=0)  # GI only, and that GI has one CI
        fake.inject_event(0, XID, 79, gi=9, ci=0)  # no such MIG device: the GPU
        fake.inject_event(0, XID, 48)  # not about a MIG device
        got = [await _next(signals, _not_ok) for _ in range(4)]
    assert [(s.uuid, s.xid) for s in got] == [
        (gpu0.mig_devices[2].uuid, 43),
        (gpu1.mig_devices[0].uuid, 31),
        (gpu0.uuid, 79),
        (gpu0.uuid, 48),
    ]


async def test_event_wait_timeouts_just_loop(tmp_path: Path) -> None:
    fake = h100_node()
    backend = await _open(fake, tmp_path, health=EVENTS)
    inventory = await backend.load()
    async with _watching(backend, inventory) as signals:
        await _waiting(fake, 4)  # three waits timed out
        assert all(not _not_ok(s) for s in [signals.get_nowait() for _ in range(signals.qsize())])
        fake.inject_event(2, XID, 94)
        signal = await _next(signals, _not_ok)
    assert (signal.uuid, signal.xid) == (inventory.gpus[2].uuid, 94)
    assert len(fake.event_sets) == 1


async def test_unexpected_wait_error_is_logged_and_waiting_continues(tmp_path: Path) -> None:
    fake = h100_node()
    backend = await _open(fake, tmp_path, health=EVENTS)
    inventory = await backend.load()
    with capture_logs() as logs:
        async with _watching(backend, inventory) as signals:
            await _waiting(fake)
            fake.inject_wait_error(fake_pynvml.NVML_ERROR_UNKNOWN)
            # the wait in progress times out, the next one fails, the one after the backoff waits again
            await _waiting(fake, fake.wait_calls + 2)
            fake.inject_event(1, XID, 62)
            signal = await _next(signals, _not_ok)
    assert (signal.uuid, signal.xid) == (inventory.gpus[1].uuid, 62)
    assert any(e["event"] == "NVML event wait failed; retrying" for e in logs)


async def test_gpu_lost_from_the_event_wait(tmp_path: Path) -> None:
    fake = h100_node()
    backend = await _open(fake, tmp_path, health=EVENTS)
    inventory = await backend.load()
    async with _watching(backend, inventory) as signals:
        await _waiting(fake)
        fake.gpus[5].lost = True
        fake.inject_wait_error(fake_pynvml.NVML_ERROR_GPU_IS_LOST)
        signal = await _next(signals, _not_ok)
        assert (signal.uuid, signal.kind) == (inventory.gpus[5].uuid, SignalKind.LOST)
        fake.gpus[5].lost = False
        fake.inject_event(0, XID, 31)  # the wait goes on after the backoff
        signal = await _next(signals, _not_ok)
        assert (signal.uuid, signal.xid) == (inventory.gpus[0].uuid, 31)


async def test_fewer_event_types_when_not_supported_logged_once(tmp_path: Path) -> None:
    fake = a100_mig_node()
    fake.gpus[1].supported_events = XID | DBE
    fake.gpus[2].supported_events = XID
    backend = await _open(fake, tmp_path, health=EVENTS)
    inventory = await backend.load()
    with capture_logs() as logs:
        for _ in range(2):  # a second watch (new inventory) does not repeat the line
            async with _watching(backend, inventory):
                await _waiting(fake, fake.wait_calls + 1)
            await backend.open()
    reduced = [e for e in logs if e["event"] == "GPU supports only some health event types"]
    assert [(e["uuid"], e["events"]) for e in reduced] == [
        (inventory.gpus[1].uuid, ["xid", "ecc-double-bit"]),
        (inventory.gpus[2].uuid, ["xid"]),
    ]
    registrations = fake.event_sets[0].registrations
    assert registrations[inventory.gpus[0].uuid] == XID | DBE | SBE
    assert registrations[inventory.gpus[1].uuid] == XID | DBE


async def test_cancellation_stops_the_event_thread_promptly(tmp_path: Path) -> None:
    fake = h100_node()
    backend = await _open(fake, tmp_path, health=HealthConfig(check_interval_s=3600, event_wait_ms=50))
    inventory = await backend.load()
    task = asyncio.create_task(backend.watch_health(inventory, lambda s: None))
    await _waiting(fake)
    assert any(t.name == "nvml-events" for t in threading.enumerate())
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 0.5)  # about one event_wait_ms, with slack
    assert not any(t.name == "nvml-events" for t in threading.enumerate())
    assert [s.freed for s in fake.event_sets] == [True]
    await backend.close()


async def test_health_disabled_only_waits(tmp_path: Path) -> None:
    fake = h100_node()
    backend = await _open(fake, tmp_path, health=HealthConfig(enabled=False))
    inventory = await backend.load()
    before = len(fake.call_names())
    task = asyncio.create_task(backend.watch_health(inventory, lambda s: pytest.fail(f"signal {s}")))
    done, _ = await asyncio.wait({task}, timeout=0.05)
    assert not done
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 0.5)
    assert len(fake.call_names()) == before and fake.event_sets == []
    await backend.close()
