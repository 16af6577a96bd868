"""The simulated backend: presets, preset files, deterministic UUIDs and health injection."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agent.backends.preset import DEFAULT_PRESET, preset_names
from agent.backends.simulated import SimulatedBackend
from agent.base.errors import AgentError, ConfigError, DeviceNotFoundError
from agent.core.config.schema import HealthConfig
from agent.core.health.model import HealthState, Signal, SignalKind
from agent.core.health.monitor import HealthMonitor
from agent.core.inventory.model import Inventory, PcieLevel

FAST = HealthConfig(check_interval_s=0.005, recovery_quiet_s=0.0)


def make(preset: str = DEFAULT_PRESET, node: str = "node-a", health: HealthConfig = FAST) -> SimulatedBackend:
    return SimulatedBackend(preset=preset, node_name=node, health=health)


async def inventory_of(preset: str, node: str = "node-a") -> Inventory:
    return await make(preset, node).load()


def all_uuids(inventory: Inventory) -> list[str]:
    """Every device UUID of the node: GPUs and their MIG devices, in inventory order."""
    return [uuid for gpu in inventory for uuid in (gpu.uuid, *(m.uuid for m in gpu.mig_devices))]


# --- presets ------------------------------------------------------------------------------


def test_preset_names() -> None:
    assert preset_names() == ["a100-4x-mig", "h100-8x-nvlink", "workstation-2x-pcie"]
    assert DEFAULT_PRESET == "h100-8x-nvlink"


async def test_h100_preset() -> None:
    inv = await inventory_of("h100-8x-nvlink")
    assert inv.backend == "simulated"
    assert (inv.driver_version, inv.cuda_driver_version) == ("570.124.06", "12.8")
    assert [g.index for g in inv] == list(range(8))
    assert [g.minor for g in inv] == list(range(8))
    assert inv.gpus[0].pci_bus_id == "00000000:18:00.0"
    assert len({g.pci_bus_id for g in inv}) == 8
    for gpu in inv:
        assert gpu.product_name == "NVIDIA H100 80GB HBM3"
        assert (gpu.architecture, gpu.compute_capability, gpu.memory_mib) == ("hopper", "9.0", 81559)
        assert gpu.numa_node == (0 if gpu.index < 4 else 1)
        assert not gpu.mig_enabled and gpu.mig_devices == ()
    assert len(inv.links) == 28
    for a, b in itertools.combinations(inv.gpus, 2):
        link = inv.link(a.uuid, b.uuid)
        assert link.nvlinks == 18
        assert link.pcie is (PcieLevel.NODE if a.numa_node == b.numa_node else PcieLevel.SYSTEM)


async def test_a100_mig_preset() -> None:
    inv = await inventory_of("a100-4x-mig")
    assert len(inv) == 4 and len(inv.links) == 6
    assert {link.describe() for link in inv.links.values()} == {"NV12"}
    assert all(g.mig_enabled and g.memory_mib == 40960 and g.compute_capability == "8.0" for g in inv)
    profiles = [[m.profile for m in g.mig_devices] for g in inv]
    assert profiles == [
        ["1g.5gb"] * 7,
        ["3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"],
        ["4g.20gb", "2g.10gb", "1g.5gb"],
        ["7g.40gb"],
    ]
    gi_ids = [[m.gpu_instance_id for m in g.mig_devices] for g in inv]
    assert gi_ids == [[7, 8, 9, 10, 11, 12, 13], [2, 3, 9, 10], [1, 5, 13], [0]]
    for gpu in inv:
        assert sum(m.memory_mib for m in gpu.mig_devices) <= gpu.memory_mib
        for i, mig in enumerate(gpu.mig_devices):
            assert mig.index == i and mig.parent_uuid == gpu.uuid and mig.compute_instance_id == 0
            assert mig.uuid.startswith("MIG-") and inv.find_mig(mig.uuid) == mig
            # /proc/driver/nvidia-caps/mig-minors: 3 + gpu*135 + gi*9, the CI right after its GI
            assert mig.gi_cap_minor == 3 + gpu.minor * 135 + mig.gpu_instance_id * 9
            assert mig.ci_cap_minor == mig.gi_cap_minor + 1
    assert len(all_uuids(inv)) == 4 + 15


async def test_workstation_preset() -> None:
    inv = await inventory_of("workstation-2x-pcie")
    assert [g.product_name for g in inv] == ["NVIDIA RTX 6000 Ada Generation"] * 2
    assert {(g.architecture, g.compute_capability, g.memory_mib, g.numa_node) for g in inv} == {
        ("ada", "8.9", 49140, 0)
    }
    (link,) = inv.links.values()
    assert (link.nvlinks, link.pcie) == (0, PcieLevel.HOSTBRIDGE)


async def test_uuids_are_deterministic_per_node() -> None:
    first, again, other = [await inventory_of("a100-4x-mig", node) for node in ("node-a", "node-a", "node-b")]
    assert all_uuids(first) == all_uuids(again)
    assert not set(all_uuids(first)) & set(all_uuids(other))
    h100 = await inventory_of("h100-8x-nvlink", "node-a")
    assert not set(all_uuids(first)) & set(all_uuids(h100))
    for uuid in all_uuids(first):
        prefix, _, rest = uuid.partition("-")
        assert prefix in ("GPU", "MIG")
        assert [len(part) for part in rest.split("-")] == [8, 4, 4, 4, 12]


# --- preset files -------------------------------------------------------------------------

USER_PRESET = """
driver_version: 575.51.03
cuda_driver_version: 12.9
defaults: {product_name: NVIDIA L4, architecture: ada, compute_capability: 8.9, memory_mib: 23034}
mig_profiles: {1g.10gb: 9856}
gpus:
  - {uuid: GPU-11111111-2222-3333-4444-555555555555, pci_bus_id: "0000:3b:00.0", numa_node: 0}
  - {numa_node: 1, minor: 5}
  - product_name: NVIDIA H100 80GB HBM3
    architecture: hopper
    compute_capability: "9.0"
    memory_mib: 81559
    mig:
      - 1g.10gb
      - {profile: 3g.40gb, gpu_instance_id: 2, compute_instance_id: 0, uuid: MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee}
topology:
  pcie: system
  pcie_same_numa: node
  pairs:
    - {gpus: [0, 1], nvlinks: 4, pcie: single}
"""


async def test_user_preset_file(tmp_path: Path) -> None:
    path = tmp_path / "my-lab.yaml"
    path.write_text(USER_PRESET)
    backend = make(str(path))
    inv = await backend.load()
    assert backend.preset_key == "my-lab"
    assert (inv.driver_version, inv.cuda_driver_version) == ("575.51.03", "12.9")
    l4, second, h100 = inv.gpus
    assert l4.uuid == "GPU-11111111-2222-3333-4444-555555555555"
    assert l4.pci_bus_id == "00000000:3B:00.0" and l4.compute_capability == "8.9"
    assert (second.index, second.minor, second.pci_bus_id) == (1, 5, "00000000:02:00.0")
    assert h100.product_name == "NVIDIA H100 80GB HBM3" and h100.mig_enabled
    small, big = h100.mig_devices
    assert (small.profile, small.memory_mib, small.gpu_instance_id) == ("1g.10gb", 9856, 7)
    assert (big.uuid, big.gpu_instance_id, big.memory_mib) == ("MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee", 2, 40960)
    assert inv.link(l4.uuid, second.uuid).describe() == "NV4"
    assert inv.link(l4.uuid, second.uuid).pcie is PcieLevel.SINGLE
    assert inv.link(second.uuid, h100.uuid).describe() == "SYS"
    assert len(inv.links) == 3


DEFAULTS = "defaults: {memory_mib: 1, product_name: x, architecture: y, compute_capability: '1.0'}\n"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("gpus: [{memory_mib: lots}]", "gpus[0].memory_mib: expected an integer, got 'lots'"),
        ("gpu: []", "gpu: unknown field"),
        ("gpus: [{}]", "gpus[0].memory_mib: not set here or in defaults"),
        ("topology: {pcie: nvswitch}", "topology.pcie: expected one of"),
        (DEFAULTS + "gpus: [{pci_bus_id: '18:00.0'}]", "gpus[0].pci_bus_id: expected DDDDDDDD:BB:DD.F"),
        (DEFAULTS + "gpus: [{}]\ntopology: {pairs: [{gpus: [0, 3]}]}", "topology.pairs[0].gpus: no GPU with index 3"),
        (DEFAULTS + "gpus: [{mig: [7g.40gb, 1g.5gb]}]", "gpus[0].mig: 7g.40gb, 1g.5gb do not fit"),
        (DEFAULTS + "gpus: [{mig: [big]}]", "gpus[0].mig[0].profile: expected <N>g.<M>gb"),
        (DEFAULTS + "gpus: [{uuid: abc}]", "gpus[0].uuid: GPU UUIDs start with 'GPU-'"),
        (DEFAULTS + "gpus: [{index: 1}, {}]", "gpus[1].index: 1 is used by another GPU"),
        ("gpus: [", "is not valid YAML at line"),
        ("- a list", "expected a mapping at the top level"),
    ],
)
def test_bad_preset_file(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        make(str(path))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"preset file {path}")
    assert expected in message


def test_unknown_preset_lists_known_ones() -> None:
    with pytest.raises(ConfigError) as info:
        make("h200-16x")
    message = str(info.value)
    assert "unknown preset 'h200-16x'" in message
    assert all(name in message for name in preset_names())


def test_missing_preset_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read preset file .*nope\.yaml"):
        make(str(tmp_path / "nope.yaml"))


# --- health -----------------------------------------------------------------------------


@dataclass
class Harness:
    backend: SimulatedBackend
    inventory: Inventory
    monitor: HealthMonitor
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    signals: list[Signal] = field(default_factory=list)
    task: asyncio.Task[None] = field(init=False)

    def emit(self, signal: Signal) -> None:
        self.signals.append(signal)
        self.monitor.observe(signal)
        self.changed.set()

    async def wait_until(self, condition: Callable[[], bool], within_s: float = 10.0) -> None:
        async def wait() -> None:
            while not condition():
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(wait(), within_s)

    def checks_since(self, mark: int, uuid: str) -> int:
        return sum(1 for s in self.signals[mark:] if s.uuid == uuid and s.kind is SignalKind.CHECK_OK)

    async def wait_for_checks(self, uuid: str, count: int = 3) -> None:
        mark = len(self.signals)
        await self.wait_until(lambda: self.checks_since(mark, uuid) >= count)


async def start(preset: str = "a100-4x-mig", health: HealthConfig = FAST) -> Harness:
    backend = make(preset, health=health)
    inventory = await backend.load()
    monitor = HealthMonitor(config=health)
    monitor.set_inventory(inventory)
    harness = Harness(backend, inventory, monitor)
    harness.task = asyncio.create_task(backend.watch_health(inventory, harness.emit))
    await harness.wait_until(lambda: len(harness.signals) >= len(inventory))
    return harness


@pytest.fixture
async def sim() -> AsyncIterator[Harness]:
    harness = await start()
    yield harness
    harness.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await harness.task


async def test_watch_health_checks_every_gpu_and_stops_on_cancel() -> None:
    sim = await start(health=HealthConfig(check_interval_s=3600.0))
    first_round = [(s.uuid, s.kind) for s in sim.signals]
    assert first_round == [(g.uuid, SignalKind.CHECK_OK) for g in sim.inventory]
    sim.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(sim.task, 10.0)
    with pytest.raises(AgentError, match="health monitor is not running"):
        sim.backend.inject("0", healthy=False)


async def test_checks_repeat_at_the_interval(sim: Harness) -> None:
    for gpu in sim.inventory:
        await sim.wait_for_checks(gpu.uuid, 2)


def test_inject_before_watch_health() -> None:
    with pytest.raises(AgentError, match="health monitor is not running"):
        make().inject("0", healthy=False, xid=79)


async def test_xid_79_is_fatal_and_needs_a_heal(sim: Harness) -> None:
    gpu = sim.inventory.gpus[1]
    signal = sim.backend.inject(gpu.uuid, healthy=False, xid=79)
    assert (signal.kind, signal.xid) == (SignalKind.XID, 79)
    assert sim.monitor.state(gpu.uuid) is HealthState.UNHEALTHY
    assert all(sim.monitor.state(m.uuid) is HealthState.UNHEALTHY for m in gpu.mig_devices)
    await sim.wait_for_checks(gpu.uuid)  # Xids are events: checks go on, but cannot undo a reset-required fault
    assert sim.monitor.state(gpu.uuid) is HealthState.UNHEALTHY
    assert sim.monitor.is_healthy(sim.inventory.gpus[0].uuid)

    assert sim.backend.inject("1", healthy=True).kind is SignalKind.INJECTED_HEAL
    assert sim.monitor.state(gpu.uuid) is HealthState.HEALTHY


async def test_xid_13_is_ignored(sim: Harness) -> None:
    sim.backend.inject("2", healthy=False, xid=13)
    assert sim.monitor.counts()[HealthState.HEALTHY] == len(sim.inventory)


async def test_fatal_xid_without_reset_recovers_through_checks(sim: Harness) -> None:
    uuid = sim.inventory.gpus[3].uuid
    sim.backend.inject(uuid, healthy=False, xid=62)
    assert sim.monitor.state(uuid) is HealthState.UNHEALTHY
    await sim.wait_until(lambda: sim.monitor.is_healthy(uuid))  # hysteresis, as with NVML


async def test_fault_without_xid_holds_checks_until_healed(sim: Harness) -> None:
    gpu, other = sim.inventory.gpus[0], sim.inventory.gpus[2]
    mig = gpu.mig_devices[3]
    assert sim.backend.inject(mig.uuid, healthy=False).kind is SignalKind.INJECTED_FAULT
    assert sim.monitor.state(gpu.uuid) is HealthState.UNHEALTHY
    assert sim.backend.status()["faulted"] == [gpu.uuid]
    mark = len(sim.signals)
    await sim.wait_for_checks(other.uuid)
    assert sim.checks_since(mark, gpu.uuid) == 0
    assert sim.monitor.state(gpu.uuid) is HealthState.UNHEALTHY

    sim.backend.inject("0", healthy=True)
    assert sim.monitor.state(mig.uuid) is HealthState.HEALTHY
    assert sim.backend.status()["faulted"] == []
    await sim.wait_for_checks(gpu.uuid, 1)


async def test_check_interval_applies_live() -> None:
    sim = await start(health=HealthConfig(check_interval_s=3600, recovery_quiet_s=0.0))
    try:
        uuid = sim.inventory.gpus[0].uuid
        sim.backend.update_health_config(FAST)  # wakes the hour-long sleep
        await sim.wait_for_checks(uuid, 3)
        assert sim.backend.readiness()[0] and sim.backend.status()["preset"] == "a100-4x-mig"
    finally:
        sim.task.cancel()
        await asyncio.gather(sim.task, return_exceptions=True)


async def test_presets_have_a_brand_and_a_pcie_root_per_numa_node() -> None:
    h100 = await inventory_of("h100-8x-nvlink")
    assert {g.brand for g in h100} == {"Nvidia"}
    assert [g.pcie_root for g in h100] == ["pci0000:00"] * 4 + ["pci0000:80"] * 4
    workstation = await inventory_of("workstation-2x-pcie")
    assert {(g.brand, g.pcie_root) for g in workstation} == {("NvidiaRTX", "pci0000:00")}


async def test_preset_file_brand_and_pcie_root(tmp_path: Path) -> None:
    path = tmp_path / "node.yaml"
    base = "defaults: {product_name: L4, architecture: ada, compute_capability: '8.9', memory_mib: 23034}\n"
    path.write_text(base + "gpus: [{brand: GeForce, pcie_root: pci0000:3a}, {numa_node: 3}]\n")
    inv = await inventory_of(str(path))
    assert [(g.brand, g.pcie_root) for g in inv] == [("GeForce", "pci0000:3a"), ("Nvidia", "pci0003:00")]
    path.write_text(base + "gpus: [{pcie_root: '0000:3a'}]\n")
    with pytest.raises(ConfigError, match=r"gpus\[0\]\.pcie_root: expected pci<domain>:<bus>"):
        await inventory_of(str(path))


async def test_unknown_device(sim: Harness) -> None:
    for device in ("GPU-00000000-0000-0000-0000-000000000000", "9", "MIG-nope", ""):
        with pytest.raises(DeviceNotFoundError, match="no simulated device"):
            sim.backend.inject(device, healthy=False, xid=79)
    assert sim.monitor.counts()[HealthState.HEALTHY] == len(sim.inventory)


def test_a_preset_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "node.yaml"
    path.write_bytes(b"gpus: [\xff]\n")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        SimulatedBackend(preset=str(path), node_name="n", health=HealthConfig())
