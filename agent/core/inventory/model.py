"""The node's devices as one immutable model shared by every part of the agent.

Backends (NVML, simulated) build an :class:`Inventory`; nothing else mutates it. A new
inventory (driver upgrade, MIG reconfiguration) is a new object, so readers can hold on
to the one they were given without locks.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import IntEnum


class PcieLevel(IntEnum):
    """Closest common PCIe ancestor of two GPUs, NVML's ``nvmlGpuTopologyLevel_t`` order.

    Lower values are closer. ``SYSTEM`` means the path crosses the inter-socket link.
    """

    INTERNAL = 0  # same board (multi-GPU card)
    SINGLE = 10  # one PCIe switch
    MULTIPLE = 20  # several PCIe switches, no host bridge
    HOSTBRIDGE = 30  # same host bridge
    NODE = 40  # same NUMA node, different host bridges
    SYSTEM = 50  # across sockets (SMP interconnect)

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True, slots=True)
class Link:
    """How two GPUs talk to each other."""

    nvlinks: int
    pcie: PcieLevel

    def describe(self) -> str:
        if self.nvlinks:
            return f"NV{self.nvlinks}"
        return {
            PcieLevel.INTERNAL: "PIX",
            PcieLevel.SINGLE: "PIX",
            PcieLevel.MULTIPLE: "PXB",
            PcieLevel.HOSTBRIDGE: "PHB",
            PcieLevel.NODE: "NODE",
            PcieLevel.SYSTEM: "SYS",
        }[self.pcie]


@dataclass(frozen=True, slots=True)
class MigPlacement:
    """Where a GPU instance sits: memory slices ``[start, start + size)`` of its parent GPU.

    NVML's ``nvmlGpuInstancePlacement_t``. Two GPU instances on one GPU conflict exactly when
    their slice ranges overlap.
    """

    start: int
    size: int

    @property
    def slices(self) -> range:
        return range(self.start, self.start + self.size)

    def overlaps(self, other: MigPlacement) -> bool:
        return self.start < other.start + other.size and other.start < self.start + self.size


@dataclass(frozen=True, slots=True)
class MigProfile:
    """A GPU-instance profile a MIG-capable GPU offers, with every placement it may take.

    From NVML (``nvmlDeviceGetGpuInstanceProfileInfoV`` and
    ``nvmlDeviceGetGpuInstancePossiblePlacements_v2``) or from a simulated preset.
    """

    #: e.g. "1g.10gb", "1g.10gb+me" (the vocabulary of static MIG devices' ``profile``)
    name: str
    #: ``nvmlGpuInstanceProfileInfo_t.id`` (nvidia-smi's profile ID): what creating an instance takes
    profile_id: int
    compute_slices: int
    #: memory slices one instance occupies (its placements' size)
    memory_slices: int
    memory_mib: int
    multiprocessors: int
    #: how many instances of this profile the GPU holds at most (1 for a "+me" profile)
    max_instances: int
    placements: tuple[MigPlacement, ...]
    copy_engines: int = 0
    decoders: int = 0
    encoders: int = 0
    jpeg_engines: int = 0
    ofa_engines: int = 0


@dataclass(frozen=True, slots=True)
class MigDevice:
    """One MIG device (a GPU instance + compute instance pair) carved from a parent GPU."""

    uuid: str
    parent_uuid: str
    index: int  # MIG device index within the parent (nvmlDeviceGetMigDeviceHandleByIndex)
    gpu_instance_id: int
    compute_instance_id: int
    profile: str  # e.g. "1g.10gb"
    memory_mib: int
    # capability minors under /dev/nvidia-caps for this GI and CI (None when unknown)
    gi_cap_minor: int | None = None
    ci_cap_minor: int | None = None
    #: the GPU-instance profile ID and placement, where the backend knows them
    profile_id: int | None = None
    placement: MigPlacement | None = None


@dataclass(frozen=True, slots=True)
class Gpu:
    """One physical GPU."""

    uuid: str
    index: int
    minor: int  # /dev/nvidia<minor>
    product_name: str
    architecture: str  # e.g. "hopper"
    compute_capability: str  # e.g. "9.0"
    memory_mib: int
    pci_bus_id: str  # NVML form, e.g. "00000000:18:00.0"
    numa_node: int | None
    mig_enabled: bool = False
    mig_devices: tuple[MigDevice, ...] = ()
    #: NVML's brand (``nvmlDeviceGetBrand``) as NVIDIA's DRA driver names it, e.g. "Nvidia", "Tesla"
    brand: str = ""
    #: the PCIe root complex the GPU hangs off, as ``resource.kubernetes.io/pcieRoot`` spells it
    #: (e.g. "pci0000:00"); None when unknown
    pcie_root: str | None = None
    #: memory slices of a MIG-capable GPU (8; 4 on an A30), 0 when it cannot do MIG
    mig_memory_slices: int = 0
    #: the GPU-instance profiles a MIG-capable GPU offers (empty when it cannot do MIG)
    mig_profiles: tuple[MigProfile, ...] = ()

    @property
    def short_bus_id(self) -> str:
        """The sysfs form of the PCI address (``0000:18:00.0``)."""
        bus = self.pci_bus_id.lower()
        return bus[4:] if len(bus) == 16 else bus


@dataclass(frozen=True, slots=True)
class Inventory:
    """Everything a backend knows about the node's GPUs at one moment."""

    backend: str
    driver_version: str
    cuda_driver_version: str
    gpus: tuple[Gpu, ...]
    # keyed by the two UUIDs in sorted order; missing pairs read as cross-socket PCIe
    links: Mapping[tuple[str, str], Link] = field(default_factory=dict)
    #: devices the backend could not read, one line each ("GPU 3: getting its handle: ...");
    #: the GPUs above are the ones that could be read
    problems: tuple[str, ...] = ()
    #: why there are no GPUs, when the backend knows (e.g. "libnvidia-ml.so.1 not found under /")
    reason: str = ""

    def __post_init__(self) -> None:
        uuids = [g.uuid for g in self.gpus]
        if len(set(uuids)) != len(uuids):
            raise ValueError(f"duplicate GPU UUIDs in inventory: {sorted(uuids)}")
        indexes = [g.index for g in self.gpus]
        if len(set(indexes)) != len(indexes):
            raise ValueError(f"duplicate GPU indexes in inventory: {sorted(indexes)}")

    @classmethod
    def empty(cls, backend: str, reason: str = "") -> Inventory:
        return cls(backend=backend, driver_version="", cuda_driver_version="", gpus=(), reason=reason)

    def __iter__(self) -> Iterator[Gpu]:
        return iter(self.gpus)

    def __len__(self) -> int:
        return len(self.gpus)

    def find(self, key: str) -> Gpu | None:
        """A GPU by UUID, or by index when ``key`` is all digits."""
        index = int(key) if key.isascii() and key.isdecimal() and len(key) <= 6 else None
        for gpu in self.gpus:
            if gpu.uuid == key or gpu.index == index:
                return gpu
        return None

    def find_mig(self, uuid: str) -> MigDevice | None:
        for gpu in self.gpus:
            for mig in gpu.mig_devices:
                if mig.uuid == uuid:
                    return mig
        return None

    def link(self, a: str, b: str) -> Link:
        key = (a, b) if a <= b else (b, a)
        return self.links.get(key, Link(nvlinks=0, pcie=PcieLevel.SYSTEM))


def link_key(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a <= b else (b, a)
