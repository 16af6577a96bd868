"""NVML health over the fake pynvml: periodic checks, the event thread, what happens when NVML
misbehaves the way nvml.h documents, and the health config applied live."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from agent.backends.nvml import events as nvml_events
from agent.core.config.schema import HealthConfig, XidRule
from agent.core.health.model import HealthState, SignalKind
from agent.core.health.monitor import HealthMonitor
from tests.fakes import fake_pynvml
from tests.fakes.fake_pynvml import DBE, SBE, XID, a100_mig_node, h100_node
from tests.nvml_fixtures import CHECKS, EVENTS, next_signal, not_ok, opened, until, waits, watching

# --- periodic checks ------------------------------------------------------------------------


async def test_periodic_check_reports_a_lost_gpu(tmp_path: Path) -> None:
    fake = h100_node()
    b = await opened(fake, tmp_path)
    inventory = await b.load()
    lost = inventory.gpus[3].uuid
    async with watching(b, inventory) as signals:
        ok = await next_signal(signals, lambda s: s.kind is SignalKind.CHECK_OK and s.uuid == lost)
        assert ok.uuid == lost
        fake.gpus[3].lost = True
        signal = await next_signal(signals, not_ok)
        assert (signal.uuid, signal.kind) == (lost, SignalKind.LOST)
    assert threading.get_ident() not in fake.call_threads()


async def test_one_lost_gpu_takes_out_only_that_gpu(tmp_path: Path) -> None:
    """nvmlDeviceGetHandleByUUID answers GPU_IS_LOST for every UUID once any GPU is lost:
    the checks must ask each GPU through its own handle."""
    fake = h100_node()
    b = await opened(fake, tmp_path)
    inventory = await b.load()
    lost = inventory.gpus[3].uuid
    monitor = HealthMonitor(config=CHECKS)
    monitor.set_inventory(inventory)
    async with watching(b, inventory, also=monitor.observe) as signals:
        await next_signal(signals, lambda s: s.kind is SignalKind.CHECK_OK)
        fake.gpus[3].lost = True
        counts = dict.fromkeys((g.uuid for g in inventory), 0)
        while min(n for uuid, n in counts.items() if uuid != lost) < 3:  # every other GPU checked 3 times since
            signal = await next_signal(signals, lambda s: True)
            if signal.uuid != lost:
                assert signal.kind is SignalKind.CHECK_OK, signal
                counts[signal.uuid] += 1
    assert monitor.state(lost) is HealthState.UNHEALTHY
    assert [g.uuid for g in inventory if not monitor.is_healthy(g.uuid)] == [lost]


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
    b = await opened(fake, tmp_path)
    inventory = await b.load()
    setattr(fake.gpus[6], field, value)
    async with watching(b, inventory) as signals:
        signal = await next_signal(signals, not_ok)
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
    b = await opened(fake, tmp_path)
    inventory = await b.load()
    fake.gpus[2].temperature_error = error  # type: ignore[assignment]
    odd = inventory.gpus[2].uuid
    counts = dict.fromkeys((g.uuid for g in inventory), 0)
    async with watching(b, inventory) as signals:
        while min(n for uuid, n in counts.items() if uuid != odd) < 3:
            signal = await next_signal(signals, lambda s: True)
            assert signal.kind is SignalKind.CHECK_OK
            counts[signal.uuid] += 1
    assert (counts[odd] > 0) is emits_ok


# --- events -------------------------------------------------------------------------------


async def test_xid_events_end_to_end_with_the_health_monitor(tmp_path: Path) -> None:
    fake = h100_node()
    b = await opened(fake, tmp_path, EVENTS)
    inventory = await b.load()
    monitor = HealthMonitor(config=EVENTS)
    monitor.set_inventory(inventory)
    uuid = inventory.gpus[4].uuid
    async with watching(b, inventory, also=monitor.observe) as signals:
        await waits(fake)
        fake.inject_event(4, XID, 13)  # an application Xid: reported, then ignored by policy
        signal = await next_signal(signals, not_ok)
        assert (signal.uuid, signal.kind, signal.xid) == (uuid, SignalKind.XID, 13)
        assert monitor.state(uuid) is HealthState.HEALTHY
        fake.inject_event(4, XID, 79)  # fallen off the bus
        signal = await next_signal(signals, not_ok)
        assert (signal.uuid, signal.xid) == (uuid, 79)
    assert monitor.state(uuid) is HealthState.UNHEALTHY
    record = monitor.record(uuid)
    assert record is not None and record.reset_required
    assert all(monitor.is_healthy(g.uuid) for g in inventory if g.uuid != uuid)
    assert threading.get_ident() not in fake.call_threads()


async def test_xid_79_on_a_lost_gpu_takes_out_only_that_gpu(tmp_path: Path) -> None:
    """The event names its device by handle. Reading that handle's UUID fails with GPU_IS_LOST
    for the very GPU an Xid 79 is about; identified that way, the event was blamed on every GPU
    ("Xid 79: event on a device NVML could not identify")."""
    fake = h100_node()
    b = await opened(fake, tmp_path, EVENTS)
    inventory = await b.load()
    monitor = HealthMonitor(config=EVENTS)
    monitor.set_inventory(inventory)
    lost, other = inventory.gpus[0].uuid, inventory.gpus[1].uuid
    async with watching(b, inventory, also=monitor.observe) as signals:
        await waits(fake)
        fake.gpus[0].lost = True
        fake.inject_event(0, XID, 79)
        fake.inject_event(1, XID, 13)  # after it on the same thread: everything the first caused is in
        got = [await next_signal(signals, not_ok)]
        while (got[-1].uuid, got[-1].xid) != (other, 13):
            got.append(await next_signal(signals, not_ok))
    assert [(s.uuid, s.kind, s.xid) for s in got] == [(lost, SignalKind.XID, 79), (other, SignalKind.XID, 13)]
    assert [g.uuid for g in inventory if not monitor.is_healthy(g.uuid)] == [lost]


def test_handles_are_matched_by_the_address_they_hold() -> None:
    """nvidia-ml-py's handles are ctypes pointers: a new object per call, equal only by address."""
    import ctypes

    import pynvml

    device, another = pynvml.struct_c_nvmlDevice_t(), pynvml.struct_c_nvmlDevice_t()
    held = ctypes.pointer(device)
    event = pynvml.c_nvmlEventData_t()
    event.device = ctypes.cast(ctypes.addressof(device), pynvml.c_nvmlDevice_t)
    assert event.device != held  # what a dict keyed by the handle itself would miss
    assert nvml_events.handle_key(event.device) == nvml_events.handle_key(held)
    assert nvml_events.handle_key(ctypes.pointer(another)) != nvml_events.handle_key(held)


async def test_ecc_events(tmp_path: Path) -> None:
    fake = h100_node()
    b = await opened(fake, tmp_path, EVENTS)
    inventory = await b.load()
    async with watching(b, inventory) as signals:
        await waits(fake)
        fake.inject_event(0, DBE)
        fake.inject_event(7, SBE)
        first, second = await next_signal(signals, not_ok), await next_signal(signals, not_ok)
    assert (first.uuid, first.kind, first.xid) == (inventory.gpus[0].uuid, SignalKind.ECC_DOUBLE_BIT, None)
    assert (second.uuid, second.kind) == (inventory.gpus[7].uuid, SignalKind.ECC_SINGLE_BIT)


async def test_events_name_the_mig_device(tmp_path: Path) -> None:
    fake = a100_mig_node()
    b = await opened(fake, tmp_path, EVENTS)
    inventory = await b.load()
    gpu0, gpu1 = inventory.gpus[0], inventory.gpus[1]
    async with watching(b, inventory) as signals:
        await waits(fake)
        fake.inject_event(0, XID, 43, gi=13, ci=0)  # exactly one MIG device
        fake.inject_event(1, XID, 31, gi=0)  # GI only, and that GI has one CI
        fake.inject_event(0, XID, 79, gi=9, ci=0)  # no such MIG device: the GPU
        fake.inject_event(0, XID, 48)  # not about a MIG device
        got = [await next_signal(signals, not_ok) for _ in range(4)]
    assert [(s.uuid, s.xid) for s in got] == [
        (gpu0.mig_devices[2].uuid, 43),
        (gpu1.mig_devices[0].uuid, 31),
        (gpu0.uuid, 79),
        (gpu0.uuid, 48),
    ]


async def test_a_fatal_xid_on_one_mig_device_spares_its_siblings(tmp_path: Path) -> None:
    fake = a100_mig_node()
    b = await opened(fake, tmp_path, EVENTS)
    inventory = await b.load()
    monitor = HealthMonitor(config=EVENTS)
    monitor.set_inventory(inventory)
    gpu0 = inventory.gpus[0]
    bad, *siblings = (gpu0.mig_devices[2], gpu0.mig_devices[0], gpu0.mig_devices[1], gpu0.mig_devices[3])
    async with watching(b, inventory, also=monitor.observe) as signals:
        await waits(fake)
        fake.inject_event(0, XID, 62, gi=bad.gpu_instance_id, ci=bad.compute_instance_id)
        await next_signal(signals, not_ok)
    assert monitor.state(bad.uuid) is HealthState.UNHEALTHY
    assert all(monitor.is_healthy(m.uuid) for m in siblings)
    assert monitor.state(gpu0.uuid) is HealthState.UNHEALTHY  # the whole GPU is not handed out whole


async def test_event_wait_timeouts_just_loop(tmp_path: Path) -> None:
    fake = h100_node()
    b = await opened(fake, tmp_path, EVENTS)
    inventory = await b.load()
    async with watching(b, inventory) as signals:
        await waits(fake, 4)  # three waits timed out
        assert all(not not_ok(s) for s in [signals.get_nowait() for _ in range(signals.qsize())])
        fake.inject_event(2, XID, 94)
        signal = await next_signal(signals, not_ok)
    assert (signal.uuid, signal.xid) == (inventory.gpus[2].uuid, 94)
    assert len(fake.event_sets) == 1


async def test_unexpected_wait_error_is_logged_and_waiting_continues(tmp_path: Path) -> None:
    fake = h100_node()
    b = await opened(fake, tmp_path, EVENTS)
    inventory = await b.load()
    with capture_logs() as logs:
        async with watching(b, inventory) as signals:
            await waits(fake)
            fake.inject_wait_error(fake_pynvml.NVML_ERROR_UNKNOWN)
            # the wait in progress times out, the next one fails, the one after the backoff waits again
            await waits(fake, fake.wait_calls + 2)
            fake.inject_event(1, XID, 62)
            signal = await next_signal(signals, not_ok)
    assert (signal.uuid, signal.xid) == (inventory.gpus[1].uuid, 62)
    assert any(e["event"] == "NVML event wait failed; retrying" for e in logs)
    assert len(fake.event_sets) == 1  # one failure does not re-create the set


async def test_gpu_lost_from_the_event_wait_reports_only_that_gpu(tmp_path: Path) -> None:
    fake = h100_node()
    b = await opened(fake, tmp_path, EVENTS)
    inventory = await b.load()
    async with watching(b, inventory) as signals:
        await waits(fake)
        fake.gpus[5].lost = True
        fake.inject_wait_error(fake_pynvml.NVML_ERROR_GPU_IS_LOST)
        signal = await next_signal(signals, not_ok)
        assert (signal.uuid, signal.kind) == (inventory.gpus[5].uuid, SignalKind.LOST)
        await until(lambda: len(fake.live_sets()) == 1 and len(fake.event_sets) == 2)  # a new set, without GPU 5
        await waits(fake, fake.wait_calls + 1)
        fake.inject_event(0, XID, 31)  # the others are still watched
        signal = await next_signal(signals, lambda s: s.kind is SignalKind.XID)
        assert (signal.uuid, signal.xid) == (inventory.gpus[0].uuid, 31)
    lost = {s.uuid for s in [signals.get_nowait() for _ in range(signals.qsize())] if s.kind is SignalKind.LOST}
    assert lost <= {inventory.gpus[5].uuid}
    assert inventory.gpus[5].uuid not in fake.event_sets[1].registrations


async def test_registration_failing_with_unknown_recreates_the_set_without_that_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nvml.h: after NVML_ERROR_UNKNOWN from nvmlDeviceRegisterEvents the set is in an
    undefined state and should be freed. The other GPUs must keep their events."""
    monkeypatch.setattr(nvml_events, "REFUSED_RETRY_MIN_S", 0.2)
    fake = h100_node()
    fake.gpus[2].register_error = fake_pynvml.NVML_ERROR_UNKNOWN
    b = await opened(fake, tmp_path, EVENTS, blind_after_s=0.1)
    inventory = await b.load()
    monitor = HealthMonitor(config=EVENTS)
    monitor.set_inventory(inventory)
    refusing = inventory.gpus[2].uuid
    async with watching(b, inventory, also=monitor.observe) as signals:
        await until(lambda: len(fake.live_sets()) == 1 and fake.event_sets[0].freed)
        await waits(fake, fake.wait_calls + 1)
        fake.inject_event(0, XID, 62)
        signal = await next_signal(signals, lambda s: s.kind is SignalKind.XID)
        assert signal.uuid == inventory.gpus[0].uuid
        unwatched = await next_signal(signals, lambda s: s.kind is SignalKind.UNMONITORED)
        assert unwatched.uuid == refusing and "NVML error 999" in unwatched.detail
        assert monitor.state(refusing) is HealthState.UNKNOWN
        fake.gpus[2].register_error = None  # it accepts registration again: tried on a fresh set
        back = await next_signal(signals, lambda s: s.kind is SignalKind.MONITORED)
        assert back.uuid == refusing
    assert monitor.state(refusing) is HealthState.HEALTHY
    assert fake.live_sets() == [] and all(s.freed for s in fake.event_sets)


async def test_a_gpu_that_keeps_refusing_registration_leaves_the_others_monitored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each retry of the refusing GPU frees the set, so for a backoff no GPU is watched. Timed
    from when the refusing GPU went blind, that moment took every other GPU out as UNKNOWN at
    every retry (and made the test above name GPU 0 first when a loaded machine was slow)."""
    monkeypatch.setattr(nvml_events, "REFUSED_RETRY_MIN_S", 0.2)
    fake = h100_node()
    fake.gpus[2].register_error = fake_pynvml.NVML_ERROR_UNKNOWN
    b = await opened(fake, tmp_path, EVENTS, blind_after_s=0.1)
    inventory = await b.load()
    refusing = inventory.gpus[2].uuid
    async with watching(b, inventory) as signals:
        # sets: refused, without it, refused again on the retry, without it, refused, without it
        await until(lambda: len(fake.event_sets) >= 6)
    seen = [signals.get_nowait() for _ in range(signals.qsize())]
    assert [s.uuid for s in seen if s.kind in (SignalKind.UNMONITORED, SignalKind.MONITORED)] == [refusing]


async def test_a_wait_that_keeps_failing_takes_gpus_out_as_unknown_until_events_flow(tmp_path: Path) -> None:
    fake = h100_node()
    b = await opened(fake, tmp_path, CHECKS, blind_after_s=0.1)
    inventory = await b.load()
    monitor = HealthMonitor(config=CHECKS)
    monitor.set_inventory(inventory)
    uuids = {g.uuid for g in inventory}
    async with watching(b, inventory, also=monitor.observe) as signals:
        await waits(fake)
        fake.break_waits(fake_pynvml.NVML_ERROR_UNKNOWN)
        seen: set[str] = set()
        while seen != uuids:
            seen.add((await next_signal(signals, lambda s: s.kind is SignalKind.UNMONITORED)).uuid)
        assert monitor.counts()[HealthState.UNKNOWN] == 8  # out of service although checks pass
        await asyncio.sleep(0.1)  # passing checks do not bring them back
        assert monitor.counts()[HealthState.UNKNOWN] == 8
        await until(lambda: len(fake.event_sets) >= 2)  # the set is re-created on the way
        fake.break_waits(None)
        seen = set()
        while seen != uuids:
            seen.add((await next_signal(signals, lambda s: s.kind is SignalKind.MONITORED)).uuid)
    assert monitor.counts()[HealthState.HEALTHY] == 8
    assert b.status()["events"] == {"running": False}


async def test_overlapping_watches_report_each_xid_once(tmp_path: Path) -> None:
    """During an inventory change the new watch starts before the old one ends; NVML gives
    every event set each event, so two event threads would count one Xid twice."""
    fake = h100_node()
    b = await opened(fake, tmp_path, EVENTS)
    inventory = await b.load()
    twice = HealthConfig(
        check_interval_s=3600, event_wait_ms=20, xids={62: XidRule.from_config("count 2 within 60s", "")}
    )
    monitor = HealthMonitor(config=twice)
    monitor.set_inventory(inventory)
    uuid = inventory.gpus[1].uuid
    async with watching(b, inventory, also=monitor.observe, close=False) as old:
        await waits(fake)
        async with watching(b, inventory, also=monitor.observe) as new:
            await waits(fake, fake.wait_calls + 1)
            fake.inject_event(1, XID, 62)
            signal = await next_signal(new, not_ok)
            assert (signal.uuid, signal.xid) == (uuid, 62)
            await waits(fake, fake.wait_calls + 2)  # time for a second delivery, if there were one
        assert [s for s in [old.get_nowait() for _ in range(old.qsize())] if s.kind is SignalKind.XID] == []
    assert monitor.state(uuid) is HealthState.HEALTHY  # one Xid 62 of the two the rule wants
    assert len(fake.event_sets) == 1


async def test_fewer_event_types_when_not_supported_logged_once(tmp_path: Path) -> None:
    fake = a100_mig_node()
    fake.gpus[1].supported_events = XID | DBE
    fake.gpus[2].supported_events = XID
    b = await opened(fake, tmp_path, EVENTS)
    inventory = await b.load()
    with capture_logs() as logs:
        for _ in range(2):  # a second watch (a new event thread) does not repeat the line
            async with watching(b, inventory):
                await waits(fake, fake.wait_calls + 1)
            await b.open()
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
    b = await opened(fake, tmp_path, HealthConfig(check_interval_s=3600, event_wait_ms=50))
    inventory = await b.load()
    task = asyncio.create_task(b.watch_health(inventory, lambda s: None))
    await waits(fake)
    assert any(t.name == "nvml-events" for t in threading.enumerate())
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)  # a hang guard: the thread ends after one event_wait_ms
    assert not any(t.name == "nvml-events" for t in threading.enumerate())
    assert [s.freed for s in fake.event_sets] == [True]
    await b.close()


# --- the health config, live ----------------------------------------------------------------


async def test_health_disabled_only_waits(tmp_path: Path) -> None:
    fake = h100_node()
    b = await opened(fake, tmp_path, HealthConfig(enabled=False))
    inventory = await b.load()
    before = len(fake.call_names())
    task = asyncio.create_task(b.watch_health(inventory, lambda s: pytest.fail(f"signal {s}")))
    for _ in range(20):  # let the watch run a while; it must neither end nor call NVML
        await asyncio.sleep(0)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)
    assert len(fake.call_names()) == before and fake.event_sets == []
    await b.close()


async def test_turning_health_on_and_off_live(tmp_path: Path) -> None:
    fake = h100_node()
    b = await opened(fake, tmp_path, HealthConfig(enabled=False, check_interval_s=0.02, event_wait_ms=20))
    inventory = await b.load()
    async with watching(b, inventory) as signals:
        await asyncio.sleep(0.05)
        assert signals.empty() and fake.event_sets == []
        b.update_health_config(HealthConfig(enabled=True, check_interval_s=0.02, event_wait_ms=20))
        await next_signal(signals, lambda s: s.kind is SignalKind.CHECK_OK)
        await waits(fake)
        fake.inject_event(3, XID, 79)
        assert (await next_signal(signals, not_ok)).xid == 79

        b.update_health_config(HealthConfig(enabled=False, check_interval_s=0.02, event_wait_ms=20))
        await until(lambda: fake.live_sets() == [])
        while not signals.empty():
            signals.get_nowait()
        await asyncio.sleep(0.1)
        assert signals.empty()  # no checks, no events
        assert not any(t.name == "nvml-events" for t in threading.enumerate())


async def test_check_interval_and_event_wait_apply_live(tmp_path: Path) -> None:
    fake = h100_node()
    b = await opened(fake, tmp_path, HealthConfig(check_interval_s=3600, event_wait_ms=3000))
    inventory = await b.load()
    uuid = inventory.gpus[0].uuid
    async with watching(b, inventory) as signals:
        await next_signal(signals, lambda s: s.kind is SignalKind.CHECK_OK and s.uuid == uuid)  # the first check
        b.update_health_config(HealthConfig(check_interval_s=0.02, event_wait_ms=20))
        for _ in range(3):  # long before the old hour is up
            await next_signal(signals, lambda s: s.kind is SignalKind.CHECK_OK and s.uuid == uuid)
        calls = fake.wait_calls
        await waits(fake, calls + 5)  # 20 ms waits now, not 3 s
