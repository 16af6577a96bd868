"""The node's GPUs as DRA devices: stable names, attributes and capacity.

One pure function, :func:`dra_devices`, turns an inventory into the devices DRA may publish
and prepare. The ResourceSlice publisher and claim preparation both use it, so a name in a
slice always resolves to the same GPU or MIG device when a claim comes back with it.

Names are DNS labels and stable across restarts and re-reads (allocations name devices):
``gpu-<minor>`` for a whole GPU, ``gpu-<minor>-mig-<gpu instance>-<compute instance>`` for a
MIG device (NVIDIA's DRA driver uses ``gpu-<minor>`` too). A GPU in MIG mode is published as
its MIG devices only; a whole GPU and its MIG devices are never offered side by side.

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

from agent.core.inventory.model import Gpu, Inventory, MigDevice

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
class DraDevice:
    """One device DRA can publish and prepare."""

    name: str
    #: the GPU or MIG UUID a container gets (CDI, health)
    uuid: str
    #: the physical GPU (ownership)
    gpu_uuid: str
    is_mig: bool
    #: attribute name -> value; names without a domain belong to the driver's domain
    attributes: Mapping[str, Attribute]
    #: capacity name -> Kubernetes quantity string
    capacity: Mapping[str, str]


def gpu_device_name(gpu: Gpu) -> str:
    return f"gpu-{gpu.minor}"


def mig_device_name(gpu: Gpu, mig: MigDevice) -> str:
    return f"gpu-{gpu.minor}-mig-{mig.gpu_instance_id}-{mig.compute_instance_id}"


def dra_devices(inventory: Inventory) -> list[DraDevice]:
    """Every device of ``inventory`` DRA could offer, in a stable order (GPU index, MIG index)."""
    out: list[DraDevice] = []
    for gpu in sorted(inventory.gpus, key=lambda g: g.index):
        common = _common_attributes(inventory, gpu)
        if gpu.mig_enabled:
            for mig in sorted(gpu.mig_devices, key=lambda m: m.index):
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
            continue
        out.append(
            DraDevice(
                name=gpu_device_name(gpu),
                uuid=gpu.uuid,
                gpu_uuid=gpu.uuid,
                is_mig=False,
                attributes={**common, "type": Attribute("string", "gpu"), "uuid": _string(gpu.uuid)},
                capacity={"memory": binary_quantity(gpu.memory_mib * 1024 * 1024)},
            )
        )
    return out


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
