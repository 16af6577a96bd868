"""Build an :class:`Inventory` from NVML, synchronously, one device at a time.

:class:`InventoryReader` makes many small NVML calls; the backend runs the whole read in
one worker thread (``asyncio.to_thread``) rather than hopping threads per call.

A node is read per device: a GPU that cannot be read (``GPU_IS_LOST``, ``NO_PERMISSION``, a
required query failing) is left out and named in ``Inventory.problems``; the others are
kept. A GPU that was read before and now answers ``GPU_IS_LOST`` keeps its last record, so
it stays visible (its health check reports it lost) instead of silently disappearing. Only
the node-wide queries (driver version, GPU count) fail the whole read. Optional fields
(architecture, brand, MIG mode, NVLink, topology) fall back when the device or driver does
not support the query; the NUMA node and PCIe root come from sysfs
(:mod:`agent.backends.sysfs`), never from NVML.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import structlog

from agent.backends import sysfs
from agent.backends.nvml import migread
from agent.backends.nvml.errors import (
    ERROR_INVALID_ARGUMENT,
    ERROR_NOT_FOUND,
    NOT_SUPPORTED_CODES,
    nvml_code,
    translate,
)
from agent.backends.sysfs import sysfs_bus_id
from agent.base.errors import BackendError, GpuLostError
from agent.core.inventory.model import Gpu, Inventory, Link, MigDevice, MigProfile, PcieLevel, link_key

log = structlog.get_logger("agent.nvml")

#: ``nvmlDeviceArchitecture_t`` (C ABI values)
ARCHITECTURES = {
    2: "kepler",
    3: "maxwell",
    4: "pascal",
    5: "volta",
    6: "turing",
    7: "ampere",
    8: "ada",
    9: "hopper",
    10: "blackwell",
    13: "rubin",
}

#: ``nvmlBrandType_t`` as go-nvlib's ``GetBrandAsString`` spells it (what NVIDIA's DRA driver
#: publishes); values it has no name for read as "" (unknown)
BRANDS = {
    0: "Unknown",
    1: "Quadro",
    2: "Tesla",
    3: "NVS",
    4: "Grid",
    5: "GeForce",
    6: "Titan",
    7: "NvidiaVApps",
    8: "NvidiaVPC",
    9: "NvidiaVCS",
    10: "NvidiaVWS",
    11: "NvidiaCloudGaming",
    12: "QuadroRTX",
    13: "NvidiaRTX",
    14: "Nvidia",
    15: "GeForceRTX",
    16: "TitanRTX",
}

_MIG_ENABLE = 1
_NVLINK_DEVICE_TYPE_SWITCH = 2
_FEATURE_ENABLED = 1
_DEFAULT_MAX_LINKS = 18
_MIG_PROFILE_RE = re.compile(r"\bMIG\s+(\S+)\s*$")
# /proc/driver/nvidia-caps/mig-minors: "gpu0/gi1/access 12", "gpu0/gi1/ci0/access 13"
_MIG_MINOR_RE = re.compile(r"^gpu(\d+)/gi(\d+)(?:/ci(\d+))?/access\s+(\d+)$")
#: empty MIG slots answer one of these (go-nvlib skips both)
_EMPTY_MIG_SLOT = frozenset({ERROR_NOT_FOUND, ERROR_INVALID_ARGUMENT})

MigMinors = dict[tuple[int, int, int | None], int]


def text(value: object) -> str:
    """NVML strings arrive as ``str`` (pynvml decodes) or ``bytes`` (ctypes struct fields)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace").rstrip("\x00")
    return str(value)


def cuda_version(value: int) -> str:
    """``12040`` -> ``"12.4"``."""
    return f"{value // 1000}.{(value % 1000) // 10}"


def read_mig_minors(procfs_root: Path) -> MigMinors | None:
    """Capability minors keyed by (GPU minor, GI id, CI id or None); None when the file is absent."""
    path = procfs_root / "driver" / "nvidia-caps" / "mig-minors"
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    minors: MigMinors = {}
    for line in lines:
        match = _MIG_MINOR_RE.match(line.strip())
        if match is None:
            continue  # "config 1", "monitor 2", blank lines
        gpu, gi, ci, minor = match.groups()
        minors[(int(gpu), int(gi), int(ci) if ci is not None else None)] = int(minor)
    return minors


def profile_from_name(name: str) -> str | None:
    """``"1g.5gb"`` from ``"NVIDIA A100-SXM4-40GB MIG 1g.5gb"``."""
    match = _MIG_PROFILE_RE.search(name)
    return match.group(1) if match is not None else None


def derived_profile(memory_mib: int, slices: int | None) -> str:
    """A profile name when the device name has none: ``"<slices>g.<GiB rounded up>gb"``."""
    gigabytes = math.ceil(memory_mib / 1024)
    return f"{slices}g.{gigabytes}gb" if slices else f"{gigabytes}gb"


def _mib(memory: Any) -> int:
    return int(memory.total) // (1024 * 1024)


def _placed(device: MigDevice, instance: migread.GpuInstance | None) -> MigDevice:
    if instance is None:
        return device
    return replace(device, profile_id=instance.profile_id, placement=instance.placement)


@dataclass(slots=True)
class _NvLinks:
    peers: Counter[str]  # links per remote GPU bus id (sysfs form)
    switch_links: int  # links that end at an NVSwitch


@dataclass(frozen=True, slots=True)
class Reading:
    """One read of the node: the inventory, and the NVML handle each of its GPUs was read through.

    The backend keeps the handles for the health checks: ``nvmlDeviceGetHandleByUUID``
    answers ``GPU_IS_LOST`` when *any* GPU is lost, so a GPU's own handle is the only way to
    ask about that GPU alone.
    """

    inventory: Inventory
    handles: dict[str, Any] = field(default_factory=dict)


class InventoryReader:
    """One synchronous read of the node. Call :meth:`read` from a worker thread.

    ``previous`` is the last reading; a GPU of it that is now lost keeps its record.
    """

    def __init__(
        self,
        nvml: ModuleType,
        *,
        backend: str,
        sysfs_root: Path,
        procfs_root: Path,
        previous: Reading | None = None,
    ) -> None:
        self._nvml = nvml
        self._backend = backend
        self._sysfs_root = sysfs_root
        self._procfs_root = procfs_root
        self._previous = previous
        self._problems: list[str] = []

    # --- call helpers ----------------------------------------------------------------

    def _q(self, doing: str, fn: Callable[..., Any], *args: Any) -> Any:
        """A required value: any NVML error becomes the matching typed error."""
        try:
            return fn(*args)
        except self._nvml.NVMLError as exc:
            raise translate(self._nvml, exc, doing) from exc

    def _opt(self, doing: str, name: str, *args: Any, skip: frozenset[int] = NOT_SUPPORTED_CODES) -> Any:
        """An optional value: None when the binding lacks ``name`` or NVML answers a code in ``skip``."""
        fn = getattr(self._nvml, name, None)
        if fn is None:
            return None
        try:
            return fn(*args)
        except self._nvml.NVMLError as exc:
            if nvml_code(self._nvml, exc) in skip:
                return None
            raise translate(self._nvml, exc, doing) from exc

    def _problem(self, line: str) -> None:
        self._problems.append(line)

    # --- the read ---------------------------------------------------------------------

    def read(self) -> Reading:
        """The node's GPUs; raises a BackendError only when the node-wide queries fail."""
        nvml = self._nvml
        driver = text(self._q("reading the driver version", nvml.nvmlSystemGetDriverVersion))
        cuda = self._opt("reading the CUDA driver version", "nvmlSystemGetCudaDriverVersion_v2")
        if cuda is None:
            cuda = self._opt("reading the CUDA driver version", "nvmlSystemGetCudaDriverVersion")
        count = int(self._q("counting GPUs", nvml.nvmlDeviceGetCount))
        mig_minors = read_mig_minors(self._procfs_root)
        handles: dict[str, Any] = {}
        gpus: list[Gpu] = []
        carried: set[str] = set()
        for index in range(count):
            read = self._read_gpu(index, mig_minors)
            if read is None:
                continue
            gpu, handle, kept = read
            if any(g.uuid == gpu.uuid for g in gpus):
                self._problem(f"GPU {index} ({gpu.uuid}): the same UUID as another GPU; left out")
                continue
            gpus.append(gpu)
            handles[gpu.uuid] = handle
            if kept:
                carried.add(gpu.uuid)
        inventory = Inventory(
            backend=self._backend,
            driver_version=driver,
            cuda_driver_version=cuda_version(int(cuda)) if cuda is not None else "",
            gpus=tuple(gpus),
            links=self._links(gpus, handles, carried),
            problems=tuple(self._problems),
        )
        return Reading(inventory=inventory, handles=handles)

    def _read_gpu(self, index: int, mig_minors: MigMinors | None) -> tuple[Gpu, Any, bool] | None:
        """(GPU, its handle, kept from the previous reading) or None when it cannot be read."""
        try:
            handle = self._q(f"GPU {index}: getting its handle", self._nvml.nvmlDeviceGetHandleByIndex, index)
            return self._gpu(index, handle, mig_minors), handle, False
        except GpuLostError as exc:
            kept = self._kept(index)
            if kept is not None:
                self._problem(f"{exc}; keeping its last known record")
                return (*kept, True)
            self._problem(str(exc))
        except BackendError as exc:
            self._problem(str(exc))
        except Exception as exc:  # a binding that answers with the wrong types: skip the device
            self._problem(f"GPU {index}: unexpected answer from NVML: {type(exc).__name__}: {exc}")
        log.warning("GPU left out of the inventory", index=index, problem=self._problems[-1])
        return None

    def _kept(self, index: int) -> tuple[Gpu, Any] | None:
        previous = self._previous
        if previous is None:
            return None
        for gpu in previous.inventory.gpus:
            if gpu.index == index and gpu.uuid in previous.handles:
                return gpu, previous.handles[gpu.uuid]
        return None

    def _gpu(self, index: int, handle: Any, mig_minors: MigMinors | None) -> Gpu:
        nvml = self._nvml
        uuid = text(self._q(f"GPU {index}: reading its UUID", nvml.nvmlDeviceGetUUID, handle))
        where = f"GPU {index} ({uuid})"
        minor = int(self._q(f"{where}: reading its minor number", nvml.nvmlDeviceGetMinorNumber, handle))
        name = text(self._q(f"{where}: reading its name", nvml.nvmlDeviceGetName, handle))
        arch = self._opt(f"{where}: reading its architecture", "nvmlDeviceGetArchitecture", handle)
        capability = self._opt(f"{where}: reading its compute capability", "nvmlDeviceGetCudaComputeCapability", handle)
        brand = self._opt(f"{where}: reading its brand", "nvmlDeviceGetBrand", handle)
        # integrated GPUs (shared system memory) answer NOT_SUPPORTED: no memory of their own
        memory = self._opt(f"{where}: reading memory info", "nvmlDeviceGetMemoryInfo", handle)
        pci = self._q(f"{where}: reading PCI info", nvml.nvmlDeviceGetPciInfo, handle)
        bus_id = text(pci.busId)
        mig_mode = self._opt(f"{where}: reading MIG mode", "nvmlDeviceGetMigMode", handle)
        mig_enabled = mig_mode is not None and int(mig_mode[0]) == _MIG_ENABLE
        memory_mib = _mib(memory) if memory is not None else 0
        profiles = self._mig_profiles(where, handle, memory_mib) if mig_mode is not None else ()
        migs = self.mig_devices(where, uuid, minor, handle, mig_minors, profiles) if mig_enabled else ()
        return Gpu(
            uuid=uuid,
            index=index,
            minor=minor,
            product_name=name,
            architecture=ARCHITECTURES.get(int(arch), "unknown") if arch is not None else "unknown",
            compute_capability=f"{int(capability[0])}.{int(capability[1])}" if capability is not None else "",
            memory_mib=memory_mib,
            pci_bus_id=bus_id,
            numa_node=sysfs.numa_node(self._sysfs_root, bus_id),
            mig_enabled=mig_enabled,
            mig_devices=migs,
            brand=BRANDS.get(int(brand), "") if brand is not None else "",
            pcie_root=sysfs.pcie_root(self._sysfs_root, bus_id),
            mig_memory_slices=migread.memory_slices(profiles),
            mig_profiles=profiles,
        )

    def _mig_profiles(self, where: str, handle: Any, memory_mib: int) -> tuple[MigProfile, ...]:
        """The MIG profiles of a MIG-capable GPU; () (and a problem line) when they cannot be read."""
        try:
            return migread.read_profiles(self._nvml, handle, memory_mib)
        except self._nvml.NVMLError as exc:
            error = translate(self._nvml, exc, f"{where}: reading its MIG profiles")
            if isinstance(error, GpuLostError):
                raise error from exc
            self._problem(f"{error}; no MIG profiles listed")
            return ()

    def mig_devices(
        self,
        where: str,
        parent_uuid: str,
        parent_minor: int,
        handle: Any,
        mig_minors: MigMinors | None,
        profiles: tuple[MigProfile, ...] = (),
    ) -> tuple[MigDevice, ...]:
        """The MIG devices of a GPU in MIG mode, placed where their GPU instances sit."""
        devices = self._mig_devices(where, parent_uuid, parent_minor, handle, mig_minors)
        if not devices or not profiles:
            return devices
        try:
            instances = {gi.id: gi for gi in migread.gpu_instances(self._nvml, handle, profiles)}
        except self._nvml.NVMLError as exc:
            error = translate(self._nvml, exc, f"{where}: listing its GPU instances")
            if isinstance(error, GpuLostError):
                raise error from exc
            if nvml_code(self._nvml, exc) not in NOT_SUPPORTED_CODES:
                self._problem(f"{error}; MIG placements not known")
            return devices
        return tuple(_placed(m, instances.get(m.gpu_instance_id)) for m in devices)

    def _mig_devices(
        self, where: str, parent_uuid: str, parent_minor: int, handle: Any, mig_minors: MigMinors | None
    ) -> tuple[MigDevice, ...]:
        nvml = self._nvml
        try:
            slots = int(self._q(f"{where}: reading its MIG device count", nvml.nvmlDeviceGetMaxMigDeviceCount, handle))
        except GpuLostError:
            raise
        except BackendError as exc:
            self._problem(f"{exc}; no MIG devices listed")
            return ()
        out: list[MigDevice] = []
        for slot in range(slots):
            mwhere = f"{where} MIG device {slot}"
            try:
                mig = self._opt(
                    f"{where}: getting MIG device {slot}",
                    "nvmlDeviceGetMigDeviceHandleByIndex",
                    handle,
                    slot,
                    skip=_EMPTY_MIG_SLOT,
                )
                if mig is None:
                    continue  # empty slot
                out.append(self.mig_device(mwhere, parent_uuid, parent_minor, slot, mig, mig_minors))
            except GpuLostError:
                raise  # the parent is gone: the whole GPU is unreadable
            except BackendError as exc:
                self._problem(f"{exc}; MIG device left out")
        return tuple(out)

    def mig_device(
        self, where: str, parent_uuid: str, parent_minor: int, slot: int, mig: Any, mig_minors: MigMinors | None
    ) -> MigDevice:
        """The MIG device behind MIG handle ``mig`` (slot ``slot`` of its parent)."""
        nvml = self._nvml
        uuid = text(self._q(f"{where}: reading its UUID", nvml.nvmlDeviceGetUUID, mig))
        gi = int(self._q(f"{where}: reading its GPU instance id", nvml.nvmlDeviceGetGpuInstanceId, mig))
        ci = int(self._q(f"{where}: reading its compute instance id", nvml.nvmlDeviceGetComputeInstanceId, mig))
        memory = self._opt(f"{where}: reading memory info", "nvmlDeviceGetMemoryInfo", mig)
        memory_mib = _mib(memory) if memory is not None else 0
        name = text(self._opt(f"{where}: reading its name", "nvmlDeviceGetName", mig) or "")
        profile = profile_from_name(name) or derived_profile(memory_mib, self._slices(where, mig))
        return MigDevice(
            uuid=uuid,
            parent_uuid=parent_uuid,
            index=slot,
            gpu_instance_id=gi,
            compute_instance_id=ci,
            profile=profile,
            memory_mib=memory_mib,
            gi_cap_minor=mig_minors.get((parent_minor, gi, None)) if mig_minors is not None else None,
            ci_cap_minor=mig_minors.get((parent_minor, gi, ci)) if mig_minors is not None else None,
        )

    def _slices(self, where: str, mig: Any) -> int | None:
        attrs = self._opt(f"{where}: reading its attributes", "nvmlDeviceGetAttributes", mig)
        slices = getattr(attrs, "gpuInstanceSliceCount", None)
        return int(slices) if slices else None

    # --- topology ---------------------------------------------------------------------

    def _links(self, gpus: list[Gpu], handles: dict[str, Any], carried: set[str]) -> dict[tuple[str, str], Link]:
        """Links between the GPUs read now; pairs with a kept (lost) GPU keep their last links."""
        fresh = [g for g in gpus if g.uuid not in carried]
        nvlinks = {g.uuid: self._nvlinks(g, handles[g.uuid]) for g in fresh}
        links: dict[tuple[str, str], Link] = {}
        for i, a in enumerate(gpus):
            for b in gpus[i + 1 :]:
                key = link_key(a.uuid, b.uuid)
                if a.uuid in carried or b.uuid in carried:
                    if self._previous is not None and key in self._previous.inventory.links:
                        links[key] = self._previous.inventory.links[key]
                    continue
                na, nb = nvlinks[a.uuid], nvlinks[b.uuid]
                direct = max(na.peers[sysfs_bus_id(b.pci_bus_id)], nb.peers[sysfs_bus_id(a.pci_bus_id)])
                # behind NVSwitches every GPU reaches every other over all its switch links
                switched = min(na.switch_links, nb.switch_links)
                links[key] = Link(
                    nvlinks=direct + switched, pcie=self._pcie_level(a, b, handles[a.uuid], handles[b.uuid])
                )
        return links

    def _pcie_level(self, a: Gpu, b: Gpu, ha: Any, hb: Any) -> PcieLevel:
        where = f"GPUs {a.index} ({a.uuid}) and {b.index} ({b.uuid}): reading their common PCIe ancestor"
        try:
            level = self._opt(where, "nvmlDeviceGetTopologyCommonAncestor", ha, hb)
        except BackendError as exc:
            self._problem(f"{exc}; assuming cross-socket")
            return PcieLevel.SYSTEM
        if level is None:
            return PcieLevel.SYSTEM
        try:
            return PcieLevel(int(level))
        except ValueError:
            log.debug("unknown NVML topology level; assuming cross-socket", uuid=a.uuid, peer=b.uuid, level=level)
            return PcieLevel.SYSTEM

    def _nvlinks(self, gpu: Gpu, handle: Any) -> _NvLinks:
        where = f"GPU {gpu.index} ({gpu.uuid})"
        # a link index the device does not have answers NOT_SUPPORTED or INVALID_ARGUMENT
        skip = NOT_SUPPORTED_CODES | {ERROR_INVALID_ARGUMENT, ERROR_NOT_FOUND}
        peers: Counter[str] = Counter()
        switch_links = 0
        max_links = int(getattr(self._nvml, "NVML_NVLINK_MAX_LINKS", _DEFAULT_MAX_LINKS))
        for link in range(max_links):
            doing = f"{where}: reading NVLink {link}"
            try:
                state = self._opt(doing, "nvmlDeviceGetNvLinkState", handle, link, skip=skip)
                if state is None or int(state) != _FEATURE_ENABLED:
                    continue
                pci = self._opt(doing, "nvmlDeviceGetNvLinkRemotePciInfo", handle, link, skip=skip)
                if pci is None:
                    continue
                kind = self._opt(doing, "nvmlDeviceGetNvLinkRemoteDeviceType", handle, link, skip=skip)
            except BackendError as exc:
                self._problem(f"{exc}; NVLinks from link {link} on not counted")
                break
            remote = sysfs_bus_id(text(pci.busId))
            if kind is not None and int(kind) == _NVLINK_DEVICE_TYPE_SWITCH:
                switch_links += 1
            else:
                peers[remote] += 1
        return _NvLinks(peers=peers, switch_links=switch_links)
