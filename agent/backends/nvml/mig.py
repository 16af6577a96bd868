"""MIG instances made and destroyed through NVML: the NVML backend's :class:`~agent.core.partitioning.MigControl`.

A create is, in one worker thread (``nvml.h``, the Multi Instance GPU Management group):

1. ``nvmlDeviceGetMigMode``; with MIG off, on a GPU that switches without a reset (Hopper and
   later), ``nvmlDeviceSetMigMode(ENABLE)`` (its activation status: IN_USE while processes hold
   the GPU), else ``MIG_DISABLED``;
2. ``nvmlDeviceCreateGpuInstanceWithPlacement`` (the placement passed by pointer);
3. ``nvmlGpuInstanceGetComputeInstanceProfileInfo`` for the compute-instance profile spanning
   the whole GPU instance, and ``nvmlGpuInstanceCreateComputeInstance``;
4. the new MIG device found by its GPU and compute instance IDs among the MIG device handles
   (``nvmlDeviceGetMigDeviceHandleByIndex``), for its UUID and index; capability minors from
   ``/proc/driver/nvidia-caps/mig-minors``.

Whatever fails after step 2 destroys what was made (compute instance, GPU instance, and MIG
mode if step 1 switched it on), so nothing is left half-made; a caller cancelled while the
thread runs gets the same: the finished instance is destroyed. A destroy finds the GPU instance
and its compute instance by ID, destroys the compute instance, then the GPU instance (a GPU
instance whose compute instance is already gone is destroyed too), and switches MIG mode back
off after the last instance on a GPU this control switched on.

NVML's codes become :class:`~agent.core.partitioning.PartitionErrorKind` as in :data:`KINDS`.
"""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import structlog

from agent.backends.migprofiles import toggles_without_reset
from agent.backends.nvml import migread
from agent.backends.nvml.errors import (
    ERROR_FUNCTION_NOT_FOUND,
    ERROR_GPU_IS_LOST,
    ERROR_IN_USE,
    ERROR_INSUFFICIENT_RESOURCES,
    ERROR_INVALID_ARGUMENT,
    ERROR_NO_PERMISSION,
    ERROR_NOT_FOUND,
    ERROR_NOT_SUPPORTED,
    ERROR_RESET_REQUIRED,
    describe,
    nvml_code,
)
from agent.backends.nvml.health import InFlight
from agent.backends.nvml.inventory import InventoryReader, Reading, read_mig_minors
from agent.base.errors import BackendError, GpuLostError
from agent.core.inventory.model import Gpu, MigDevice, MigPlacement, MigProfile
from agent.core.partitioning import PartitionError, PartitionErrorKind

log = structlog.get_logger("agent.nvml")

_ENABLE, _DISABLE, _SUCCESS = 1, 0, 0
Kind = PartitionErrorKind

#: NVML code -> kind, and what to add to NVML's words
KINDS: dict[int, tuple[PartitionErrorKind, str]] = {
    ERROR_IN_USE: (Kind.IN_USE, ""),
    ERROR_INSUFFICIENT_RESOURCES: (Kind.INSUFFICIENT_RESOURCES, ""),
    ERROR_NOT_SUPPORTED: (Kind.NOT_SUPPORTED, ""),
    ERROR_FUNCTION_NOT_FOUND: (Kind.NOT_SUPPORTED, " (the driver lacks this call)"),
    ERROR_INVALID_ARGUMENT: (Kind.NOT_SUPPORTED, " (a profile or placement this GPU does not offer)"),
    ERROR_NO_PERMISSION: (Kind.NOT_SUPPORTED, " (the agent needs CAP_SYS_ADMIN or the mig/config capability)"),
    ERROR_GPU_IS_LOST: (Kind.GPU_LOST, ""),
    ERROR_NOT_FOUND: (Kind.NOT_FOUND, ""),
    ERROR_RESET_REQUIRED: (Kind.MIG_DISABLED, " (the GPU needs a reset)"),
}


def partition_error(nvml: ModuleType, exc: BaseException, doing: str) -> PartitionError:
    """The one-line PartitionError for an NVML failure while ``doing``."""
    code = nvml_code(nvml, exc)
    kind, hint = KINDS.get(code, (Kind.FAILED, "")) if code is not None else (Kind.FAILED, "")
    return PartitionError(f"{doing}: {describe(nvml, exc)}{hint}", kind=kind)


class NvmlMig:
    """Makes and destroys MIG instances on the GPUs of the backend's last inventory read.

    ``module``, ``reading`` and ``reader`` are the backend's: its binding (BackendError when it
    is not open), its last :class:`Reading` (GPUs and their handles) and a fresh
    :class:`InventoryReader` (to read a MIG device as the inventory does). Calls on one GPU are
    serialised; each runs in a worker thread counted by ``in_flight``.
    """

    def __init__(
        self,
        *,
        module: Callable[[], ModuleType],
        reading: Callable[[], Reading | None],
        reader: Callable[[], InventoryReader],
        procfs_root: Path,
        in_flight: InFlight,
    ) -> None:
        self._module = module
        self._reading = reading
        self._reader = reader
        self._procfs = procfs_root
        self._in_flight = in_flight
        self._locks: dict[str, asyncio.Lock] = {}
        self._switched_on: set[str] = set()  # GPUs whose MIG mode a create switched on
        self._cleanups: set[asyncio.Task[None]] = set()

    # --- MigControl ---------------------------------------------------------------------

    async def create(self, parent_uuid: str, profile_id: int, placement: MigPlacement) -> MigDevice:
        async with self._lock(parent_uuid):
            nvml, gpu, handle = self._target(parent_uuid)
            work = asyncio.ensure_future(
                asyncio.to_thread(self._in_flight.call, self._create, nvml, gpu, handle, profile_id, placement)
            )
            try:
                device, switched_on = await asyncio.shield(work)
            except asyncio.CancelledError:
                work.add_done_callback(self._undo)
                raise
            if switched_on:
                self._switched_on.add(parent_uuid)
            return device

    async def destroy(self, parent_uuid: str, gpu_instance_id: int, compute_instance_id: int) -> None:
        async with self._lock(parent_uuid):
            nvml, gpu, handle = self._target(parent_uuid)
            switched = parent_uuid in self._switched_on
            destroy = partial(self._destroy, nvml, gpu, handle, gpu_instance_id, compute_instance_id, switched)
            off = await asyncio.shield(asyncio.to_thread(self._in_flight.call, destroy))
            if off:
                self._switched_on.discard(parent_uuid)

    async def instances(self, parent_uuid: str) -> tuple[MigDevice, ...]:
        nvml, gpu, handle = self._target(parent_uuid)
        return await asyncio.to_thread(self._in_flight.call, self._instances, nvml, gpu, handle)

    def status(self) -> dict[str, object]:
        return {"switched_on": sorted(self._switched_on), "cleanups": len(self._cleanups)}

    async def close(self) -> None:
        """Wait for instances a cancelled create left to be destroyed; idempotent."""
        if self._cleanups:
            await asyncio.wait(set(self._cleanups), timeout=5.0)

    # --- helpers on the loop ------------------------------------------------------------

    def _lock(self, uuid: str) -> asyncio.Lock:
        return self._locks.setdefault(uuid, asyncio.Lock())

    def _target(self, parent_uuid: str) -> tuple[ModuleType, Gpu, Any]:
        try:
            nvml = self._module()
        except BackendError as exc:
            raise PartitionError(f"MIG on {parent_uuid[:64]}: {exc}", kind=Kind.FAILED) from exc
        reading = self._reading()
        handle = reading.handles.get(parent_uuid) if reading is not None else None
        gpu = reading.inventory.find(parent_uuid) if reading is not None else None
        if handle is None or gpu is None or gpu.uuid != parent_uuid:
            raise PartitionError(f"no GPU {parent_uuid[:64]!r} in this node's inventory", kind=Kind.NOT_FOUND)
        return nvml, gpu, handle

    def _undo(self, work: asyncio.Future[tuple[MigDevice, bool]]) -> None:
        """A create whose caller went away finished anyway: destroy what it made."""
        if work.cancelled() or work.exception() is not None:
            return
        device, switched_on = work.result()
        if switched_on:
            self._switched_on.add(device.parent_uuid)
        log.warning("MIG device made for a cancelled request; destroying it", mig=device.uuid)
        task = asyncio.ensure_future(self._destroy_quietly(device))
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def _destroy_quietly(self, device: MigDevice) -> None:
        try:
            await self.destroy(device.parent_uuid, device.gpu_instance_id, device.compute_instance_id)
        except PartitionError as exc:
            log.error("MIG device of a cancelled request not destroyed", mig=device.uuid, error=str(exc))

    # --- in a worker thread ---------------------------------------------------------------

    def _create(
        self, nvml: ModuleType, gpu: Gpu, handle: Any, profile_id: int, placement: MigPlacement
    ) -> tuple[MigDevice, bool]:
        profile = self._profile(nvml, gpu, handle, profile_id)
        name = profile.name if profile is not None else f"profile {profile_id}"
        doing = f"GPU {gpu.index} ({gpu.uuid}): creating MIG {name} at {placement.start}:{placement.size}"
        if profile is None:
            raise PartitionError(f"{doing}: the GPU offers no profile ID {profile_id}", kind=Kind.NOT_SUPPORTED)
        switched_on = self._mig_on(nvml, gpu, handle, doing)
        try:
            device = self._make(nvml, gpu, handle, profile, placement, doing)
        except BaseException:
            if switched_on:
                self._mig_off(nvml, gpu, handle)
            raise
        log.info("MIG device created", gpu=gpu.uuid, mig=device.uuid, profile=profile.name, gi=device.gpu_instance_id)
        return device, switched_on

    def _profile(self, nvml: ModuleType, gpu: Gpu, handle: Any, profile_id: int) -> MigProfile | None:
        profiles = gpu.mig_profiles
        if not profiles:  # not read with the inventory: ask now
            try:
                profiles = migread.read_profiles(nvml, handle, gpu.memory_mib)
            except nvml.NVMLError as exc:
                raise partition_error(nvml, exc, f"GPU {gpu.index} ({gpu.uuid}): reading its MIG profiles") from exc
        return next((p for p in profiles if p.profile_id == profile_id), None)

    def _mig_on(self, nvml: ModuleType, gpu: Gpu, handle: Any, doing: str) -> bool:
        """Make sure the GPU is in MIG mode; True when this switched it on."""
        current, pending = self._mode(nvml, handle, doing)
        if current == _ENABLE:
            return False
        if not toggles_without_reset(gpu.architecture):
            why = "a mode change is pending a reset" if pending == _ENABLE else "changing it needs a GPU reset"
            raise PartitionError(f"{doing}: MIG mode is off and {why} ({gpu.architecture})", kind=Kind.MIG_DISABLED)
        switching = f"{doing}: switching MIG mode on"
        status = self._call(nvml, switching, nvml.nvmlDeviceSetMigMode, handle, _ENABLE)
        if int(status) != _SUCCESS:
            self._mig_off(nvml, gpu, handle)  # do not leave a pending change behind
            raise partition_error(nvml, nvml.NVMLError(int(status)), switching)
        if self._mode(nvml, handle, doing)[0] != _ENABLE:
            self._mig_off(nvml, gpu, handle)
            raise PartitionError(f"{switching}: the mode did not change", kind=Kind.MIG_DISABLED)
        log.info("MIG mode switched on", gpu=gpu.uuid)
        return True

    def _mig_off(self, nvml: ModuleType, gpu: Gpu, handle: Any) -> bool:
        """Switch MIG mode back off; False (logged) when the GPU does not take it."""
        try:
            status = int(nvml.nvmlDeviceSetMigMode(handle, _DISABLE))
        except nvml.NVMLError as exc:
            log.warning("MIG mode not switched back off", gpu=gpu.uuid, error=describe(nvml, exc))
            return False
        if status != _SUCCESS:
            log.warning("MIG mode not switched back off", gpu=gpu.uuid, error=describe(nvml, nvml.NVMLError(status)))
            return False
        log.info("MIG mode switched off", gpu=gpu.uuid)
        return True

    def _mode(self, nvml: ModuleType, handle: Any, doing: str) -> tuple[int, int]:
        current, pending = self._call(nvml, f"{doing}: reading MIG mode", nvml.nvmlDeviceGetMigMode, handle)
        return int(current), int(pending)

    def _make(
        self, nvml: ModuleType, gpu: Gpu, handle: Any, profile: MigProfile, placement: MigPlacement, doing: str
    ) -> MigDevice:
        spot = nvml.c_nvmlGpuInstancePlacement_t()
        spot.start, spot.size = placement.start, placement.size
        create = nvml.nvmlDeviceCreateGpuInstanceWithPlacement
        gi = self._call(nvml, doing, create, handle, profile.profile_id, ctypes.byref(spot))
        ci = None
        try:
            full = migread.FULL_COMPUTE_INSTANCE.get(profile.compute_slices)
            if full is None:
                message = f"{doing}: no compute instance profile spans {profile.compute_slices} slices"
                raise PartitionError(message, kind=Kind.FAILED)
            info_of = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo
            info = self._call(
                nvml, f"{doing}: its compute instance profile", info_of, gi, full, migread.ENGINE_PROFILE_SHARED
            )
            ci = self._call(
                nvml, f"{doing}: its compute instance", nvml.nvmlGpuInstanceCreateComputeInstance, gi, int(info.id)
            )
            gi_id = int(self._call(nvml, f"{doing}: reading it", nvml.nvmlGpuInstanceGetInfo, gi).id)
            ci_id = int(self._call(nvml, f"{doing}: reading it", nvml.nvmlComputeInstanceGetInfo, ci).id)
            device = self._device(nvml, gpu, handle, gi_id, ci_id, doing)
        except BaseException:
            self._undo_made(nvml, gpu, gi, ci)
            raise
        return replace(device, profile=profile.name, profile_id=profile.profile_id, placement=placement)

    def _undo_made(self, nvml: ModuleType, gpu: Gpu, gi: Any, ci: Any) -> None:
        """Destroy the compute instance (if any) and the GPU instance of a create that failed."""
        for what, destroy, instance in (
            ("compute instance", nvml.nvmlComputeInstanceDestroy, ci),
            ("GPU instance", nvml.nvmlGpuInstanceDestroy, gi),
        ):
            if instance is None:
                continue
            try:
                destroy(instance)
            except nvml.NVMLError as exc:
                log.error("half-made MIG instance left behind", gpu=gpu.uuid, what=what, error=describe(nvml, exc))
                return

    def _device(self, nvml: ModuleType, gpu: Gpu, handle: Any, gi: int, ci: int, doing: str) -> MigDevice:
        """The MIG device of GPU instance ``gi`` and compute instance ``ci``, as the inventory reads it."""
        minors = read_mig_minors(self._procfs)
        where = f"GPU {gpu.index} ({gpu.uuid})"
        try:
            devices = self._reader().mig_devices(where, gpu.uuid, gpu.minor, handle, minors)
        except GpuLostError as exc:
            raise PartitionError(f"{doing}: {exc}", kind=Kind.GPU_LOST) from exc
        except BackendError as exc:
            raise PartitionError(f"{doing}: {exc}", kind=Kind.FAILED) from exc
        found = next((m for m in devices if (m.gpu_instance_id, m.compute_instance_id) == (gi, ci)), None)
        if found is None:
            raise PartitionError(f"{doing}: no MIG device appeared for GPU instance {gi}", kind=Kind.FAILED)
        return found

    def _destroy(self, nvml: ModuleType, gpu: Gpu, handle: Any, gi_id: int, ci_id: int, switched: bool) -> bool:
        """Destroy CI then GI; True when MIG mode was switched back off."""
        doing = f"GPU {gpu.index} ({gpu.uuid}): destroying MIG GPU instance {gi_id} (compute instance {ci_id})"
        try:
            gi = nvml.nvmlDeviceGetGpuInstanceById(handle, gi_id)
        except nvml.NVMLError as exc:
            if nvml_code(nvml, exc) in (ERROR_NOT_FOUND, ERROR_NOT_SUPPORTED):  # gone, or MIG mode off
                raise PartitionError(f"{doing}: it is already gone", kind=Kind.NOT_FOUND) from exc
            raise partition_error(nvml, exc, doing) from exc
        ci = None
        try:
            ci = nvml.nvmlGpuInstanceGetComputeInstanceById(gi, ci_id)
        except nvml.NVMLError as exc:
            if nvml_code(nvml, exc) != ERROR_NOT_FOUND:  # a GPU instance without it is destroyed below
                raise partition_error(nvml, exc, doing) from exc
        if ci is not None:
            self._call(nvml, doing, nvml.nvmlComputeInstanceDestroy, ci)
        self._call(nvml, f"{doing} (its compute instance is gone)", nvml.nvmlGpuInstanceDestroy, gi)
        log.info("MIG device destroyed", gpu=gpu.uuid, gi=gi_id, ci=ci_id)
        if not switched:
            return False
        try:
            left = migread.gpu_instances(nvml, handle, gpu.mig_profiles)
        except nvml.NVMLError as exc:
            log.warning("GPU instances not listed; MIG mode stays on", gpu=gpu.uuid, error=describe(nvml, exc))
            return False
        return not left and self._mig_off(nvml, gpu, handle)

    def _instances(self, nvml: ModuleType, gpu: Gpu, handle: Any) -> tuple[MigDevice, ...]:
        where = f"GPU {gpu.index} ({gpu.uuid})"
        if self._mode(nvml, handle, f"{where}: listing MIG devices")[0] != _ENABLE:
            return ()
        try:
            reader = self._reader()
            return reader.mig_devices(
                where, gpu.uuid, gpu.minor, handle, read_mig_minors(self._procfs), gpu.mig_profiles
            )
        except GpuLostError as exc:
            raise PartitionError(str(exc), kind=Kind.GPU_LOST) from exc
        except BackendError as exc:
            raise PartitionError(str(exc), kind=Kind.FAILED) from exc

    @staticmethod
    def _call(nvml: ModuleType, doing: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except nvml.NVMLError as exc:
            raise partition_error(nvml, exc, doing) from exc
