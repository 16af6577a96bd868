"""MIG instances on simulated GPUs: the :class:`~agent.core.partitioning.MigControl` of the simulated backend.

State lives in memory, one record per GPU, seeded from the preset (its MIG mode and the MIG
devices it lists) and reseeded when a preset file changes that GPU. What it refuses, it refuses
the way NVML does (``nvml.h``, ``nvmlDeviceCreateGpuInstanceWithPlacement`` and friends):

* a profile the GPU does not offer, or a placement the profile does not take: ``NOT_SUPPORTED``
  (NVML: NOT_SUPPORTED and INVALID_ARGUMENT);
* memory slices already taken, more instances of a profile than it allows, a second "+me"
  instance, more compute slices than the GPU has: ``INSUFFICIENT_RESOURCES``;
* destroying what is not there: ``NOT_FOUND``; a GPU that is not on the node: ``NOT_FOUND``.

MIG mode, modelled on the hardware (MIG user guide, "Getting Started with MIG"): a Hopper or
later GPU switches MIG mode without a reset, so a create on such a GPU with MIG off switches it
on first, and destroying the last instance switches it back off (only when a create switched it
on: a GPU the preset puts in MIG mode stays there). This is what NVIDIA's DRA driver does on
Hopper+ (NVIDIA/k8s-dra-driver-gpu ``cmd/gpu-kubelet-plugin/nvlib.go`` at tag v0.4.0). An Ampere
GPU needs a reset, so a create there with MIG off is ``MIG_DISABLED``. Simulated GPUs run no
processes, so switching never fails with ``IN_USE`` unless a test injects it.

New instances get deterministic identities: GPU instance ID from the placement
(:func:`~agent.backends.migprofiles.gpu_instance_id`), compute instance 0, a UUID derived from
node, preset, GPU index and the two IDs (``MIG-`` and a UUID, as NVML writes them), capability
minors as ``mig-minors`` numbers them, and the lowest free MIG device index.

Tests make an operation fail with :meth:`SimulatedMig.inject_failure` (behind
``POST /debug/simulated/mig``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import structlog

from agent.backends.migprofiles import cap_minors, gpu_instance_id, media_extended, toggles_without_reset
from agent.base.errors import DeviceNotFoundError
from agent.core.inventory.model import Gpu, Inventory, MigDevice, MigPlacement, MigProfile
from agent.core.partitioning import PartitionError, PartitionErrorKind

log = structlog.get_logger("agent.inventory.simulated")

#: ``uuid_for(gpu, gpu_instance_id, compute_instance_id)``: the UUID of a new MIG device
MigUuid = Callable[[Gpu, int, int], str]
OPERATIONS = ("create", "destroy")
#: injected failures waiting at once, and how many operations one may fail
MAX_INJECTED = 64
MAX_INJECTED_COUNT = 100
_COMPUTE = re.compile(r"^(\d+)g\.")


@dataclass(slots=True)
class _GpuState:
    seed: Gpu  # the preset's record: a different one means the preset changed this GPU
    enabled: bool
    devices: dict[tuple[int, int], MigDevice]
    switched_on: bool = False  # MIG mode turned on by a create, off again by the last destroy


@dataclass(slots=True)
class _Failure:
    op: str
    kind: PartitionErrorKind
    gpu: str | None  # None: any GPU
    remaining: int


@dataclass(slots=True)
class SimulatedMig:
    """Creates and destroys MIG instances on the simulated GPUs; calls complete on the loop thread."""

    uuid_for: MigUuid
    _gpus: dict[str, _GpuState] = field(default_factory=dict)
    _failures: list[_Failure] = field(default_factory=list)

    # --- the inventory ------------------------------------------------------------------

    def apply(self, base: Inventory) -> Inventory:
        """``base`` (the preset's inventory) with each GPU's live MIG mode and devices.

        Seeds GPUs seen for the first time and reseeds those whose preset record changed (a
        preset file edited: new hardware); forgets GPUs that are gone.
        """
        for gpu in base.gpus:
            state = self._gpus.get(gpu.uuid)
            if state is None or state.seed != gpu:
                devices = {(m.gpu_instance_id, m.compute_instance_id): m for m in gpu.mig_devices}
                self._gpus[gpu.uuid] = _GpuState(seed=gpu, enabled=gpu.mig_enabled, devices=devices)
        for uuid in set(self._gpus) - {g.uuid for g in base.gpus}:
            del self._gpus[uuid]
        gpus = tuple(
            replace(g, mig_enabled=self._gpus[g.uuid].enabled, mig_devices=self._listed(self._gpus[g.uuid]))
            for g in base.gpus
        )
        return replace(base, gpus=gpus)

    @staticmethod
    def _listed(state: _GpuState) -> tuple[MigDevice, ...]:
        return tuple(sorted(state.devices.values(), key=lambda m: m.index))

    def _state(self, parent_uuid: str) -> _GpuState:
        state = self._gpus.get(parent_uuid)
        if state is None:
            raise PartitionError(
                f"no GPU {parent_uuid[:64]!r} on this simulated node", kind=PartitionErrorKind.NOT_FOUND
            )
        return state

    # --- MigControl ---------------------------------------------------------------------

    async def create(self, parent_uuid: str, profile_id: int, placement: MigPlacement) -> MigDevice:
        state = self._state(parent_uuid)
        gpu = state.seed
        where = f"GPU {gpu.index} ({gpu.uuid})"
        profile = next((p for p in gpu.mig_profiles if p.profile_id == profile_id), None)
        doing = f"{where}: creating MIG profile {profile.name if profile else profile_id} at {_at(placement)}"
        self._injected("create", gpu.uuid, doing)
        if not gpu.mig_profiles:
            raise PartitionError(f"{doing}: the GPU cannot do MIG", kind=PartitionErrorKind.NOT_SUPPORTED)
        if not state.enabled and not toggles_without_reset(gpu.architecture):
            raise PartitionError(
                f"{doing}: MIG mode is off and a {gpu.architecture} GPU changes it only with a reset",
                kind=PartitionErrorKind.MIG_DISABLED,
            )
        if profile is None:
            known = ", ".join(f"{p.profile_id} ({p.name})" for p in gpu.mig_profiles)
            raise PartitionError(f"{doing}: no such profile (offered: {known})", kind=PartitionErrorKind.NOT_SUPPORTED)
        if placement not in profile.placements:
            offered = ", ".join(_at(p) for p in profile.placements)
            raise PartitionError(
                f"{doing}: the profile does not take that placement (its placements: {offered})",
                kind=PartitionErrorKind.NOT_SUPPORTED,
            )
        problem = _conflict(gpu, state.devices.values(), profile, placement)
        if problem:
            raise PartitionError(f"{doing}: {problem}", kind=PartitionErrorKind.INSUFFICIENT_RESOURCES)
        gi = gpu_instance_id(placement, gpu.mig_memory_slices)
        if gi is None or any(key[0] == gi for key in state.devices):
            raise PartitionError(f"{doing}: GPU instance {gi} exists", kind=PartitionErrorKind.INSUFFICIENT_RESOURCES)
        if not state.enabled:
            state.enabled = state.switched_on = True
            log.info("simulated MIG mode switched on", gpu=gpu.uuid)
        used = {m.index for m in state.devices.values()}
        gi_minor, ci_minor = cap_minors(gpu.minor, gi, 0)
        device = MigDevice(
            uuid=self.uuid_for(gpu, gi, 0),
            parent_uuid=gpu.uuid,
            index=next(i for i in range(len(used) + 1) if i not in used),
            gpu_instance_id=gi,
            compute_instance_id=0,
            profile=profile.name,
            memory_mib=profile.memory_mib,
            gi_cap_minor=gi_minor,
            ci_cap_minor=ci_minor,
            profile_id=profile.profile_id,
            placement=placement,
        )
        state.devices[(gi, 0)] = device
        log.info("simulated MIG device created", gpu=gpu.uuid, mig=device.uuid, profile=profile.name, gi=gi)
        return device

    async def destroy(self, parent_uuid: str, gpu_instance_id: int, compute_instance_id: int) -> None:
        state = self._state(parent_uuid)
        gpu = state.seed
        doing = f"GPU {gpu.index} ({gpu.uuid}): destroying GPU instance {gpu_instance_id}"
        self._injected("destroy", gpu.uuid, doing)
        device = state.devices.get((gpu_instance_id, compute_instance_id)) if state.enabled else None
        if device is None:
            raise PartitionError(
                f"{doing}: no such MIG device (compute instance {compute_instance_id})",
                kind=PartitionErrorKind.NOT_FOUND,
            )
        del state.devices[(gpu_instance_id, compute_instance_id)]
        log.info("simulated MIG device destroyed", gpu=gpu.uuid, mig=device.uuid, gi=gpu_instance_id)
        if state.switched_on and not state.devices:
            state.enabled = state.switched_on = False
            log.info("simulated MIG mode switched off", gpu=gpu.uuid)

    async def instances(self, parent_uuid: str) -> tuple[MigDevice, ...]:
        state = self._state(parent_uuid)
        return self._listed(state) if state.enabled else ()

    # --- failure injection --------------------------------------------------------------

    def inject_failure(
        self, op: str, kind: PartitionErrorKind, *, gpu: str | None = None, count: int = 1
    ) -> str | None:
        """The next ``count`` ``op`` calls (on ``gpu``, a UUID or index; None: any) fail with ``kind``.

        Answers the GPU's UUID (None for any). Raises DeviceNotFoundError for an unknown GPU and
        ValueError for a bad ``op`` or ``count``.
        """
        if op not in OPERATIONS:
            raise ValueError(f"op must be one of {', '.join(OPERATIONS)}")
        if not 1 <= count <= MAX_INJECTED_COUNT:
            raise ValueError(f"count must be 1-{MAX_INJECTED_COUNT}")
        if len(self._failures) >= MAX_INJECTED:
            raise ValueError(f"{MAX_INJECTED} injected failures are already waiting")
        uuid = None
        if gpu is not None:
            found = next((s.seed for s in self._gpus.values() if gpu in (s.seed.uuid, str(s.seed.index))), None)
            if found is None:
                raise DeviceNotFoundError(f"no simulated GPU {gpu[:64]!r} (give a GPU UUID or index)")
            uuid = found.uuid
        self._failures.append(_Failure(op=op, kind=kind, gpu=uuid, remaining=count))
        log.info("simulated MIG failure injected", op=op, kind=kind.value, gpu=uuid, count=count)
        return uuid

    def _injected(self, op: str, gpu: str, doing: str) -> None:
        for failure in self._failures:
            if failure.op == op and failure.gpu in (None, gpu):
                failure.remaining -= 1
                if failure.remaining <= 0:
                    self._failures.remove(failure)
                raise PartitionError(f"{doing}: injected failure ({failure.kind.value})", kind=failure.kind)

    def status(self) -> dict[str, object]:
        return {
            "switched_on": sorted(uuid for uuid, s in self._gpus.items() if s.switched_on),
            "injected_failures": [
                {"op": f.op, "kind": f.kind.value, "gpu": f.gpu, "remaining": f.remaining} for f in self._failures
            ],
        }


def _at(placement: MigPlacement) -> str:
    """``nvidia-smi``'s notation: ``start:size``."""
    return f"{placement.start}:{placement.size}"


def _compute_slices(gpu: Gpu, device: MigDevice) -> int:
    profile = next((p for p in gpu.mig_profiles if p.name == device.profile), None)
    if profile is not None:
        return profile.compute_slices
    match = _COMPUTE.match(device.profile)
    return int(match.group(1)) if match else 0


def _conflict(gpu: Gpu, devices: Iterable[MigDevice], profile: MigProfile, placement: MigPlacement) -> str:
    """Why ``profile`` at ``placement`` does not fit beside ``devices`` (empty when it fits)."""
    present = list(devices)
    for other in present:
        if other.placement is not None and other.placement.overlaps(placement):
            return f"memory slices taken by MIG device {other.uuid} ({other.profile} at {_at(other.placement)})"
    same = sum(1 for m in present if m.profile == profile.name)
    if same >= profile.max_instances:
        return f"the GPU holds at most {profile.max_instances} {profile.name} instance(s)"
    if media_extended(profile) and any(m.profile.endswith("+me") for m in present):
        return "the GPU holds one media-extension (+me) instance at most"
    capacity = max(p.compute_slices for p in gpu.mig_profiles)
    used = sum(_compute_slices(gpu, m) for m in present)
    if used + profile.compute_slices > capacity:
        return f"{used} of {capacity} compute slices are in use"
    return ""
