"""Reading a GPU's MIG profiles, placements and GPU instances from NVML, synchronously.

Called from worker threads only (the inventory read and the MIG control). The functions raise
the binding's ``NVMLError`` for anything but the answers they are documented to skip; callers
translate.

Profiles are enumerated as ``nvml.h`` describes it for ``nvmlDeviceGetGpuInstanceProfileInfo``:
"by invoking it on ``profile`` values starting from 0, until the API returns
NVML_ERROR_INVALID_ARGUMENT"; NOT_SUPPORTED means this GPU lacks that profile. The ``V`` form
(pynvml's default, which carries the name) answers NOT_SUPPORTED while MIG mode is off, so a
profile it refuses is asked again through version 1, which only needs a MIG-capable GPU.
Placements come from ``nvmlDeviceGetGpuInstancePossiblePlacements_v2``, which "returns all the
possible placements for the given profile regardless of whether MIG is enabled or not".
"""

from __future__ import annotations

import ctypes
import math
import re
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from agent.backends.nvml.errors import ERROR_INVALID_ARGUMENT, NOT_SUPPORTED_CODES, nvml_code
from agent.core.inventory.model import MigPlacement, MigProfile

#: ``NVML_GPU_INSTANCE_PROFILE_COUNT`` of nvml.h 13.x, when the binding has no such constant
PROFILE_COUNT = 0x12
#: profile values tried past the binding's count (a newer driver may know more), at most
MAX_PROFILES = 64
#: placements and instances asked for at once; a GPU has at most 8 memory slices
MAX_PLACEMENTS = 32
#: ``NVML_COMPUTE_INSTANCE_PROFILE_<N>_SLICE`` by compute slices: the compute instance that spans
#: a whole GPU instance (what ``nvidia-smi mig -cgi <id> -C`` creates)
FULL_COMPUTE_INSTANCE = {1: 0x0, 2: 0x1, 3: 0x2, 4: 0x3, 7: 0x4, 8: 0x5, 6: 0x6}
ENGINE_PROFILE_SHARED = 0x0
_NAME = re.compile(r"^(?:MIG\s+)?(\S+)$")
# suffixes by GPU-instance profile value, as go-nvlib names them (NVIDIA/go-nvlib
# pkg/nvlib/device/mig_profile.go): REV1 is "+me"; nvml.h's ALL_ME, GFX and NO_ME profiles follow
# the MIG user guide's "+me.all", "+gfx" and "-me"
_SUFFIX = {0x7: "+me", 0x8: "+me", 0xA: "+gfx", 0xB: "+gfx", 0xC: "+gfx", 0x11: "+gfx"}
_SUFFIX |= {0xD: "-me", 0xE: "-me", 0xF: "+me.all", 0x10: "+me.all"}


@dataclass(frozen=True, slots=True)
class GpuInstance:
    """One GPU instance as ``nvmlGpuInstanceGetInfo`` describes it, with its handle."""

    id: int
    profile_id: int
    placement: MigPlacement
    handle: Any


def profile_name(nvml_name: str, value: int, slices: int, memory_mib: int, gpu_memory_mib: int) -> str:
    """``1g.10gb``: the name NVML gives (``"MIG 1g.10gb"``), else built the way go-nvlib builds it.

    go-nvlib: the profile's share of the GPU's memory rounded up to eighths, times the GPU's
    memory in whole GiB, rounded.
    """
    match = _NAME.fullmatch(nvml_name.strip())
    if match is not None and re.match(r"^\d+g\.", match.group(1)):
        return match.group(1)
    if gpu_memory_mib <= 0:
        return f"{slices}g.{math.ceil(memory_mib / 1024)}gb{_SUFFIX.get(value, '')}"
    share = math.ceil(memory_mib / gpu_memory_mib * 8) / 8
    gigabytes = round(share * math.ceil(gpu_memory_mib / 1024))
    return f"{slices}g.{gigabytes}gb{_SUFFIX.get(value, '')}"


def _text(value: object) -> str:
    return value.decode("utf-8", "replace").rstrip("\x00") if isinstance(value, bytes) else str(value)


def _profile_info(nvml: ModuleType, handle: Any, value: int) -> Any | None:
    """The profile's info, V first then version 1; None when the GPU lacks it. INVALID_ARGUMENT raises."""
    get = nvml.nvmlDeviceGetGpuInstanceProfileInfo
    for version in (2, 1):
        try:
            return get(handle, value, version=version)
        except nvml.NVMLError as exc:
            if nvml_code(nvml, exc) not in NOT_SUPPORTED_CODES:
                raise
    return None


def placements(nvml: ModuleType, handle: Any, profile_id: int) -> tuple[MigPlacement, ...]:
    """Every placement the profile may take: the count first (no array), then the array."""
    count = ctypes.c_uint(0)
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, None, ctypes.byref(count))
    wanted = min(int(count.value), MAX_PLACEMENTS)
    if wanted == 0:
        return ()
    array = (nvml.c_nvmlGpuInstancePlacement_t * wanted)()
    count.value = wanted
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, array, ctypes.byref(count))
    found = min(int(count.value), wanted)
    return tuple(MigPlacement(start=int(array[i].start), size=int(array[i].size)) for i in range(found))


def read_profiles(nvml: ModuleType, handle: Any, gpu_memory_mib: int) -> tuple[MigProfile, ...]:
    """The GPU-instance profiles the GPU offers, with their placements; () for a GPU without MIG.

    Raises ``NVMLError`` for answers other than NOT_SUPPORTED / FUNCTION_NOT_FOUND (a profile
    the GPU lacks, a driver without the call) and INVALID_ARGUMENT (past the last profile).
    """
    if getattr(nvml, "nvmlDeviceGetGpuInstanceProfileInfo", None) is None:
        return ()
    count = int(getattr(nvml, "NVML_GPU_INSTANCE_PROFILE_COUNT", PROFILE_COUNT))
    out: list[MigProfile] = []
    for value in range(min(MAX_PROFILES, max(count, PROFILE_COUNT) + 8)):
        try:
            info = _profile_info(nvml, handle, value)
        except nvml.NVMLError as exc:
            if nvml_code(nvml, exc) != ERROR_INVALID_ARGUMENT:
                raise
            if value >= count:
                break  # past the last profile this driver knows
            continue
        if info is None:
            continue
        profile = _profile(nvml, handle, value, info, gpu_memory_mib)
        if profile is not None and all(p.profile_id != profile.profile_id for p in out):
            out.append(profile)
    return tuple(out)


def _profile(nvml: ModuleType, handle: Any, value: int, info: Any, gpu_memory_mib: int) -> MigProfile | None:
    try:
        where = placements(nvml, handle, int(info.id))
    except nvml.NVMLError as exc:
        if nvml_code(nvml, exc) in NOT_SUPPORTED_CODES | {ERROR_INVALID_ARGUMENT}:
            return None
        raise
    if not where:
        return None  # nowhere to create it
    slices, memory = int(info.sliceCount), int(info.memorySizeMB)
    return MigProfile(
        name=profile_name(_text(getattr(info, "name", b"")), value, slices, memory, gpu_memory_mib),
        profile_id=int(info.id),
        compute_slices=slices,
        memory_slices=where[0].size,
        memory_mib=memory,
        multiprocessors=int(info.multiprocessorCount),
        max_instances=int(info.instanceCount),
        placements=where,
        copy_engines=int(info.copyEngineCount),
        decoders=int(info.decoderCount),
        encoders=int(info.encoderCount),
        jpeg_engines=int(info.jpegCount),
        ofa_engines=int(info.ofaCount),
    )


def memory_slices(profiles: tuple[MigProfile, ...]) -> int:
    """The GPU's memory slices: where its placements end (8; 4 on an A30); 0 without profiles."""
    return max((p.start + p.size for profile in profiles for p in profile.placements), default=0)


def gpu_instances(nvml: ModuleType, handle: Any, profiles: tuple[MigProfile, ...]) -> list[GpuInstance]:
    """Every GPU instance on the GPU, whoever made it: ``nvmlDeviceGetGpuInstances`` per profile.

    The buffer holds the profile's ``instanceCount``, as nvml.h asks. Only call in MIG mode.
    """
    out: list[GpuInstance] = []
    for profile in profiles:
        size = max(1, min(profile.max_instances, MAX_PLACEMENTS))
        array = (nvml.c_nvmlGpuInstance_t * size)()
        count = ctypes.c_uint(size)
        nvml.nvmlDeviceGetGpuInstances(handle, profile.profile_id, array, ctypes.byref(count))
        for i in range(min(int(count.value), size)):
            info = nvml.nvmlGpuInstanceGetInfo(array[i])
            placement = MigPlacement(start=int(info.placement.start), size=int(info.placement.size))
            found = GpuInstance(id=int(info.id), profile_id=int(info.profileId), placement=placement, handle=array[i])
            out.append(found)
    return out
