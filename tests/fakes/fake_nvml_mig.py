"""The MIG half of the fake ``pynvml``: profiles, placements, GPU and compute instances, MIG mode.

Mixed into :class:`tests.fakes.fake_pynvml.FakeNvml`. It answers the way ``nvml.h`` documents
(the research behind it: the NVML MIG functions' "return" sections), and as rudely:

* ``nvmlDeviceGetGpuInstanceProfileInfo`` (V, the pynvml default) answers NOT_SUPPORTED while MIG
  mode is off ("doesn't have MIG mode enabled"); version 1 answers on any MIG-capable GPU;
  profiles past ``NVML_GPU_INSTANCE_PROFILE_COUNT`` are INVALID_ARGUMENT;
* placements are written into the caller's ctypes array and count (``byref``); a NULL array
  asks for the count; a short array is INSUFFICIENT_SIZE;
* ``nvmlDeviceCreateGpuInstanceWithPlacement`` wants a *pointer* to the placement: a bare struct
  (which ctypes would pass by value) is a TypeError; occupied slices, too many instances of a
  profile or a second "+me" are INSUFFICIENT_RESOURCES; a placement the profile does not take is
  INVALID_ARGUMENT; MIG off is NOT_SUPPORTED;
* destroying a GPU instance that still has compute instances is IN_USE; using a destroyed
  instance's handle is INVALID_ARGUMENT; ``...ById`` of a missing one is NOT_FOUND;
* ``nvmlDeviceSetMigMode`` returns the activation status (pynvml does not raise it); Hopper
  switches at once, Ampere only marks it pending and answers RESET_REQUIRED.

A compute instance makes a MIG device appear at the lowest free MIG slot, as
``nvmlDeviceGetMigDeviceHandleByIndex`` then reports it. Knobs on :class:`FakeGpu` make any step
fail with a code (``mig_errors``).
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any

_INVALID_ARGUMENT, _NOT_SUPPORTED, _NOT_FOUND, _INSUFFICIENT_SIZE = 2, 3, 6, 7
_RESET_REQUIRED, _IN_USE, _INSUFFICIENT_RESOURCES = 16, 19, 23

NVML_GPU_INSTANCE_PROFILE_1_SLICE = 0x0
NVML_GPU_INSTANCE_PROFILE_2_SLICE = 0x1
NVML_GPU_INSTANCE_PROFILE_3_SLICE = 0x2
NVML_GPU_INSTANCE_PROFILE_4_SLICE = 0x3
NVML_GPU_INSTANCE_PROFILE_7_SLICE = 0x4
NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1 = 0x7
NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2 = 0x9
NVML_GPU_INSTANCE_PROFILE_COUNT = 0x12
NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE = 0x0
NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE = 0x1
NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE = 0x2
NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE = 0x3
NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE = 0x4
NVML_COMPUTE_INSTANCE_PROFILE_COUNT = 0x9
NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED = 0x0

_CI_SLICES = {0x0: 1, 0x1: 2, 0x2: 3, 0x3: 4, 0x4: 7, 0x5: 8, 0x6: 6}


class c_nvmlGpuInstancePlacement_t(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint), ("size", ctypes.c_uint)]


class c_nvmlComputeInstancePlacement_t(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint), ("size", ctypes.c_uint)]


#: handle arrays: real pynvml uses opaque pointers; a py_object array holds the fake's objects
c_nvmlGpuInstance_t = ctypes.py_object
c_nvmlComputeInstance_t = ctypes.py_object


@dataclass
class c_nvmlGpuInstanceProfileInfo_v2_t:
    version: int
    id: int
    isP2pSupported: int
    sliceCount: int
    instanceCount: int
    multiprocessorCount: int
    copyEngineCount: int
    decoderCount: int
    encoderCount: int
    jpegCount: int
    ofaCount: int
    memorySizeMB: int
    name: bytes


@dataclass
class c_nvmlGpuInstanceInfo_t:
    device: Any
    id: int
    profileId: int
    placement: c_nvmlGpuInstancePlacement_t


@dataclass
class c_nvmlComputeInstanceProfileInfo_v2_t:
    version: int
    id: int
    sliceCount: int
    instanceCount: int
    multiprocessorCount: int
    sharedCopyEngineCount: int
    sharedDecoderCount: int
    sharedEncoderCount: int
    sharedJpegCount: int
    sharedOfaCount: int
    name: bytes


@dataclass
class c_nvmlComputeInstanceInfo_t:
    device: Any
    gpuInstance: Any
    id: int
    profileId: int
    placement: c_nvmlComputeInstancePlacement_t


@dataclass(frozen=True)
class FakeGiProfile:
    """One GPU-instance profile as the driver describes it (``nvmlGpuInstanceProfileInfo_v2_t``)."""

    enum: int
    id: int
    name: str  # what the v2 struct's name says, e.g. "MIG 1g.10gb"
    slices: int
    count: int
    memory_mib: int
    sms: int
    starts: tuple[int, ...]
    size: int
    engines: tuple[int, int, int, int, int] = (1, 1, 0, 1, 0)  # copy, decoders, encoders, jpeg, ofa


#: NVIDIA H100 80GB HBM3 as ``nvidia-smi mig -lgip/-lgipp`` lists it
H100_PROFILES = (
    FakeGiProfile(0x0, 19, "MIG 1g.10gb", 1, 7, 9984, 16, (0, 1, 2, 3, 4, 5, 6), 1),
    FakeGiProfile(0x7, 20, "MIG 1g.10gb+me", 1, 1, 9984, 16, (0, 1, 2, 3, 4, 5, 6), 1, (1, 1, 0, 1, 1)),
    FakeGiProfile(0x9, 15, "MIG 1g.20gb", 1, 4, 20096, 26, (0, 2, 4, 6), 2),
    FakeGiProfile(0x1, 14, "MIG 2g.20gb", 2, 3, 20096, 32, (0, 2, 4), 2, (2, 2, 0, 2, 0)),
    FakeGiProfile(0x2, 9, "MIG 3g.40gb", 3, 2, 40448, 60, (0, 4), 4, (3, 3, 0, 3, 0)),
    FakeGiProfile(0x3, 5, "MIG 4g.40gb", 4, 1, 40448, 64, (0,), 4, (4, 4, 0, 4, 0)),
    FakeGiProfile(0x4, 0, "MIG 7g.80gb", 7, 1, 81152, 132, (0,), 8, (8, 7, 0, 7, 1)),
)


@dataclass(eq=False)
class FakeComputeInstance:
    gi: FakeGpuInstance
    id: int
    profile_id: int
    slices: int
    slot: int  # the MIG device slot it shows up at
    destroyed: bool = False


@dataclass(eq=False)
class FakeGpuInstance:
    gpu: Any  # FakeGpu
    id: int
    profile: FakeGiProfile
    start: int
    cis: dict[int, FakeComputeInstance] = field(default_factory=dict)
    destroyed: bool = False


@dataclass
class FakeMigState:
    """MIG state of one fake GPU: its profiles, its instances, and knobs for failures."""

    profiles: tuple[FakeGiProfile, ...] = ()
    instances: dict[int, FakeGpuInstance] = field(default_factory=dict)
    pending: bool | None = None  # pending MIG mode, when it differs from the current one
    #: function name -> NVML code it raises (once per entry in the list)
    errors: dict[str, list[int]] = field(default_factory=dict)
    #: what nvmlDeviceSetMigMode answers as activation status (None: the model's answer)
    toggle_status: int | None = None
    toggles: list[int] = field(default_factory=list)  # modes nvmlDeviceSetMigMode was asked for
    #: while set, nvmlDeviceCreateGpuInstanceWithPlacement blocks until the event is set
    hang: threading.Event | None = None
    entered: threading.Event = field(default_factory=threading.Event)  # set once a create is in
    uuids: itertools.count[int] = field(default_factory=itertools.count)


class MigCalls:
    """The MIG functions of the fake module (mixed into FakeNvml)."""

    gpus: list[Any]

    # provided by FakeNvml
    def _enter(self, name: str, *, needs_init: bool = True) -> None: ...
    def _gpu_of(self, handle: Any) -> Any: ...
    def _raise(self, code: int) -> None: ...

    def _mig(self, handle: Any, name: str) -> Any:
        """The GPU behind ``handle``; raises a knob's code queued for ``name``."""
        self._enter(name)
        gpu = self._gpu_of(handle)
        queued = gpu.mig.errors.get(name)
        if queued:
            self._raise(queued.pop(0))
        return gpu

    @staticmethod
    def _pointee(ref: Any, kind: type) -> Any:
        if isinstance(ref, kind):
            raise TypeError(f"{kind.__name__} passed by value: the C function takes a pointer (use ctypes.byref)")
        obj = getattr(ref, "_obj", None)
        if not isinstance(obj, kind):
            raise TypeError(f"expected ctypes.byref({kind.__name__}), got {type(ref).__name__}")
        return obj

    def _fill(self, array: Any, count: Any, found: list[Any]) -> int:
        """Write ``found`` into the caller's handle array and count, as the listing calls do."""
        if len(array) < len(found):
            self._raise(_INSUFFICIENT_SIZE)
        for i, item in enumerate(found):
            array[i] = item
        self._pointee(count, ctypes.c_uint).value = len(found)
        return 0

    def _profile(self, gpu: Any, profile_id: int) -> FakeGiProfile:
        found = next((p for p in gpu.mig.profiles if p.id == profile_id), None)
        if found is None:
            self._raise(_NOT_SUPPORTED)  # "profileId unsupported"
        return found

    def _live_gi(self, gi: Any) -> FakeGpuInstance:
        if not isinstance(gi, FakeGpuInstance) or gi.destroyed:
            self._raise(_INVALID_ARGUMENT)  # a destroyed instance's handle is invalid
        self._gpu_of(_handle(gi.gpu))
        return gi

    # --- mode -----------------------------------------------------------------------------

    def nvmlDeviceSetMigMode(self, handle: Any, mode: int) -> int:
        gpu = self._mig(handle, "nvmlDeviceSetMigMode")
        if gpu.mig_enabled is None or not gpu.mig.profiles:
            self._raise(_NOT_SUPPORTED)
        gpu.mig.toggles.append(mode)
        if gpu.mig.toggle_status is not None:
            return int(gpu.mig.toggle_status)
        if not mode and gpu.mig.instances:
            return _IN_USE
        if gpu.arch < 9:  # Ampere: takes effect at the next reset
            gpu.mig.pending = bool(mode)
            return _RESET_REQUIRED
        gpu.mig_enabled, gpu.mig.pending = bool(mode), None
        return 0

    # --- profiles and placements ----------------------------------------------------------

    def nvmlDeviceGetGpuInstanceProfileInfo(self, handle: Any, profile: int, version: int = 2) -> Any:
        gpu = self._mig(handle, "nvmlDeviceGetGpuInstanceProfileInfo")
        if profile >= NVML_GPU_INSTANCE_PROFILE_COUNT or version not in (1, 2):
            self._raise(_INVALID_ARGUMENT)
        found = next((p for p in gpu.mig.profiles if p.enum == profile), None)
        if found is None or gpu.mig_enabled is None or (version == 2 and not gpu.mig_enabled):
            self._raise(_NOT_SUPPORTED)
        copy, dec, enc, jpeg, ofa = found.engines
        return c_nvmlGpuInstanceProfileInfo_v2_t(
            version=0x02000098 if version == 2 else 0,
            id=found.id,
            isP2pSupported=0,
            sliceCount=found.slices,
            instanceCount=found.count,
            multiprocessorCount=found.sms,
            copyEngineCount=copy,
            decoderCount=dec,
            encoderCount=enc,
            jpegCount=jpeg,
            ofaCount=ofa,
            memorySizeMB=found.memory_mib,
            name=found.name.encode() if version == 2 else b"",
        )

    nvmlDeviceGetGpuInstanceProfileInfoV = nvmlDeviceGetGpuInstanceProfileInfo

    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, handle: Any, profile_id: int, placements: Any, count: Any
    ) -> int:
        gpu = self._mig(handle, "nvmlDeviceGetGpuInstancePossiblePlacements")
        profile = self._profile(gpu, profile_id)
        counter = self._pointee(count, ctypes.c_uint)
        counter.value = len(profile.starts)
        if placements is not None:
            if len(placements) < len(profile.starts):
                self._raise(_INSUFFICIENT_SIZE)
            for i, start in enumerate(profile.starts):
                placements[i].start, placements[i].size = start, profile.size
        return 0

    # --- GPU instances -------------------------------------------------------------------

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, handle: Any, profile_id: int, placement: Any) -> FakeGpuInstance:
        gpu = self._mig(handle, "nvmlDeviceCreateGpuInstanceWithPlacement")
        where = self._pointee(placement, c_nvmlGpuInstancePlacement_t)
        gpu.mig.entered.set()
        if gpu.mig.hang is not None:
            gpu.mig.hang.wait()
        if not gpu.mig_enabled:
            self._raise(_NOT_SUPPORTED)
        profile = self._profile(gpu, profile_id)
        if where.size != profile.size or where.start not in profile.starts:
            self._raise(_INVALID_ARGUMENT)
        new = set(range(where.start, where.start + where.size))
        present = list(gpu.mig.instances.values())
        if any(new & set(range(g.start, g.start + g.profile.size)) for g in present):
            self._raise(_INSUFFICIENT_RESOURCES)
        if sum(g.profile.id == profile_id for g in present) >= profile.count:
            self._raise(_INSUFFICIENT_RESOURCES)
        if profile.name.endswith("+me") and any(g.profile.name.endswith("+me") for g in present):
            self._raise(_INSUFFICIENT_RESOURCES)
        slots = max(max(p.starts) + p.size for p in gpu.mig.profiles)
        gi_id = slots // where.size - 1 + where.start // where.size
        instance = FakeGpuInstance(gpu=gpu, id=gi_id, profile=profile, start=where.start)
        gpu.mig.instances[gi_id] = instance
        return instance

    def nvmlGpuInstanceGetInfo(self, gi: Any) -> c_nvmlGpuInstanceInfo_t:
        self._enter("nvmlGpuInstanceGetInfo")
        live = self._live_gi(gi)
        placement = c_nvmlGpuInstancePlacement_t(live.start, live.profile.size)
        device = _handle(live.gpu)
        return c_nvmlGpuInstanceInfo_t(device=device, id=live.id, profileId=live.profile.id, placement=placement)

    def nvmlGpuInstanceDestroy(self, gi: Any) -> int:
        self._enter("nvmlGpuInstanceDestroy")
        live = self._live_gi(gi)
        queued = live.gpu.mig.errors.get("nvmlGpuInstanceDestroy")
        if queued:
            self._raise(queued.pop(0))
        if live.cis:
            self._raise(_IN_USE)  # "compute instances are active on the GPU instance"
        live.destroyed = True
        del live.gpu.mig.instances[live.id]
        return 0

    def nvmlDeviceGetGpuInstances(self, handle: Any, profile_id: int, instances: Any, count: Any) -> int:
        gpu = self._mig(handle, "nvmlDeviceGetGpuInstances")
        if not gpu.mig_enabled:
            self._raise(_NOT_SUPPORTED)
        profile = self._profile(gpu, profile_id)
        return self._fill(instances, count, [g for g in gpu.mig.instances.values() if g.profile.id == profile.id])

    def nvmlDeviceGetGpuInstanceById(self, handle: Any, gi_id: int) -> FakeGpuInstance:
        gpu = self._mig(handle, "nvmlDeviceGetGpuInstanceById")
        if not gpu.mig_enabled:
            self._raise(_NOT_SUPPORTED)
        if gi_id not in gpu.mig.instances:
            self._raise(_NOT_FOUND)
        instance: FakeGpuInstance = gpu.mig.instances[gi_id]
        return instance

    # --- compute instances ---------------------------------------------------------------

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(self, gi: Any, profile: int, eng: int, version: int = 2) -> Any:
        self._enter("nvmlGpuInstanceGetComputeInstanceProfileInfo")
        live = self._live_gi(gi)
        if profile >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT or eng != NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
            self._raise(_INVALID_ARGUMENT)
        slices = _CI_SLICES.get(profile)
        if slices is None or slices > live.profile.slices:
            self._raise(_NOT_SUPPORTED)
        return c_nvmlComputeInstanceProfileInfo_v2_t(
            version=0x02000088,
            id=profile,
            sliceCount=slices,
            instanceCount=live.profile.slices // slices,
            multiprocessorCount=live.profile.sms * slices // live.profile.slices,
            sharedCopyEngineCount=1,
            sharedDecoderCount=0,
            sharedEncoderCount=0,
            sharedJpegCount=0,
            sharedOfaCount=0,
            name=f"MIG {slices}c.{live.profile.name.split(' ')[-1]}".encode(),
        )

    nvmlGpuInstanceGetComputeInstanceProfileInfoV = nvmlGpuInstanceGetComputeInstanceProfileInfo

    def nvmlGpuInstanceCreateComputeInstance(self, gi: Any, profile_id: int) -> FakeComputeInstance:
        self._enter("nvmlGpuInstanceCreateComputeInstance")
        live = self._live_gi(gi)
        gpu = live.gpu
        queued = gpu.mig.errors.get("nvmlGpuInstanceCreateComputeInstance")
        if queued:
            self._raise(queued.pop(0))
        slices = _CI_SLICES.get(profile_id)
        if slices is None or slices > live.profile.slices:
            self._raise(_NOT_SUPPORTED)
        if sum(c.slices for c in live.cis.values()) + slices > live.profile.slices:
            self._raise(_INSUFFICIENT_RESOURCES)
        ci_id = next(i for i in range(8) if i not in live.cis)
        slot = next(i for i in range(gpu.max_mig) if i not in gpu.migs)
        ci = FakeComputeInstance(gi=live, id=ci_id, profile_id=profile_id, slices=slices, slot=slot)
        live.cis[ci_id] = ci
        profile_name = live.profile.name.removeprefix("MIG ")
        uuid = f"MIG-{gpu.uuid[4:12]}-{live.id:04x}-{ci_id:04x}-{next(gpu.mig.uuids):04x}-000000000000"
        gpu.migs[slot] = _fake_mig(uuid, live.id, ci_id, f"{gpu.name} MIG {profile_name}", live.profile)
        return ci

    def nvmlComputeInstanceGetInfo(self, ci: Any) -> c_nvmlComputeInstanceInfo_t:
        self._enter("nvmlComputeInstanceGetInfo")
        live = self._live_ci(ci)
        return c_nvmlComputeInstanceInfo_t(
            device=_handle(live.gi.gpu),
            gpuInstance=live.gi,
            id=live.id,
            profileId=live.profile_id,
            placement=c_nvmlComputeInstancePlacement_t(0, live.slices),
        )

    def nvmlComputeInstanceDestroy(self, ci: Any) -> int:
        self._enter("nvmlComputeInstanceDestroy")
        live = self._live_ci(ci)
        gpu = live.gi.gpu
        queued = gpu.mig.errors.get("nvmlComputeInstanceDestroy")
        if queued:
            self._raise(queued.pop(0))
        live.destroyed = True
        del live.gi.cis[live.id]
        gpu.migs.pop(live.slot, None)
        return 0

    def nvmlGpuInstanceGetComputeInstances(self, gi: Any, profile_id: int, instances: Any, count: Any) -> int:
        self._enter("nvmlGpuInstanceGetComputeInstances")
        live = self._live_gi(gi)
        return self._fill(instances, count, [c for c in live.cis.values() if c.profile_id == profile_id])

    def nvmlGpuInstanceGetComputeInstanceById(self, gi: Any, ci_id: int) -> FakeComputeInstance:
        self._enter("nvmlGpuInstanceGetComputeInstanceById")
        live = self._live_gi(gi)
        if ci_id not in live.cis:
            self._raise(_NOT_FOUND)
        found: FakeComputeInstance = live.cis[ci_id]
        return found

    def _live_ci(self, ci: Any) -> FakeComputeInstance:
        if not isinstance(ci, FakeComputeInstance) or ci.destroyed:
            self._raise(_INVALID_ARGUMENT)
        self._live_gi(ci.gi)
        return ci


def _handle(gpu: Any) -> Any:
    from tests.fakes.fake_pynvml import Handle

    return Handle(gpu)


def _fake_mig(uuid: str, gi: int, ci: int, name: str, profile: FakeGiProfile) -> Any:
    from tests.fakes.fake_pynvml import FakeMig

    return FakeMig(uuid, gi, ci, name, profile.memory_mib, profile.slices)
