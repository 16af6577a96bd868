"""A MIG-capable GPU as partitionable DRA devices: its counter set and one device per placement. Pure.

KEP-4815 (kubernetes/enhancements ``keps/sig-scheduling/4815-dra-partitionable-devices``,
beta in 1.36) lets a ResourceSlice pool declare *counter sets* and devices that *consume*
counters; the scheduler never allocates devices whose consumption would take a counter below
zero. A GPU in ``dynamic-mig`` mode gets one counter set, ``gpu-<minor>-counters``:

* ``memory-slice-<i>`` = 1 for each of the GPU's memory slices (8 on A100/H100, 4 on an A30).
  A GPU instance occupies the slices ``[start, start + size)`` of its placement, and NVML
  refuses to create one over occupied slices (``nvmlDeviceCreateGpuInstanceWithPlacement``,
  ``NVML_ERROR_INSUFFICIENT_RESOURCES``), so each partition consumes exactly its slices: two
  placements that overlap can never both be allocated, two that do not can. NVIDIA's DRA driver
  models MIG the same way (NVIDIA/k8s-dra-driver-gpu v0.4.0, ``cmd/gpu-kubelet-plugin/partitions.go``).
* ``profile-<id>-instances`` = the profile's ``instanceCount`` for a profile that allows fewer
  instances than it has placements (the ``+me`` profiles: 7 placements, one instance per GPU).
  Each of its partitions consumes 1.

Compute slices need no counter: on every table NVIDIA documents, placements that share no
memory slice never add up to more compute slices than the GPU has (7g uses all 8 memory slices,
3g and 4g use 4 each).

Devices: one per (profile, placement), named ``gpu-<minor>-mig-<profile>-<profile ID>-<start>``
as NVIDIA's DRA driver names them (``1g.10gb+me`` becomes ``1g10gb-me``), with the parent's
attributes, ``type: mig`` and ``profile`` (the vocabulary of MIG devices that already exist), and
capacity ``memory`` and ``multiprocessors``. The whole GPU (``gpu-<minor>``, ``type: gpu``)
consumes every memory slice, so it excludes every partition and every partition excludes it.
What a container gets for it depends on the GPU's MIG mode when the claim is prepared: out of
MIG mode, the GPU itself; in MIG mode, where the GPU cannot run CUDA except in MIG instances,
its full-size profile at the placement that covers every memory slice (7g.80gb at 0:8 on an
H100): all of the GPU's memory and compute as one MIG device (a MIG device has no NVLink
peer-to-peer, which a container that needs it should know).

MIG mode itself changes only with no process on the GPU, and before Hopper only with a reset.
The backends make the first instance on a Hopper-or-later GPU switch MIG mode on and the last
one destroyed switch it off again (as NVIDIA's DRA driver does); an Ampere GPU is partitioned
only when an operator put it in MIG mode.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agent.core.inventory.model import Gpu, MigPlacement, MigProfile

#: the API's limit on counters in one counter set, and in one device's consumption of it
MAX_COUNTERS = 32


@dataclass(frozen=True, slots=True)
class Partition:
    """The MIG GPU instance a device stands for, made when a claim is prepared."""

    profile_id: int
    profile: str
    placement: MigPlacement
    memory_mib: int
    multiprocessors: int


@dataclass(frozen=True, slots=True)
class CounterSet:
    """``sharedCounters[]`` entry: counter name -> quantity."""

    name: str
    counters: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class CounterUse:
    """``consumesCounters[]`` entry of a device."""

    counter_set: str
    counters: tuple[tuple[str, str], ...]


def counter_set_name(gpu: Gpu) -> str:
    return f"gpu-{gpu.minor}-counters"


def slice_counter(i: int) -> str:
    return f"memory-slice-{i}"


def _limited(profile: MigProfile) -> bool:
    return 0 < profile.max_instances < len(profile.placements)


def instance_counter(profile: MigProfile) -> str:
    return f"profile-{profile.profile_id}-instances"


def counter_set(gpu: Gpu) -> CounterSet:
    counters = [(slice_counter(i), "1") for i in range(gpu.mig_memory_slices)]
    counters += [(instance_counter(p), str(p.max_instances)) for p in usable_profiles(gpu) if _limited(p)]
    return CounterSet(name=counter_set_name(gpu), counters=tuple(counters[:MAX_COUNTERS]))


def usable_profiles(gpu: Gpu) -> list[MigProfile]:
    """The profiles partitions are made of: placements inside the GPU's slices, counters that fit."""
    out = []
    extra = 0
    for profile in sorted(gpu.mig_profiles, key=lambda p: (p.memory_slices, p.compute_slices, p.profile_id)):
        if not profile.placements or profile.memory_slices <= 0:
            continue
        if any(
            p.start < 0 or p.size != profile.memory_slices or p.start + p.size > gpu.mig_memory_slices
            for p in profile.placements
        ):
            continue
        if _limited(profile):
            if gpu.mig_memory_slices + extra + 1 > MAX_COUNTERS:
                continue
            extra += 1
        out.append(profile)
    return out


def full_profile(gpu: Gpu) -> MigProfile | None:
    """The profile whose one placement covers every memory slice (7g on A100/H100), the most compute first."""
    whole = MigPlacement(0, gpu.mig_memory_slices)
    candidates = [p for p in usable_profiles(gpu) if whole in p.placements and not _limited(p)]
    return max(candidates, key=lambda p: (p.compute_slices, p.multiprocessors, -p.profile_id), default=None)


def whole_consumption(gpu: Gpu) -> CounterUse:
    """What the whole GPU takes: every memory slice (so no partition sits next to it)."""
    return CounterUse(
        counter_set=counter_set_name(gpu), counters=tuple((slice_counter(i), "1") for i in range(gpu.mig_memory_slices))
    )


def consumption(gpu: Gpu, profile: MigProfile, placement: MigPlacement) -> CounterUse:
    counters = [(slice_counter(i), "1") for i in placement.slices]
    if _limited(profile):
        counters.append((instance_counter(profile), "1"))
    return CounterUse(counter_set=counter_set_name(gpu), counters=tuple(counters))


_NOT_LABEL = re.compile(r"[^a-z0-9]+")


def profile_slug(name: str) -> str:
    """``1g.10gb+me`` -> ``1g10gb-me``: a profile name as part of a DNS label."""
    return _NOT_LABEL.sub("-", name.lower().replace(".", "")).strip("-") or "profile"


def partition_name(gpu: Gpu, profile: MigProfile, placement: MigPlacement) -> str:
    tail = f"-{profile.profile_id}-{placement.start}"
    head = f"gpu-{gpu.minor}-mig-"
    slug = profile_slug(profile.name)[: 63 - len(head) - len(tail)].strip("-")
    return f"{head}{slug}{tail}"


def partitions(gpu: Gpu, blocked: tuple[MigPlacement, ...] = ()) -> list[tuple[str, MigProfile, Partition]]:
    """(device name, profile, partition) for every placement of every usable profile, smallest
    profiles first and placements in slice order; those overlapping ``blocked`` (MIG instances the
    agent did not make) are left out."""
    out = []
    for profile in usable_profiles(gpu):
        for placement in sorted(profile.placements, key=lambda p: p.start):
            if any(placement.overlaps(b) for b in blocked):
                continue
            out.append((partition_name(gpu, profile, placement), profile, _partition(profile, placement)))
    return out


def whole_partition(gpu: Gpu, blocked: tuple[MigPlacement, ...] = ()) -> Partition | None:
    """What the whole GPU is on a GPU in MIG mode: its full-size instance, None when there is none
    (or a foreign instance is in the way)."""
    profile = full_profile(gpu)
    if profile is None:
        return None
    placement = MigPlacement(0, gpu.mig_memory_slices)
    if any(placement.overlaps(b) for b in blocked):
        return None
    return _partition(profile, placement)


def _partition(profile: MigProfile, placement: MigPlacement) -> Partition:
    return Partition(
        profile_id=profile.profile_id,
        profile=profile.name,
        placement=placement,
        memory_mib=profile.memory_mib,
        multiprocessors=profile.multiprocessors,
    )
