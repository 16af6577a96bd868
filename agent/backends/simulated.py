"""The simulated backend: GPUs described by a preset, for kind clusters, laptops and tests.

Selected only explicitly (``gpu-agent run --simulated [--preset NAME|FILE]``). Everything is
deterministic: the same preset on the same node name gives the same inventory and UUIDs, and
health changes only when :meth:`SimulatedBackend.inject` says so.

The preset format and how inventories are built from it live in ``agent.backends.preset``.
MIG instances are made and destroyed in memory (:class:`~agent.backends.simulated_mig.SimulatedMig`)
and MPS daemons are records (:class:`~agent.backends.simulated_mps.SimulatedMps`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import threading
from pathlib import Path

import structlog

from agent.backends.backend import SignalSink
from agent.backends.preset import LoadedPreset, build_inventory, derived_uuid, load_preset, preset_names
from agent.backends.simulated_mig import SimulatedMig
from agent.backends.simulated_mps import SimulatedMps
from agent.base.errors import AgentError, DeviceNotFoundError
from agent.core.config.schema import HealthConfig
from agent.core.health.model import Signal, SignalKind
from agent.core.inventory.model import Gpu, Inventory
from agent.core.inventory.sample import DeviceSample
from agent.core.partitioning import MpsControl, NoMps, PartitionErrorKind

log = structlog.get_logger("agent.inventory.simulated")


class SimulatedBackend:
    """A :class:`~agent.backends.backend.Backend` over a preset, with a health-injection hook.

    The preset is read and validated in the constructor, so a bad ``--preset`` fails before
    anything starts. Health: every ``health.check_interval_s`` each GPU passes its check
    (``CHECK_OK``) unless an operator fault (``inject(..., healthy=False)`` without an Xid) is
    on it; injected Xids are one-shot events, exactly like NVML's, so policy and hysteresis
    decide what they mean.

    ``mps_dir``: where MPS daemons' pipe and log directories go (the agent's state directory
    plus ``mps``); without one the node has no MPS.
    """

    name = "simulated"

    def __init__(self, *, preset: str, node_name: str, health: HealthConfig, mps_dir: Path | None = None) -> None:
        self._preset, self._node_name = preset, node_name
        self.mig = SimulatedMig(uuid_for=self._mig_uuid)
        self._base = self._build()  # the preset's inventory; MIG state is laid over it
        self._inventory = self.mig.apply(self._base)  # the inventory under watch (inject's view)
        self.mps: MpsControl = (
            SimulatedMps(base_dir=mps_dir, known=self._known)
            if mps_dir is not None
            else NoMps("simulated MPS needs a state directory (none given)")
        )
        self._health = health
        self._health_changed = asyncio.Event()
        self._emit: SignalSink | None = None
        self._loop_thread: int | None = None
        self._faulted: set[str] = set()  # GPU UUIDs under an operator fault
        self._samples = 0

    async def open(self) -> None:
        return None

    def _build(self) -> Inventory:
        loaded, inventory = self._read()
        self.preset_key, self.description = loaded.key, loaded.spec.description
        return inventory

    def _read(self) -> tuple[LoadedPreset, Inventory]:
        loaded = load_preset(self._preset)
        inventory = build_inventory(loaded.spec, preset_key=loaded.key, node_name=self._node_name, label=loaded.label)
        return loaded, inventory

    async def load(self) -> Inventory:
        """The node's devices, with the MIG instances made and destroyed so far. A preset *file*
        is read again, so editing it simulates a change of hardware (MIG reconfiguration, a GPU
        gone: the GPUs it changes start again from the file); a bad edit raises ConfigError. The
        file is read and parsed in a worker thread (up to 1 MiB of YAML)."""
        if self._preset not in preset_names():
            loaded, self._base = await asyncio.to_thread(self._read)
            self.preset_key, self.description = loaded.key, loaded.spec.description
        return self.mig.apply(self._base)

    def _mig_uuid(self, gpu: Gpu, gpu_instance: int, compute_instance: int) -> str:
        """A MIG device made at run time: the same GPU, instance IDs, node and preset give the same UUID."""
        return derived_uuid(
            "MIG", self._node_name, self.preset_key, "gpu", gpu.index, "gi", gpu_instance, "ci", compute_instance
        )

    def _known(self, uuid: str) -> bool:
        current = self.mig.apply(self._base)
        return current.find(uuid) is not None or current.find_mig(uuid) is not None

    async def close(self) -> None:
        if isinstance(self.mps, SimulatedMps):
            await self.mps.close()

    async def sample(self, inventory: Inventory, *, busy: frozenset[str]) -> dict[str, DeviceSample]:
        """Plausible, deterministic readings: a held GPU works (40-95 %, a quarter to most of its
        memory, changing from one sample to the next), an idle one does nothing. MIG devices
        report memory only, as NVML's do."""
        self._samples += 1
        out: dict[str, DeviceSample] = {}
        for gpu in inventory.gpus:
            held = gpu.uuid in busy
            for mig in gpu.mig_devices:
                out[mig.uuid] = DeviceSample(
                    uuid=mig.uuid,
                    memory_used_mib=_used(mig.uuid, mig.memory_mib, held),
                    memory_total_mib=mig.memory_mib,
                )
            if gpu.mig_enabled:  # the parent's memory is its instances' memory; no utilization counter
                used = sum(out[m.uuid].memory_used_mib or 0 for m in gpu.mig_devices)
                out[gpu.uuid] = DeviceSample(uuid=gpu.uuid, memory_used_mib=used, memory_total_mib=gpu.memory_mib)
                continue
            percent = float(40 + (_seed(gpu.uuid) + 13 * self._samples) % 56) if held else 0.0
            out[gpu.uuid] = DeviceSample(
                uuid=gpu.uuid,
                gpu_percent=percent,
                memory_used_mib=_used(gpu.uuid, gpu.memory_mib, held),
                memory_total_mib=gpu.memory_mib,
            )
        return out

    def update_health_config(self, config: HealthConfig) -> None:
        """Live: a running watch wakes up and checks at the new ``check_interval_s`` from now on."""
        self._health = config
        changed, self._health_changed = self._health_changed, asyncio.Event()
        changed.set()

    def readiness(self) -> tuple[bool, str]:
        return True, f"simulated node ({self.preset_key})"

    def status(self) -> dict[str, object]:
        return {
            "backend": self.name,
            "preset": self.preset_key,
            "description": self.description,
            "faulted": sorted(self._faulted),
            "mig": self.mig.status(),
        }

    async def watch_health(self, inventory: Inventory, emit: SignalSink) -> None:
        """Emit CHECK_OK per unfaulted GPU every check interval until cancelled."""
        self._inventory, self._emit, self._loop_thread = inventory, emit, threading.get_ident()
        try:
            while True:
                for gpu in inventory.gpus:
                    if gpu.uuid not in self._faulted:
                        emit(Signal(uuid=gpu.uuid, kind=SignalKind.CHECK_OK))
                changed = self._health_changed
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._health.check_interval_s):
                        await changed.wait()
        finally:
            if self._emit is emit:
                self._emit = self._loop_thread = None

    def inject(self, device: str, *, healthy: bool, xid: int | None = None) -> Signal:
        """Flip a device's health; the monitor has applied it when this returns.

        ``device`` is a GPU UUID, a GPU index or a MIG UUID (a MIG fault counts against its
        GPU). Call on the event loop thread while :meth:`watch_health` runs. ``xid`` only
        matters with ``healthy=False``.
        """
        emit = self._emit
        if emit is None:
            raise AgentError("cannot inject health: the health monitor is not running (watch_health not started)")
        if threading.get_ident() != self._loop_thread:
            raise AgentError("cannot inject health: call inject() on the event loop thread")
        gpu = self._inventory.find(device)
        mig = None if gpu is not None else self._inventory.find_mig(device)
        if mig is not None:
            gpu = self._inventory.find(mig.parent_uuid)
        if gpu is None:
            raise DeviceNotFoundError(
                f"no simulated device {device!r} (give a GPU UUID, a GPU index 0-{len(self._inventory) - 1} "
                "or a MIG UUID)"
            )
        target = mig.uuid if mig is not None else gpu.uuid
        if healthy:
            self._faulted.discard(gpu.uuid)
            signal = Signal(uuid=target, kind=SignalKind.INJECTED_HEAL, detail="injected")
        elif xid is not None:
            signal = Signal(uuid=target, kind=SignalKind.XID, xid=xid, detail="injected")
        else:
            self._faulted.add(gpu.uuid)
            signal = Signal(uuid=target, kind=SignalKind.INJECTED_FAULT, detail="injected")
        log.info("simulated health injected", device=target, gpu=gpu.uuid, kind=signal.kind.value, xid=signal.xid)
        emit(signal)
        return signal

    def inject_mig_failure(self, op: str, kind: str, *, device: str | None = None, count: int = 1) -> dict[str, object]:
        """Make the next ``count`` MIG ``op`` calls (``create``/``destroy``) on ``device`` (a GPU UUID
        or index; None: any GPU) fail with ``kind`` (a :class:`PartitionErrorKind` value).

        Raises ValueError for a bad ``op``, ``kind`` or ``count`` and DeviceNotFoundError for an
        unknown GPU.
        """
        try:
            error = PartitionErrorKind(kind)
        except ValueError:
            raise ValueError(f"kind must be one of {', '.join(k.value for k in PartitionErrorKind)}") from None
        gpu = self.mig.inject_failure(op, error, gpu=device, count=count)
        return {"op": op, "kind": error.value, "device": gpu, "count": count}


def _seed(uuid: str) -> int:
    """A number fixed by the device's UUID (the same on every run, unlike ``hash``)."""
    return int.from_bytes(hashlib.sha256(uuid.encode()).digest()[:4], "big")


def _used(uuid: str, total_mib: int, held: bool) -> int:
    return total_mib * (25 + _seed(uuid) % 60) // 100 if held else min(total_mib, 4)
