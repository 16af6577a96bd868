"""Utilization and memory readings: the backends' ``sample`` and the sampler that bounds them.

The NVML path runs over the fake pynvml (the real code, no GPU); a reading that fails or hangs
must make the values unknown and never stall the event loop or pile up threads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.backends.backend import NullBackend
from agent.backends.nvml.backend import NvmlBackend
from agent.backends.simulated import SimulatedBackend
from agent.core.config.current import ConfigState
from agent.core.config.loader import LoadedConfig, build_config
from agent.core.inventory.current import InventoryState
from agent.core.inventory.model import Inventory
from agent.core.inventory.sample import DeviceSample
from agent.observe.utilization import UtilizationSampler
from tests.fakes.fake_pynvml import NVML_ERROR_UNKNOWN, FakeNvml, a100_mig_node, h100_node
from tests.nvml_fixtures import opened
from tests.test_plugin_fakes import wait_for

MIB = 1024 * 1024


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def config_state(**metrics: object) -> ConfigState:
    config = build_config({"metrics": {"utilization_interval_s": 0.05, **metrics}})
    return ConfigState(LoadedConfig(config=config, version="t", source="test"))


def test_the_fake_utilization_struct_is_pynvmls() -> None:
    real = pytest.importorskip("pynvml")
    fake = h100_node()
    assert [name for name, _ in real.c_nvmlUtilization_t._fields_] == [
        f.name for f in dataclasses.fields(fake.c_nvmlUtilization_t)
    ]


# --- the backends ----------------------------------------------------------------------------


async def test_simulated_readings_are_plausible_deterministic_and_follow_the_holders() -> None:
    backend = SimulatedBackend(preset="h100-8x-nvlink", node_name="n", health=build_config({}).health)
    inventory = await backend.load()
    held = inventory.gpus[2].uuid
    first = await backend.sample(inventory, busy=frozenset({held}))
    again = await SimulatedBackend(preset="h100-8x-nvlink", node_name="n", health=build_config({}).health).sample(
        inventory, busy=frozenset({held})
    )
    assert first == again  # the same node gives the same readings
    for gpu in inventory.gpus:
        sample = first[gpu.uuid]
        assert sample.memory_total_mib == gpu.memory_mib
        assert sample.memory_used_mib is not None and 0 <= sample.memory_used_mib <= gpu.memory_mib
        assert sample.gpu_percent is not None and 0 <= sample.gpu_percent <= 100
    busy, idle = first[held], first[inventory.gpus[0].uuid]
    assert busy.gpu_percent is not None and busy.gpu_percent >= 40 and idle.gpu_percent == 0.0
    assert busy.memory_used_mib is not None and busy.memory_used_mib > inventory.gpus[2].memory_mib // 5
    assert idle.memory_used_mib is not None and idle.memory_used_mib < 16
    # the load moves from one reading to the next
    later = [(await backend.sample(inventory, busy=frozenset({held})))[held].gpu_percent for _ in range(5)]
    assert len(set(later)) > 1


async def test_simulated_mig_devices_report_memory_only() -> None:
    backend = SimulatedBackend(preset="a100-4x-mig", node_name="n", health=build_config({}).health)
    inventory = await backend.load()
    gpu = next(g for g in inventory.gpus if g.mig_devices)
    samples = await backend.sample(inventory, busy=frozenset({gpu.uuid}))
    for mig in gpu.mig_devices:
        assert samples[mig.uuid].gpu_percent is None and samples[mig.uuid].memory_total_mib == mig.memory_mib
    parent = samples[gpu.uuid]
    assert parent.gpu_percent is None
    assert parent.memory_used_mib == sum(samples[m.uuid].memory_used_mib or 0 for m in gpu.mig_devices)


async def test_nvml_readings_through_each_gpus_own_handle(tmp_path: Path) -> None:
    fake = h100_node()
    fake.gpus[1].utilization, fake.gpus[1].memory_used_mib = 87, 40960
    backend = await opened(fake, tmp_path)
    try:
        inventory = await backend.load()
        samples = await backend.sample(inventory, busy=frozenset())
        assert samples[fake.gpus[1].uuid] == DeviceSample(fake.gpus[1].uuid, 87.0, 40960, 81559)
        assert samples[fake.gpus[0].uuid].gpu_percent == 0.0
        assert "nvmlDeviceGetHandleByUUID" not in fake.call_names()  # never by UUID (GPU_IS_LOST rule)
        # the reading ran in a thread of its own, not on the loop's thread
        assert threading.get_ident() not in {tid for name, tid in fake.calls if name == "nvmlDeviceGetUtilizationRates"}
    finally:
        await backend.close()


async def test_nvml_mig_readings_and_a_failing_gpu(tmp_path: Path) -> None:
    fake = a100_mig_node()
    fake.gpus[2].utilization_error = NVML_ERROR_UNKNOWN
    backend = await opened(fake, tmp_path)
    try:
        inventory = await backend.load()
        samples = await backend.sample(inventory, busy=frozenset())
        mig_gpu = inventory.gpus[0]
        assert samples[mig_gpu.uuid].gpu_percent is None  # NOT_SUPPORTED in MIG mode: no number, still read
        assert samples[mig_gpu.uuid].memory_total_mib == 40960
        for mig in mig_gpu.mig_devices:
            assert samples[mig.uuid].memory_total_mib == mig.memory_mib and samples[mig.uuid].gpu_percent is None
        assert inventory.gpus[2].uuid not in samples  # its query failed: unknown, not zero
        assert samples[inventory.gpus[3].uuid].memory_total_mib is not None
    finally:
        await backend.close()


async def test_null_backend_and_a_closed_nvml_backend_read_nothing(tmp_path: Path) -> None:
    assert await NullBackend().sample(Inventory.empty("none"), busy=frozenset()) == {}
    fake = h100_node()
    backend = await opened(fake, tmp_path)
    inventory = await backend.load()
    await backend.close()
    assert await backend.sample(inventory, busy=frozenset()) == {}


# --- the sampler ------------------------------------------------------------------------------


@pytest.fixture
async def nvml(tmp_path: Path) -> AsyncIterator[tuple[FakeNvml, NvmlBackend, Inventory]]:
    fake = h100_node()
    backend = await opened(fake, tmp_path)
    inventory = await backend.load()
    try:
        yield fake, backend, inventory
    finally:
        for gpu in fake.gpus:  # let a hung reading finish, so close() can shut NVML down
            if gpu.utilization_hang is not None:
                gpu.utilization_hang.set()
        await backend.close()


async def test_the_sampler_keeps_the_newest_reading_and_calls_old_ones_unknown(
    nvml: tuple[FakeNvml, NvmlBackend, Inventory],
) -> None:
    fake, backend, inventory = nvml
    clock = Clock()
    sampler = UtilizationSampler(
        backend=backend,
        inventory=InventoryState(inventory),
        config=config_state(utilization_stale_intervals=2),
        busy=frozenset,
        clock=clock,
    )
    uuid = inventory.gpus[0].uuid
    assert not sampler.get(uuid).known and sampler.get(uuid).reason == "not sampled yet"
    fake.gpus[0].utilization = 55
    await sampler.sample_once()
    reading = sampler.get(uuid)
    assert reading.known and reading.as_dict()["gpu_percent"] == 55.0 and reading.age_s == 0.0
    clock.now += 0.09  # within two intervals: still fresh
    assert sampler.get(uuid).known
    clock.now += 0.02
    stale = sampler.get(uuid)
    assert not stale.known and stale.as_dict()["gpu_percent"] is None
    assert stale.reason == "the newest reading is 0.1s old"


async def test_a_hung_nvml_call_marks_values_unknown_without_stalling_anything(
    nvml: tuple[FakeNvml, NvmlBackend, Inventory],
) -> None:
    fake, backend, inventory = nvml
    clock = Clock()
    sampler = UtilizationSampler(
        backend=backend, inventory=InventoryState(inventory), config=config_state(), busy=frozenset, clock=clock
    )
    await sampler.sample_once()
    uuid = inventory.gpus[0].uuid
    assert sampler.get(uuid).known
    hang = threading.Event()
    fake.gpus[3].utilization_hang = hang

    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)

    ticking = asyncio.create_task(ticker())
    try:
        await sampler.sample_once()  # returns after one interval although NVML never answers
        assert sampler.results["timeout"] == 1 and "longer than 0.05s" in sampler.last_error
        assert ticks > 3  # the loop kept running while NVML hung
        clock.now += 0.2
        assert not sampler.get(uuid).known
        assert "longer than 0.05s" in sampler.get(uuid).reason
        threads = {t.name for t in threading.enumerate()}.intersection({"nvml-utilization"})
        for _ in range(3):  # rounds while it still hangs start no second reading
            await sampler.sample_once()
        assert sampler.results["busy"] == 3
        assert sum(1 for t in threading.enumerate() if t.name == "nvml-utilization") == len(threads) == 1
        assert sampler.debug_state()["in_flight"] is True
    finally:
        ticking.cancel()
    hang.set()  # the driver answers again
    fake.gpus[3].utilization_hang = None
    await wait_for(lambda: not sampler.debug_state()["in_flight"], what="the hung reading to return")
    await sampler.sample_once()
    assert sampler.get(uuid).known and sampler.last_error == ""


async def test_a_failing_backend_is_counted_and_never_raises() -> None:
    class Broken:
        async def sample(self, inventory: Inventory, *, busy: frozenset[str]) -> dict[str, DeviceSample]:
            raise RuntimeError("driver went away")

    backend = SimulatedBackend(preset="h100-8x-nvlink", node_name="n", health=build_config({}).health)
    inventory = await backend.load()
    sampler = UtilizationSampler(
        backend=Broken(), inventory=InventoryState(inventory), config=config_state(), busy=frozenset
    )
    await sampler.sample_once()
    assert sampler.results["error"] == 1
    reading = sampler.get(inventory.gpus[0].uuid)
    assert not reading.known and reading.reason == "RuntimeError: driver went away"


async def test_the_sampler_runs_on_its_interval_and_follows_the_holders() -> None:
    backend = SimulatedBackend(preset="h100-8x-nvlink", node_name="n", health=build_config({}).health)
    inventory = await backend.load()
    held: set[str] = set()
    sampler = UtilizationSampler(
        backend=backend,
        inventory=InventoryState(inventory),
        config=config_state(),
        busy=lambda: frozenset(held),
    )
    task = asyncio.create_task(sampler.run())
    try:
        gpu = inventory.gpus[5].uuid
        await wait_for(lambda: sampler.get(gpu).known, what="a first reading")
        assert sampler.get(gpu).as_dict()["gpu_percent"] == 0.0
        held.add(gpu)
        await wait_for(lambda: (sampler.get(gpu).as_dict()["gpu_percent"] or 0) >= 40, what="a busy reading")
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
