"""Test doubles for dynamic MIG and shared GPUs; holds no tests.

* :data:`H100_PROFILES` — the GPU-instance profiles of an H100 80GB HBM3 as NVML lists them
  (NVIDIA MIG user guide, "Supported MIG Profiles", and ``nvidia-smi mig -lgip/-lgipp`` on that
  GPU): IDs, compute and memory slices, instance counts and placements.
* :func:`mig_capable` — an inventory whose GPUs can do MIG (profiles, slices), in MIG mode or not.
* :class:`FakeMig` — :class:`~agent.core.partitioning.MigControl` over a small model of the
  hardware: instances per GPU, overlapping placements refused with INSUFFICIENT_RESOURCES as
  NVML does, MIG mode switched on by the first instance on a Hopper GPU (and off after the last)
  and required on an Ampere one, faults on demand; :meth:`FakeMig.inventory` is the inventory
  the backend's next load would show (the instances and MIG mode included).
* :class:`FakeMps` — :class:`~agent.core.partitioning.MpsControl` that records what it is told,
  like a control daemon's command log.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable
from pathlib import Path

from agent.core.inventory.model import Gpu, Inventory, MigDevice, MigPlacement, MigProfile
from agent.core.partitioning import MpsDaemon, PartitionError, PartitionErrorKind, switches_mig_mode_live


def _profile(name: str, pid: int, c: int, m: int, n: int, starts: Iterable[int], mib: int, sm: int) -> MigProfile:
    placements = tuple(MigPlacement(s, m) for s in starts)
    return MigProfile(name, pid, c, m, mib, sm, n, placements)


H100_PROFILES = (
    _profile("1g.10gb", 19, 1, 1, 7, range(7), 9984, 16),
    _profile("1g.10gb+me", 20, 1, 1, 1, range(7), 9984, 16),
    _profile("1g.20gb", 15, 1, 2, 4, (0, 2, 4, 6), 20096, 26),
    _profile("2g.20gb", 14, 2, 2, 3, (0, 2, 4), 20096, 32),
    _profile("3g.40gb", 9, 3, 4, 2, (0, 4), 40448, 60),
    _profile("4g.40gb", 5, 4, 4, 1, (0,), 40448, 64),
    _profile("7g.80gb", 0, 7, 8, 1, (0,), 81152, 132),
)
BY_ID = {p.profile_id: p for p in H100_PROFILES}


def mig_capable(
    inventory: Inventory, *, enabled: bool = True, indexes: Iterable[int] | None = None, architecture: str = ""
) -> Inventory:
    """``inventory`` with its GPUs (or those at ``indexes``) MIG-capable H100s, in MIG mode or not
    (``architecture``, e.g. "ampere", to make them need a reset for it)."""
    chosen = set(indexes) if indexes is not None else None

    def convert(gpu: Gpu) -> Gpu:
        if chosen is not None and gpu.index not in chosen:
            return gpu
        return dataclasses.replace(
            gpu,
            mig_enabled=enabled,
            mig_devices=(),
            mig_memory_slices=8,
            mig_profiles=H100_PROFILES,
            architecture=architecture or gpu.architecture,
        )

    return dataclasses.replace(inventory, gpus=tuple(convert(g) for g in inventory.gpus))


class FakeMig:
    """A MIG control over a model of the GPUs' instances. ``fail`` makes the next calls fail."""

    def __init__(self, inventory: Inventory) -> None:
        self.base = inventory
        #: GPU UUID -> its instances (ours or not: the hardware does not know who made them)
        self.instances_by_gpu: dict[str, list[MigDevice]] = {g.uuid: [] for g in inventory.gpus}
        self.calls: list[tuple[str, ...]] = []
        #: the next create / destroy calls fail with these kinds (one per call, in order)
        self.fail_create: list[PartitionErrorKind] = []
        self.fail_destroy: list[PartitionErrorKind] = []
        self._ids = itertools.count(1)
        self._serials = itertools.count(1)  # UUIDs are never reused, GPU instance IDs are
        #: GPUs a create switched into MIG mode (the last destroy switches them back)
        self.switched: set[str] = set()

    def gpu(self, uuid: str) -> Gpu:
        gpu = next((g for g in self.base.gpus if g.uuid == uuid), None)
        if gpu is None:
            raise PartitionError(f"GPU {uuid} not found", kind=PartitionErrorKind.NOT_FOUND)
        return gpu

    def add_foreign(self, gpu_uuid: str, profile_id: int, start: int) -> MigDevice:
        """An instance someone else made (an operator, another tool)."""
        return self._make(gpu_uuid, profile_id, MigPlacement(start, BY_ID[profile_id].memory_slices))

    def inventory(self) -> Inventory:
        """What the backend's next load shows: every GPU with the instances that exist now."""
        return dataclasses.replace(
            self.base,
            gpus=tuple(
                dataclasses.replace(
                    g,
                    mig_devices=tuple(self.instances_by_gpu.get(g.uuid, ())),
                    mig_enabled=g.mig_enabled or g.uuid in self.switched,
                )
                for g in self.base.gpus
            ),
        )

    def _make(self, gpu_uuid: str, profile_id: int, placement: MigPlacement) -> MigDevice:
        gpu = self.gpu(gpu_uuid)
        profile = next((p for p in gpu.mig_profiles if p.profile_id == profile_id), None)
        if profile is None or placement not in profile.placements:
            raise PartitionError(
                f"profile {profile_id} at {placement} is not offered", kind=PartitionErrorKind.NOT_SUPPORTED
            )
        existing = self.instances_by_gpu[gpu_uuid]
        if any(m.placement is not None and m.placement.overlaps(placement) for m in existing):
            raise PartitionError("NVML_ERROR_INSUFFICIENT_RESOURCES", kind=PartitionErrorKind.INSUFFICIENT_RESOURCES)
        gi = next(self._ids)
        device = MigDevice(
            uuid=f"MIG-{gpu.index}-{gi:04d}-{profile_id}-{next(self._serials)}",
            parent_uuid=gpu_uuid,
            index=len(existing),
            gpu_instance_id=gi,
            compute_instance_id=0,
            profile=profile.name,
            memory_mib=profile.memory_mib,
            gi_cap_minor=3 + 135 * gpu.minor + 9 * (gi % 15),
            ci_cap_minor=4 + 135 * gpu.minor + 9 * (gi % 15),
            profile_id=profile_id,
            placement=placement,
        )
        existing.append(device)
        return device

    async def create(self, parent_uuid: str, profile_id: int, placement: MigPlacement) -> MigDevice:
        self.calls.append(("create", parent_uuid, str(profile_id), str(placement.start)))
        if self.fail_create:
            kind = self.fail_create.pop(0)
            raise PartitionError(f"injected: {kind.value}", kind=kind)
        gpu = self.gpu(parent_uuid)
        if not gpu.mig_enabled and parent_uuid not in self.switched:
            if not switches_mig_mode_live(gpu.architecture):
                raise PartitionError("MIG mode is off and needs a reset", kind=PartitionErrorKind.MIG_DISABLED)
            self.switched.add(parent_uuid)
        return self._make(parent_uuid, profile_id, placement)

    async def destroy(self, parent_uuid: str, gpu_instance_id: int, compute_instance_id: int) -> None:
        self.calls.append(("destroy", parent_uuid, str(gpu_instance_id)))
        if self.fail_destroy:
            kind = self.fail_destroy.pop(0)
            raise PartitionError(f"injected: {kind.value}", kind=kind)
        existing = self.instances_by_gpu.get(parent_uuid, [])
        for device in existing:
            if device.gpu_instance_id == gpu_instance_id and device.compute_instance_id == compute_instance_id:
                existing.remove(device)
                if not existing:
                    self.switched.discard(parent_uuid)
                return
        raise PartitionError("no such instance", kind=PartitionErrorKind.NOT_FOUND)

    async def instances(self, parent_uuid: str) -> tuple[MigDevice, ...]:
        self.calls.append(("instances", parent_uuid))
        return tuple(self.instances_by_gpu.get(parent_uuid, ()))

    def count(self) -> int:
        return sum(len(v) for v in self.instances_by_gpu.values())


class FakeMps:
    """An MPS control that records the commands a control daemon would get."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.running: set[str] = set()
        self.commands: list[str] = []
        self.fail: PartitionErrorKind | None = None

    async def ensure(self, gpu_uuid: str) -> MpsDaemon:
        if self.fail is not None:
            raise PartitionError("injected", kind=self.fail)
        if gpu_uuid not in self.running:
            self.commands.append(f"start {gpu_uuid}")
            self.running.add(gpu_uuid)
        return MpsDaemon(gpu_uuid, self.root / gpu_uuid / "pipe", self.root / gpu_uuid / "log")

    async def set_limits(self, gpu_uuid: str, *, active_thread_percentage: int, pinned_memory_mib: int) -> None:
        self.commands.append(f"set_default_active_thread_percentage {active_thread_percentage}")
        self.commands.append(f"set_default_device_pinned_mem_limit {gpu_uuid} {pinned_memory_mib}M")

    async def release(self, gpu_uuid: str) -> None:
        if gpu_uuid in self.running:
            self.commands.append(f"quit {gpu_uuid}")
            self.running.discard(gpu_uuid)

    def status(self) -> dict[str, object]:
        return {"enabled": True, "running": sorted(self.running)}
