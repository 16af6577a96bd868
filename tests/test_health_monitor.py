from __future__ import annotations

from collections import deque

import pytest

from agent.core.config.loader import build_config
from agent.core.config.schema import HealthConfig
from agent.core.health.model import HealthState, Signal, SignalKind
from agent.core.health.monitor import HealthMonitor
from agent.core.health.policy import classify
from agent.core.inventory.model import Gpu, Inventory, MigDevice


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _health(**doc: object) -> HealthConfig:
    return build_config({"health": doc}).health


def _inventory() -> Inventory:
    mig, sibling = (
        MigDevice(
            uuid=f"MIG-{name}",
            parent_uuid="GPU-1",
            index=i,
            gpu_instance_id=1 + i,
            compute_instance_id=0,
            profile="3g.40gb",
            memory_mib=40000,
        )
        for i, name in enumerate("ab")
    )
    gpus = (
        Gpu(
            uuid="GPU-0",
            index=0,
            minor=0,
            product_name="H100",
            architecture="hopper",
            compute_capability="9.0",
            memory_mib=81559,
            pci_bus_id="00000000:18:00.0",
            numa_node=0,
        ),
        Gpu(
            uuid="GPU-1",
            index=1,
            minor=1,
            product_name="H100",
            architecture="hopper",
            compute_capability="9.0",
            memory_mib=81559,
            pci_bus_id="00000000:2a:00.0",
            numa_node=0,
            mig_enabled=True,
            mig_devices=(mig, sibling),
        ),
    )
    return Inventory(backend="test", driver_version="570", cuda_driver_version="12.8", gpus=gpus)


def _monitor(**doc: object) -> tuple[HealthMonitor, FakeClock]:
    clock = FakeClock()
    monitor = HealthMonitor(config=_health(**doc), clock=clock, wall=lambda: "t")
    monitor.set_inventory(_inventory())
    return monitor, clock


def xid(n: int, uuid: str = "GPU-0") -> Signal:
    return Signal(uuid=uuid, kind=SignalKind.XID, xid=n)


def ok(uuid: str = "GPU-0") -> Signal:
    return Signal(uuid=uuid, kind=SignalKind.CHECK_OK)


@pytest.mark.parametrize(
    ("signal", "fault", "reset"),
    [
        (xid(13), False, False),
        (xid(31), False, False),
        (xid(43), False, False),
        (xid(45), False, False),
        (xid(68), False, False),
        (xid(109), False, False),
        (xid(63), True, False),
        (xid(79), True, True),
        (xid(48), True, True),
        (Signal(uuid="GPU-0", kind=SignalKind.ECC_DOUBLE_BIT), True, False),
        (Signal(uuid="GPU-0", kind=SignalKind.ECC_SINGLE_BIT), False, False),
        (Signal(uuid="GPU-0", kind=SignalKind.LOST), True, False),
        (Signal(uuid="GPU-0", kind=SignalKind.GARBAGE, detail="memory total 0"), True, False),
        (Signal(uuid="GPU-0", kind=SignalKind.INJECTED_FAULT), True, True),
        (ok(), False, False),
    ],
)
def test_default_policy(signal: Signal, fault: bool, reset: bool) -> None:
    verdict = classify(signal, HealthConfig(), {}, now=0.0)
    assert (verdict is not None) == fault
    if verdict is not None:
        assert verdict.reset_required == reset


def test_count_rule_needs_n_within_window() -> None:
    config = _health(xids={94: "count 3 within 10s"})
    times: dict[int, deque[float]] = {}
    assert classify(xid(94), config, times, now=0.0) is None
    assert classify(xid(94), config, times, now=5.0) is None
    assert classify(xid(94), config, times, now=20.0) is None  # the first two fell out of the window
    assert classify(xid(94), config, times, now=21.0) is None
    fault = classify(xid(94), config, times, now=22.0)
    assert fault is not None and "3 times within 10s" in fault.cause


def test_ignored_xid_keeps_device_healthy_and_fatal_one_flips_it() -> None:
    monitor, _ = _monitor()
    with monitor.changes.subscribe() as changes:
        monitor.observe(xid(13))
        assert monitor.state("GPU-0") is HealthState.HEALTHY
        assert changes.drain() == []
        monitor.observe(xid(63))
        assert monitor.state("GPU-0") is HealthState.UNHEALTHY
        (change,) = changes.drain()
        assert change.uuid == "GPU-0" and change.new is HealthState.UNHEALTHY and change.xid == 63


def test_recovery_after_quiet_period_with_hysteresis() -> None:
    monitor, clock = _monitor(recovery_quiet_s=30)
    monitor.observe(xid(63))
    clock.now += 1
    monitor.observe(ok())  # first clean check starts the quiet period
    clock.now += 20
    monitor.observe(ok())
    assert monitor.state("GPU-0") is HealthState.UNHEALTHY
    monitor.observe(xid(63))  # flapping: the quiet period starts over
    clock.now += 25
    monitor.observe(ok())
    clock.now += 29
    monitor.observe(ok())
    assert monitor.state("GPU-0") is HealthState.UNHEALTHY
    clock.now += 1
    monitor.observe(ok())
    assert monitor.state("GPU-0") is HealthState.HEALTHY
    record = monitor.record("GPU-0")
    assert record is not None
    assert [h.state for h in record.history] == [HealthState.UNHEALTHY, HealthState.UNHEALTHY, HealthState.HEALTHY]
    assert "recovered after 30s" in record.history[-1].cause


def test_reset_required_fault_never_recovers_by_checks() -> None:
    monitor, clock = _monitor(recovery_quiet_s=0)
    monitor.observe(xid(79))
    for _ in range(5):
        clock.now += 100
        monitor.observe(ok())
    assert monitor.state("GPU-0") is HealthState.UNHEALTHY
    monitor.observe(Signal(uuid="GPU-0", kind=SignalKind.INJECTED_HEAL))
    assert monitor.state("GPU-0") is HealthState.HEALTHY


def test_a_fault_on_a_mig_device_spares_its_siblings() -> None:
    monitor, clock = _monitor(recovery_quiet_s=30)
    assert monitor.state("MIG-a") is HealthState.HEALTHY
    monitor.observe(xid(63, uuid="MIG-a"))  # NVML attributed it to this MIG device
    assert monitor.state("MIG-a") is HealthState.UNHEALTHY
    assert monitor.state("MIG-b") is HealthState.HEALTHY
    assert monitor.state("GPU-1") is HealthState.UNHEALTHY  # the GPU as a whole includes the bad instance
    assert monitor.state("GPU-0") is HealthState.HEALTHY
    assert monitor.state("GPU-unknown") is HealthState.UNKNOWN
    assert monitor.counts()[HealthState.UNHEALTHY] == 1
    record = monitor.record("MIG-a")
    assert record is not None and record.uuid == "MIG-a"
    # the GPU's passing checks cover its MIG devices
    monitor.observe(ok("GPU-1"))
    clock.now += 31
    monitor.observe(ok("GPU-1"))
    assert monitor.state("MIG-a") is HealthState.HEALTHY and monitor.state("GPU-1") is HealthState.HEALTHY


def test_a_fault_on_the_gpu_takes_out_its_mig_devices() -> None:
    monitor, _ = _monitor()
    monitor.observe(xid(79, uuid="GPU-1"))
    assert monitor.state("MIG-a") is HealthState.UNHEALTHY and monitor.state("MIG-b") is HealthState.UNHEALTHY
    monitor.observe(Signal(uuid="GPU-1", kind=SignalKind.INJECTED_HEAL))  # healing the GPU heals its MIG devices
    monitor.observe(xid(79, uuid="MIG-b"))
    monitor.observe(Signal(uuid="GPU-1", kind=SignalKind.INJECTED_HEAL))
    assert all(monitor.is_healthy(u) for u in ("GPU-1", "MIG-a", "MIG-b"))


def test_unmonitored_devices_are_unknown_until_monitored_again() -> None:
    monitor, clock = _monitor(recovery_quiet_s=10)
    monitor.observe(Signal(uuid="GPU-0", kind=SignalKind.UNMONITORED, detail="wait failing"))
    assert monitor.state("GPU-0") is HealthState.UNKNOWN and not monitor.is_healthy("GPU-0")
    record = monitor.record("GPU-0")
    assert record is not None and record.cause == "health events cannot be received: wait failing"
    for _ in range(3):  # passing checks do not make up for unseen Xids
        clock.now += 100
        monitor.observe(ok())
    assert monitor.state("GPU-0") is HealthState.UNKNOWN
    monitor.observe(xid(62))  # a fault while unmonitored (seen by other means) still counts
    assert monitor.state("GPU-0") is HealthState.UNHEALTHY
    monitor.observe(ok())
    clock.now += 11
    monitor.observe(ok())
    assert monitor.state("GPU-0") is HealthState.UNKNOWN  # recovered from the fault, still unmonitored
    monitor.observe(Signal(uuid="GPU-0", kind=SignalKind.MONITORED))
    assert monitor.state("GPU-0") is HealthState.HEALTHY
    assert [h.state for h in record.history] == [
        HealthState.UNKNOWN,
        HealthState.UNHEALTHY,
        HealthState.UNKNOWN,
        HealthState.HEALTHY,
    ]


def test_disabling_health_clears_unmonitored() -> None:
    monitor, _ = _monitor()
    monitor.observe(Signal(uuid="GPU-0", kind=SignalKind.UNMONITORED))
    monitor.update_config(_health(enabled=False))
    assert monitor.state("GPU-0") is HealthState.HEALTHY
    monitor.observe(Signal(uuid="GPU-0", kind=SignalKind.UNMONITORED))  # ignored while disabled
    assert monitor.state("GPU-0") is HealthState.HEALTHY


def test_unknown_device_signals_are_ignored() -> None:
    monitor, _ = _monitor()
    monitor.observe(xid(79, uuid="GPU-gone"))
    assert monitor.counts()[HealthState.HEALTHY] == 2


def test_disabled_health_ignores_backend_signals_but_not_operator() -> None:
    monitor, _ = _monitor(enabled=False)
    monitor.observe(xid(79))
    assert monitor.state("GPU-0") is HealthState.HEALTHY
    monitor.observe(Signal(uuid="GPU-0", kind=SignalKind.INJECTED_FAULT))
    assert monitor.state("GPU-0") is HealthState.UNHEALTHY


def test_history_is_bounded() -> None:
    monitor, _ = _monitor(history_size=3)
    for n in range(10):
        monitor.observe(xid(60 + n))
    record = monitor.record("GPU-0")
    assert record is not None and len(record.history) == 3
    assert record.history[-1].xid == 69
    assert monitor.transitions[HealthState.UNHEALTHY] == 1


def test_config_update_applies_new_policy() -> None:
    monitor, _ = _monitor()
    monitor.update_config(_health(xids={63: "ignore"}))
    monitor.observe(xid(63))
    assert monitor.state("GPU-0") is HealthState.HEALTHY


def test_set_inventory_keeps_records_of_remaining_gpus() -> None:
    monitor, _ = _monitor()
    monitor.observe(xid(63))
    monitor.set_inventory(_inventory())
    assert monitor.state("GPU-0") is HealthState.UNHEALTHY


def test_disabling_health_live_returns_every_device_to_service() -> None:
    monitor, _ = _monitor()
    monitor.observe(xid(79))
    assert monitor.state("GPU-0") is HealthState.UNHEALTHY
    with monitor.changes.subscribe() as changes:
        monitor.update_config(_health(enabled=False))
        assert monitor.state("GPU-0") is HealthState.HEALTHY
        (change,) = changes.drain()
        assert change.cause == "health checks disabled"


def test_a_fault_that_persists_is_said_once_and_again_when_it_changes() -> None:
    """A lost GPU fails every periodic check: "fault on unhealthy device" was a warning every
    time, and each one pushed a history entry, so the history held nothing else."""
    from structlog.testing import capture_logs

    monitor, clock = _monitor(recovery_quiet_s=30, history_size=5)
    lost = Signal(uuid="GPU-0", kind=SignalKind.LOST, detail="while reading its UUID")
    with capture_logs() as logs:
        for _ in range(10):
            clock.now += 1
            monitor.observe(lost)
        monitor.observe(xid(79))  # a different fault: news
        monitor.observe(lost)  # and the first one back: news again
    warnings = [(e["event"], e.get("cause")) for e in logs if e["log_level"] == "warning"]
    assert [event for event, _ in warnings] == ["device health changed", *["fault on unhealthy device"] * 2]
    assert sum(e["event"] == "fault on unhealthy device" and e["log_level"] == "debug" for e in logs) == 9
    record = monitor.record("GPU-0")
    assert record is not None and len(record.history) == 3  # the transition, Xid 79, lost again
