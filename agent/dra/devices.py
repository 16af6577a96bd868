"""The node's GPUs as DRA devices: stable names, attributes and capacity.

One pure function, :func:`dra_devices`, turns an inventory and each GPU's publish shape into
the devices DRA may publish and prepare. The ResourceSlice publisher and claim preparation both
use it, so a name in a slice always resolves to the same GPU, MIG device, partition or share
when a claim comes back with it.

Names are DNS labels and stable across restarts and re-reads (allocations name devices):

* ``whole`` (the default): ``gpu-<minor>`` for a whole GPU, ``gpu-<minor>-mig-<gpu
  instance>-<compute instance>`` for a MIG device that exists (NVIDIA's DRA driver uses
  ``gpu-<minor>`` too). A GPU in MIG mode is published as its MIG devices only; a whole GPU and
  its MIG devices are never offered side by side.
* ``dynamic-mig``: ``gpu-<minor>`` and one device per MIG profile placement, all consuming the
  GPU's counter set (:mod:`agent.dra.partitions`); MIG devices someone else made are offered as
  in ``whole`` mode, and the placements they take are not offered.
* ``shared``: ``gpu-<minor>-shared``, ``type: shared``, with ``allowMultipleAllocations`` and a
  ``memory`` capacity whose request policy rounds each share up to ``dra.sharing.memory_step_mib``
  (KEP-5075, kubernetes/enhancements ``keps/sig-scheduling/5075-dra-consumable-capacity``). Its own
  name, not ``gpu-<minor>``: a claim allocated the dedicated GPU before a mode change must not be
  prepared as a share of it, or the other way round. ``sharing`` (``time-sliced`` or ``mps``) and
  ``memoryIsolation`` (``none`` or ``mps-limit``) say what a share is guaranteed.

Attributes follow NVIDIA's DRA driver vocabulary where it has a word (``type``, ``uuid``,
``productName``, ``brand``, ``architecture``, ``cudaComputeCapability``, ``driverVersion``,
``cudaDriverVersion``, ``pcieBusID``, ``parentUUID``, ``profile``), plus ``index`` and
``minor`` and the standard ``resource.kubernetes.io/pcieRoot``; capacity ``memory`` in bytes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from agent.core.config.schema import PublishMode
from agent.core.inventory.model import Gpu, Inventory, MigDevice, MigPlacement
from agent.core.partitioning import switches_mig_mode_live
from agent.dra.partitions import (
    CounterSet,
    CounterUse,
    Partition,
    consumption,
    counter_set,
    full_profile,
    partitions,
    whole_consumption,
    whole_partition,
)

#: the standard attribute naming the PCIe root complex (k8s.io/dynamic-resource-allocation)
PCIE_ROOT_ATTRIBUTE = "resource.kubernetes.io/pcieRoot"
#: the apiserver's limit on a string or version attribute value, in bytes
MAX_STRING_BYTES = 64

AttributeKind = Literal["int", "bool", "string", "version"]


@dataclass(frozen=True, slots=True)
class Attribute:
    """One typed attribute value, as ``DeviceAttribute`` holds exactly one of them."""

    kind: AttributeKind
    value: int | bool | str


@dataclass(frozen=True, slots=True)
class SharePolicy:
    """The ``memory`` capacity of a shared GPU and its request policy, in bytes."""

    memory: int
    #: what a claim that does not ask gets (``requestPolicy.default``)
    default: int
    #: ``requestPolicy.validRange.min`` and ``.step``: shares are whole multiples of it
    step: int
    mps: bool = False


@dataclass(frozen=True, slots=True)
class GpuShape:
    """How one GPU is published now: its effective mode (see ``agent.dra.modes``) and what it needs."""

    mode: PublishMode = PublishMode.WHOLE
    #: placements held by MIG instances the agent did not make: dynamic-mig leaves them out
    blocked: tuple[MigPlacement, ...] = ()
    #: UUIDs of MIG instances the agent made: never published as MIG devices that exist
    ours: frozenset[str] = frozenset()
    #: shared mode: the capacity and its policy
    share: SharePolicy | None = None


WHOLE = GpuShape()


@dataclass(frozen=True, slots=True)
class DraDevice:
    """One device DRA can publish and prepare."""

    name: str
    #: the GPU or MIG UUID a container gets (CDI, health); a partition's parent until it is made
    uuid: str
    #: the physical GPU (ownership)
    gpu_uuid: str
    is_mig: bool
    #: attribute name -> value; names without a domain belong to the driver's domain
    attributes: Mapping[str, Attribute]
    #: capacity name -> Kubernetes quantity string
    capacity: Mapping[str, str]
    #: the MIG instance to make at prepare (dynamic-mig partitions, and the whole GPU in MIG mode)
    partition: Partition | None = None
    consumes: tuple[CounterUse, ...] = ()
    #: a shared GPU: allowMultipleAllocations, and the ``memory`` request policy
    share: SharePolicy | None = None


def gpu_device_name(gpu: Gpu) -> str:
    return f"gpu-{gpu.minor}"


def shared_device_name(gpu: Gpu) -> str:
    return f"gpu-{gpu.minor}-shared"


def mig_device_name(gpu: Gpu, mig: MigDevice) -> str:
    return f"gpu-{gpu.minor}-mig-{mig.gpu_instance_id}-{mig.compute_instance_id}"


def dra_devices(inventory: Inventory, shapes: Mapping[str, GpuShape | None] | None = None) -> list[DraDevice]:
    """Every device of ``inventory`` DRA could offer, in a stable order (GPU index, then per GPU).

    ``shapes`` gives each GPU's shape (None: it is changing mode and offers nothing); without
    it every GPU is published whole.
    """
    out: list[DraDevice] = []
    for gpu in sorted(inventory.gpus, key=lambda g: g.index):
        shape = WHOLE if shapes is None else shapes.get(gpu.uuid, WHOLE)
        if shape is None:
            continue
        common = _common_attributes(inventory, gpu)
        if shape.mode is PublishMode.DYNAMIC_MIG:
            out.extend(_partitioned(gpu, common, shape))
            continue
        if shape.mode is PublishMode.SHARED and shape.share is not None:
            out.append(_shared(gpu, common, shape.share))
            continue
        if gpu.mig_enabled:
            out.extend(_existing_migs(gpu, common, shape))
            continue
        out.append(_whole(gpu, common))
    return out


def _whole(
    gpu: Gpu, common: dict[str, Attribute], partition: Partition | None = None, consumes: tuple[CounterUse, ...] = ()
) -> DraDevice:
    """``gpu-<minor>``: the GPU (or, given ``partition``, its full-size MIG instance)."""
    return DraDevice(
        name=gpu_device_name(gpu),
        uuid=gpu.uuid,
        gpu_uuid=gpu.uuid,
        is_mig=False,
        attributes={**common, "type": Attribute("string", "gpu"), "uuid": _string(gpu.uuid)},
        capacity={"memory": binary_quantity(gpu.memory_mib * 1024 * 1024)},
        partition=partition,
        consumes=consumes,
    )


def _existing_migs(gpu: Gpu, common: dict[str, Attribute], shape: GpuShape) -> list[DraDevice]:
    """The MIG devices that exist on ``gpu`` and that the agent did not make, as they are."""
    out = []
    for mig in sorted(gpu.mig_devices, key=lambda m: m.index):
        if mig.uuid in shape.ours:
            continue
        attributes = {
            **common,
            "type": Attribute("string", "mig"),
            "uuid": _string(mig.uuid),
            "parentUUID": _string(gpu.uuid),
            "profile": _string(mig.profile),
        }
        out.append(
            DraDevice(
                name=mig_device_name(gpu, mig),
                uuid=mig.uuid,
                gpu_uuid=gpu.uuid,
                is_mig=True,
                attributes=attributes,
                capacity={"memory": binary_quantity(mig.memory_mib * 1024 * 1024)},
            )
        )
    return out


def counter_sets(inventory: Inventory, shapes: Mapping[str, GpuShape | None]) -> list[CounterSet]:
    """The counter sets of the GPUs published ``dynamic-mig``, in GPU index order."""
    out = []
    for gpu in sorted(inventory.gpus, key=lambda g: g.index):
        shape = shapes.get(gpu.uuid)
        if shape is not None and shape.mode is PublishMode.DYNAMIC_MIG:
            out.append(counter_set(gpu))
    return out


def can_partition(gpu: Gpu) -> str:
    """Why ``gpu`` cannot be published ``dynamic-mig`` ("" when it can)."""
    if not gpu.mig_profiles or gpu.mig_memory_slices <= 0:
        return "the GPU cannot do MIG (no MIG profiles)"
    if not gpu.mig_enabled and not switches_mig_mode_live(gpu.architecture):
        return (
            f"the GPU is not in MIG mode, and on {gpu.architecture or 'this architecture'} switching it needs "
            "a GPU reset with no process on it, which the agent never does: enable it with "
            f"nvidia-smi -i {gpu.index} -mig 1 and reset the GPU"
        )
    if full_profile(gpu) is None:
        return "the GPU has no MIG profile that spans it whole"
    return ""


def _partitioned(gpu: Gpu, common: dict[str, Attribute], shape: GpuShape) -> list[DraDevice]:
    out = []
    # the whole GPU: out of MIG mode, the GPU itself (its first partition switches MIG mode on,
    # which Hopper does without a reset); in MIG mode, its full-size instance. Either way it
    # takes every memory slice.
    whole = whole_partition(gpu, shape.blocked) if gpu.mig_enabled else None
    blocked = any(b.overlaps(MigPlacement(0, gpu.mig_memory_slices)) for b in shape.blocked)
    if (whole is not None or not gpu.mig_enabled) and not blocked:
        out.append(_whole(gpu, common, whole, (whole_consumption(gpu),)))
    # MIG devices someone else made are offered as they are (never made or destroyed by the
    # agent); the placements they take are not offered as partitions
    out.extend(_existing_migs(gpu, common, shape))
    for name, profile, partition in partitions(gpu, shape.blocked):
        out.append(
            DraDevice(
                name=name,
                uuid=gpu.uuid,
                gpu_uuid=gpu.uuid,
                is_mig=True,
                attributes={
                    **common,
                    "type": Attribute("string", "mig"),
                    "parentUUID": _string(gpu.uuid),
                    "profile": _string(profile.name),
                },
                capacity={
                    "memory": binary_quantity(partition.memory_mib * 1024 * 1024),
                    "multiprocessors": str(partition.multiprocessors),
                },
                partition=partition,
                consumes=(consumption(gpu, profile, partition.placement),),
            )
        )
    return out


def share_policy(gpu: Gpu, *, default_mib: int, step_mib: int, mps: bool) -> SharePolicy | None:
    """The shared device's memory policy; None when the GPU holds fewer than two steps (the
    apiserver requires ``min + step <= value``)."""
    memory, step = gpu.memory_mib * 1024 * 1024, step_mib * 1024 * 1024
    if memory < 2 * step:
        return None
    default = min(default_mib * 1024 * 1024, memory // step * step)
    return SharePolicy(memory=memory, default=default, step=step, mps=mps)


def _shared(gpu: Gpu, common: dict[str, Attribute], share: SharePolicy) -> DraDevice:
    return DraDevice(
        name=shared_device_name(gpu),
        uuid=gpu.uuid,
        gpu_uuid=gpu.uuid,
        is_mig=False,
        attributes={
            **common,
            "type": Attribute("string", "shared"),
            "uuid": _string(gpu.uuid),
            "sharing": Attribute("string", "mps" if share.mps else "time-sliced"),
            "memoryIsolation": Attribute("string", "mps-limit" if share.mps else "none"),
        },
        capacity={"memory": binary_quantity(share.memory)},
        share=share,
    )


def _common_attributes(inventory: Inventory, gpu: Gpu) -> dict[str, Attribute]:
    attributes: dict[str, Attribute] = {
        "index": Attribute("int", gpu.index),
        "minor": Attribute("int", gpu.minor),
        "productName": _string(gpu.product_name),
        "architecture": _string(gpu.architecture[:1].upper() + gpu.architecture[1:]),
        "pcieBusID": _string(gpu.short_bus_id),
    }
    if gpu.brand:
        attributes["brand"] = _string(gpu.brand)
    for name, text in (
        ("cudaComputeCapability", gpu.compute_capability),
        ("driverVersion", inventory.driver_version),
        ("cudaDriverVersion", inventory.cuda_driver_version),
    ):
        version = semver(text)
        if version is not None:
            attributes[name] = Attribute("version", version)
    if gpu.pcie_root:
        attributes[PCIE_ROOT_ATTRIBUTE] = _string(gpu.pcie_root)
    return attributes


def _string(text: str) -> Attribute:
    """A string attribute cut to the apiserver's 64-byte limit (on a character boundary)."""
    data = text.encode()
    if len(data) > MAX_STRING_BYTES:
        text = data[:MAX_STRING_BYTES].decode(errors="ignore")
    return Attribute("string", text)


_NUMERIC = re.compile(r"\d+(?:\.\d+){0,2}")


def semver(text: str) -> str | None:
    """``"9.0"`` -> ``"9.0.0"``, ``"570.124.06"`` -> ``"570.124.6"``; None when not numeric.

    Semantic versions allow no leading zeros, and NVIDIA's driver versions have them.
    """
    if not _NUMERIC.fullmatch(text):
        return None
    parts = [str(int(p)) for p in text.split(".")]
    return ".".join([*parts, "0", "0"][:3])


_BINARY_SUFFIXES = (("Ei", 60), ("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10))


def binary_quantity(n_bytes: int) -> str:
    """Bytes as a canonical BinarySI Kubernetes quantity (the largest exact suffix)."""
    for suffix, shift in _BINARY_SUFFIXES:
        if n_bytes and n_bytes % (1 << shift) == 0:
            return f"{n_bytes >> shift}{suffix}"
    return str(n_bytes)
